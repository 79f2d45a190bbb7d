"""The training state (policy parameters, optimizer state, step, root key) and its optimizer.

``init_train_state`` places the optimizer state like the parameters (Adam's moments sharded as their
parameter, counts replicated); ``reference_params`` is the KL reference copy (docs/method.md §4 (b)).

With LoRA (docs/lora.md) the state keeps the model in two parts: ``params`` = the adapters (what trains:
the gradient, the optimizer state and the checkpointed weights) and ``frozen`` = the base model's
parameters (no gradient, no optimizer state). The KL reference is then the same model with the adapters
off (:func:`kl_reference`): no reference copy of the weights exists.
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
class ModelDef:
    """What the forward pass needs besides the trainable parameters: the model's ``graphdef`` (static),
    the ``frozen`` parameters (the LoRA base; None when every parameter trains) and whether the LoRA
    adapters run (``adapters=False``: the base model alone, the KL reference of a LoRA run)."""

    graphdef: Any = flax.struct.field(pytree_node=False)
    frozen: Any = None
    adapters: bool = flax.struct.field(pytree_node=False, default=True)

    def merge(self, params: Any) -> Any:
        """The model from the trainable ``params`` (and the frozen ones)."""
        if self.frozen is None:
            return nnx.merge(self.graphdef, params)
        return nnx.merge(self.graphdef, params, self.frozen)


def as_model_def(graphdef_or_def: Any) -> ModelDef:
    """A :class:`ModelDef` from itself or from a plain ``graphdef`` (every parameter trains)."""
    return graphdef_or_def if isinstance(graphdef_or_def, ModelDef) else ModelDef(graphdef_or_def)


@flax.struct.dataclass
class TrainState:
    """Trainable parameters, optimizer state, the rollout-batch count and the run's root RNG key.

    ``params``: what trains: the policy's ``nnx.Param`` state, or with LoRA its adapters (``nnx.LoRAParam``).
    ``frozen``: with LoRA, the base model's parameters (no gradient, no optimizer state); None otherwise.
    ``graphdef`` (static, not saved) rebuilds the model from both inside the jitted step.
    :meth:`model_state` is the whole model's state (what the sampler and export read).
    """

    params: Any  # nnx.State: every nnx.Param of the policy, or with LoRA only the adapters
    opt_state: Any
    step: Int[Array, ""]  # rollout batches done (docs/method.md §2 warm-up and the random-mask stream)
    rng: Any  # root key, uint32[2]
    graphdef: Any = flax.struct.field(pytree_node=False, default=None)
    frozen: Any = None  # nnx.State of the frozen base (LoRA), or None

    def model_state(self) -> Any:
        """The whole model's ``nnx.State`` (trainable and frozen; no copy): ``nnx.merge(graphdef, it)``."""
        return self.params if self.frozen is None else nnx.merge_state(self.params, self.frozen)

    def model(self) -> Any:
        return nnx.merge(self.graphdef, self.model_state())

    def model_def(self, *, adapters: bool = True) -> ModelDef:
        """The :class:`ModelDef` that rebuilds the model from ``params`` (``adapters=False``: the base alone)."""
        return ModelDef(self.graphdef, self.frozen, adapters)


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
    parameters' shardings. A model with LoRA adapters (``nnx.LoRAParam`` variables) trains only them: they
    are ``params``, the rest is ``frozen`` (no copy is made)."""
    graphdef, params, frozen = split_trainable(model)
    tx = tx or make_optimizer(config)
    opt_state = init_opt_state(tx, params)
    step, rng = jnp.zeros((), jnp.int32), jax.random.PRNGKey(config.seed)
    sh = jax.tree.leaves(params)[0].sharding if jax.tree.leaves(params) else None
    # committed like the parameters (on a mesh: replicated over it), so the first call of the step
    # sees the same input placement as every later one (one executable, not two)
    target = replicated(sh.mesh) if isinstance(sh, jax.sharding.NamedSharding) else sh
    if target is not None:
        step, rng = jax.device_put((step, rng), target)
    return TrainState(params=params, opt_state=opt_state, step=step, rng=rng, graphdef=graphdef, frozen=frozen)


def split_trainable(model: Any) -> tuple[Any, Any, Any]:
    """``(graphdef, trainable, frozen)`` of a model (concrete or from ``nnx.eval_shape``): with LoRA adapters
    (``nnx.LoRAParam`` variables) the adapters train and every other parameter is frozen; without, every
    ``nnx.Param`` trains and ``frozen`` is None. The one place that decides what a train state trains."""
    if jax.tree.leaves(nnx.state(model, nnx.LoRAParam)):
        return nnx.split(model, nnx.LoRAParam, nnx.Param)
    graphdef, params = nnx.split(model, nnx.Param)
    return graphdef, params, None


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
    outside the optimizer, the donation and the checkpoint. None for a LoRA state: its reference is its
    own base with the adapters off (:func:`kl_reference`), so no copy is made."""
    if isinstance(state_or_params, TrainState) and state_or_params.frozen is not None:
        return None
    params = state_or_params.params if isinstance(state_or_params, TrainState) else state_or_params
    return jax.tree.map(lambda x: jnp.asarray(x, dtype).copy(), params)


def check_lora_state(config: Config, state: TrainState) -> None:
    """ValueError (one line) when the config asks for LoRA (``model.lora.enabled``) but ``state`` holds no
    adapters: every parameter would train, silently, instead of the adapters."""
    if config.model.lora.enabled and state.frozen is None:
        raise ValueError("model.lora.enabled is true but the train state holds no LoRA adapters (every parameter "
                         "would train): build the model with ict_jax.add_adapters(model, ict_jax.model.lora.lora_spec("
                         "config.model.lora, num_layers)) before init_train_state")


def kl_reference(state: TrainState, ref_params: Any) -> tuple[Any, ModelDef]:
    """``(params, model def)`` of the KL reference policy (docs/method.md §4 (b)): with LoRA the state's
    own model with the adapters off (the frozen base: nothing copied, ``ref_params`` must be None);
    otherwise ``ref_params`` under the state's graph."""
    if state.frozen is not None:
        if ref_params is not None:
            raise ValueError("with LoRA adapters the KL reference is the frozen base with the adapters off: "
                             "pass ref_params=None (no reference copy)")
        return state.params, state.model_def(adapters=False)
    return ref_params, state.model_def()
