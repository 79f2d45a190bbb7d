"""A model with LoRA adapters, from a model without, and back (docs/lora.md).

- :func:`add_adapters`: attach fresh adapters (``B = 0``: the outputs do not change) to any loaded or
  initialised :class:`~ict_jax.model.qwen2.Qwen2`; its weights are kept, not copied (cast once when the
  spec's ``base_dtype`` differs). :func:`attach_lora`: those of the config's ``model.lora``, drawn from a
  run's init stream.
- :func:`merge_adapters`: the plain model with ``W + (alpha / r) A B`` in place of each adapted weight (what
  ``ict-jax export --format merged`` writes).
- :func:`split_adapters`: ``(graphdef, adapters, base)``, the states a trainer keeps apart.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from ict_jax.config import LoraSection
from ict_jax.model.config import LORA_MODULES, LoraSpec
from ict_jax.model.lora import adapter_keys, lora_spec
from ict_jax.model.qwen2 import Qwen2
from ict_jax.rng import INIT_STREAM, root_key, stream_key
from ict_jax.sharding import state_shardings


def split_adapters(model: Qwen2) -> tuple[Any, Any, Any]:
    """``(graphdef, adapters, base)``: the ``nnx.LoRAParam`` state (empty without LoRA) and every other
    parameter; ``nnx.merge(graphdef, adapters, base)`` is the model again (no copy either way)."""
    return nnx.split(model, nnx.LoRAParam, nnx.Param)


def _placement(state: Any) -> tuple[jax.sharding.Mesh | None, jax.sharding.Sharding]:
    """The mesh the arrays of ``state`` live on (None off a mesh) and a sharding for new arrays off it."""
    for leaf in jax.tree.leaves(state):
        sh = getattr(leaf, "sharding", None)
        if isinstance(sh, jax.sharding.NamedSharding):
            return sh.mesh, sh
        if sh is not None:
            return None, sh
    return None, jax.sharding.SingleDeviceSharding(jax.devices()[0])


def add_adapters(model: Qwen2, spec: LoraSpec, *, seed: int = 0) -> Qwen2:
    """``model`` with fresh LoRA adapters of ``spec`` (A as PEFT draws it, B = 0), placed like the model: on
    its mesh by the rule table, else on its device. The adapters are those ``init_model(config with lora,
    seed=seed)`` draws, so a random model and its adapters reproduce from the seed. The base arrays are
    reused; where ``spec.base_dtype`` differs from their dtype they are cast (a new copy: load the model in
    that dtype to avoid the transient double)."""
    if model.config.lora is not None:
        raise ValueError("add_adapters: the model already has LoRA adapters (merge_adapters first to replace them)")
    cfg = model.config.replace(lora=spec)
    graphdef, abs_adapters, abs_base = split_adapters(nnx.eval_shape(lambda: Qwen2(cfg, rngs=nnx.Rngs(seed))))
    _, base = nnx.split(model, nnx.Param)
    mesh, sharding = _placement(base)
    out_sh = state_shardings(abs_adapters, mesh) if mesh is not None else sharding

    def init() -> Any:  # only the adapters leave the jit: XLA drops the base's random init
        return split_adapters(Qwen2(cfg, rngs=nnx.Rngs(seed)))[1]

    if mesh is None:
        adapters = jax.jit(init, out_shardings=out_sh)()
    else:
        with jax.set_mesh(mesh):
            adapters = jax.jit(init, out_shardings=out_sh)()
    want = jnp.dtype(cfg.base_param_dtype)
    if any(leaf.dtype != want for leaf in jax.tree.leaves(base)):
        base = jax.jit(lambda s: jax.tree.map(lambda x: x.astype(want), s))(base)
    if jax.tree.structure(base) != jax.tree.structure(abs_base):
        raise ValueError("add_adapters: the model's parameters do not match its config")  # programming error
    return nnx.merge(graphdef, adapters, base)


def attach_lora(model: Qwen2, lora: LoraSection, seed: int) -> Qwen2:
    """``model`` with fresh adapters of the config's ``model.lora`` (``lora``; A drawn from the init stream of
    ``seed``, ``fold_in(PRNGKey(seed), INIT_STREAM)``, B = 0: the outputs do not change); ``model`` itself
    when LoRA is off or it carries adapters already. For a preset this is the model ``init_model(config
    with the adapters, init key)`` builds in one go."""
    spec = lora_spec(lora, model.config.num_layers)
    if spec is None or model.config.lora is not None:
        return model
    return add_adapters(model, spec, seed=stream_key(root_key(seed), INIT_STREAM))


def merge_adapters(model: Qwen2, *, dtype: str | None = None) -> Qwen2:
    """The plain :class:`Qwen2` (``config.lora = None``) whose adapted weights are ``W + (alpha / r) A B``,
    computed in float32, every parameter in ``dtype`` (default: the model's ``param_dtype``, the adapters'
    dtype). A model without adapters is returned cast to ``dtype`` (or as it is)."""
    c = model.config
    dtype = dtype or c.param_dtype
    if c.lora is None:
        if all(leaf.dtype == jnp.dtype(dtype) for leaf in jax.tree.leaves(nnx.state(model, nnx.Param))):
            return model
        graphdef, state = nnx.split(model)
        return nnx.merge(graphdef, jax.jit(lambda s: jax.tree.map(lambda x: x.astype(dtype), s))(state))
    plain = c.replace(lora=None, param_dtype=dtype)
    graphdef = nnx.split(nnx.eval_shape(lambda: Qwen2(plain, rngs=nnx.Rngs(0))))[0]
    _, adapters, base = split_adapters(model)
    names = {LORA_MODULES[t][0]: t for t in c.lora.targets}
    scale = c.lora.scale

    def merge(adapters: Any, base: Any) -> Any:
        def one(path: tuple, var: Any) -> Any:
            keys = [getattr(k, "key", k) for k in path]
            w = var[...].astype(jnp.float32)
            if keys[0] == "layers" and keys[-1] in names:
                a_key, b_key = adapter_keys(keys[-1])
                a, b = adapters["layers"]["lora"][a_key][...], adapters["layers"]["lora"][b_key][...]
                L, r = a.shape[0], a.shape[-1]
                delta = jnp.einsum("lir,lro->lio", a.reshape(L, -1, r).astype(jnp.float32),
                                   b.reshape(L, r, -1).astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
                w = w + scale * delta.reshape(w.shape)
            return var.replace(w.astype(dtype))

        return nnx.map_state(one, base)

    return nnx.merge(graphdef, jax.jit(merge)(adapters, base))
