"""The training state (policy parameters, optimizer state, step, root key) and its optimizer.

``init_train_state`` places the optimizer state like the parameters (Adam's moments sharded as their
parameter, counts replicated); ``reference_params`` is the KL reference copy (docs/method.md §4 (b)).
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.tree_util import tree_flatten_with_path, tree_unflatten
from jaxtyping import Array, Int

from ict_jax.config import Config
from ict_jax.sharding import replicated


@flax.struct.dataclass
class TrainState:
    """Policy parameters, optimizer state, the rollout-batch count and the run's root RNG key.

    ``graphdef`` (static, not saved) rebuilds the model from ``params`` inside the jitted step.
    """

    params: Any  # nnx.State of the policy's nnx.Param variables
    opt_state: Any
    step: Int[Array, ""]  # rollout batches done (docs/method.md §2 warm-up and the random-mask stream)
    rng: Any  # root key, uint32[2]
    graphdef: Any = flax.struct.field(pytree_node=False, default=None)

    def model(self) -> Any:
        return nnx.merge(self.graphdef, self.params)


def make_optimizer(config: Config, *, lr: float | None = None, total_updates: int | None = None
                   ) -> optax.GradientTransformation:
    """Global-norm clipping then AdamW with linear warmup and a constant or cosine schedule."""
    o = config.optim
    peak = o.lr if lr is None else lr
    total = total_updates or max(1, config.train.steps * config.train.mini_batches)
    warm = min(o.lr_warmup_steps, total)
    if o.schedule == "cosine":
        sched = optax.warmup_cosine_decay_schedule(0.0 if warm else peak, peak, warm, max(total, warm + 1), 0.0)
    elif warm:
        sched = optax.join_schedules([optax.linear_schedule(0.0, peak, warm), optax.constant_schedule(peak)], [warm])
    else:
        sched = optax.constant_schedule(peak)
    return optax.chain(optax.clip_by_global_norm(o.grad_clip),
                       optax.adamw(sched, b1=o.b1, b2=o.b2, weight_decay=o.weight_decay))


def init_train_state(config: Config, model: Any, *, tx: optax.GradientTransformation | None = None) -> TrainState:
    """A :class:`TrainState` for ``model`` (already placed on its mesh); the optimizer state follows the
    parameters' shardings."""
    graphdef, params = nnx.split(model, nnx.Param)
    tx = tx or make_optimizer(config)
    opt_state = init_opt_state(tx, params)
    step, rng = jnp.zeros((), jnp.int32), jax.random.PRNGKey(config.seed)
    sh = jax.tree.leaves(params)[0].sharding if jax.tree.leaves(params) else None
    # committed like the parameters (on a mesh: replicated over it), so the first call of the step
    # sees the same input placement as every later one (one executable, not two)
    target = replicated(sh.mesh) if isinstance(sh, jax.sharding.NamedSharding) else sh
    if target is not None:
        step, rng = jax.device_put((step, rng), target)
    return TrainState(params=params, opt_state=opt_state, step=step, rng=rng, graphdef=graphdef)


def init_opt_state(tx: optax.GradientTransformation, params: Any) -> Any:
    """``tx.init(params)`` placed like the parameters (moments sharded as their parameter, counts
    replicated), in one jitted call."""
    return jax.jit(tx.init, out_shardings=opt_state_shardings(tx, params))(params)


def opt_state_shardings(tx: optax.GradientTransformation, params: Any) -> Any:
    """Shardings for ``tx.init(params)``: a leaf whose key path ends with a parameter's key path (Adam's
    moments, ...) gets that parameter's sharding; the rest (step counts) is replicated."""
    p_leaves, _ = tree_flatten_with_path(params)
    by_path = {tuple(map(str, path)): leaf.sharding for path, leaf in p_leaves}
    if not by_path:
        return None
    any_sh = next(iter(by_path.values()))
    rep = jax.sharding.NamedSharding(any_sh.mesh, jax.sharding.PartitionSpec()) if isinstance(
        any_sh, jax.sharding.NamedSharding) else any_sh
    lengths = sorted({len(k) for k in by_path}, reverse=True)
    o_leaves, treedef = tree_flatten_with_path(jax.eval_shape(tx.init, params))
    out = []
    for path, _leaf in o_leaves:
        key = tuple(map(str, path))
        out.append(next((by_path[key[-n:]] for n in lengths if len(key) >= n and key[-n:] in by_path), rep))
    return tree_unflatten(treedef, out)


def reference_params(state_or_params: Any, dtype: str | Any = "float32") -> Any:
    """A copy of the policy parameters in the compute dtype, for the KL reference (docs/method.md §4 (b)):
    outside the optimizer, the donation and the checkpoint."""
    params = state_or_params.params if isinstance(state_or_params, TrainState) else state_or_params
    return jax.tree.map(lambda x: jnp.asarray(x, dtype).copy(), params)
