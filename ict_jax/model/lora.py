"""LoRA adapters inside the model (docs/lora.md): their variables, their forward term, the config.

A targeted projection ``y = x W`` (``W``: one of ``DecoderStack``'s stacked weights) becomes

    y = x W + s (x A) B,        s = alpha / rank,    A: [in, r],  B: [r, out]

per layer, with ``A`` drawn as PEFT's default (``kaiming_uniform_(a=sqrt(5))`` of torch's ``[r, in]``
weight: U(-1/sqrt(in), 1/sqrt(in))) and ``B = 0``, so a fresh adapter leaves the model unchanged.

Why our own module and not ``flax.nnx.LoRA`` / ``LoRALinear``: this model keeps every projection as ONE
weight stacked over the layers (``[L, D, H, hd]``, run under ``lax.scan`` or unrolled) and multiplies it
as one flattened 2-D matmul, while ``nnx.LoRA`` wraps one unstacked ``x @ a @ b`` (no scale, no layer
axis, He-uniform A). What we share with flax is the variable type: the adapters are
:class:`flax.nnx.LoRAParam`, so ``nnx.split(model, nnx.LoRAParam, nnx.Param)`` separates them from the
frozen base (``LoRAParam`` subclasses ``Param``: list it first). Their shapes and logical axes are read
from the base weight they adapt: ``A`` shards like the weight's input axes, ``B`` like its output axes,
and the rank axis (``lora_rank``) is replicated by the rule table.
"""

from __future__ import annotations

import math
import re
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from ict_jax.config import ConfigError, LoraSection
from ict_jax.model.config import LORA_MODULES, LoraSpec

#: Weights whose input is more than the last axis of the activations (``wo`` reads ``[.., H, hd]``).
_IN_DIMS = {"wo": 2}


def in_dims(weight: str) -> int:
    """How many leading (per-layer) axes of ``weight`` are its input: 2 for ``wo`` (heads, head_dim), else 1."""
    return _IN_DIMS.get(weight, 1)


def adapter_keys(weight: str) -> tuple[str, str]:
    """The names of ``weight``'s adapters ``(A, B)`` in :class:`LoraStack` and in ``DecoderStack.arrays()``."""
    return f"{weight}_lora_a", f"{weight}_lora_b"


def peft_module_name(target: str, layer: int) -> str:
    """The Hugging Face / PEFT module name of projection ``target`` in ``layer``
    (``model.layers.3.self_attn.q_proj``)."""
    return f"model.layers.{layer}.{LORA_MODULES[target][1]}.{target}"


class LoraStack(nnx.Module):
    """The adapters of every targeted projection, stacked on the leading ``layers`` axis like the weights they
    adapt. ``base`` is the ``DecoderStack`` (concrete or abstract): shapes and logical axes come from it."""

    def __init__(self, base: nnx.Module, spec: LoraSpec, dtype: Any, rngs: nnx.Rngs):
        r = spec.rank
        for target in spec.targets:
            name = LORA_MODULES[target][0]
            w = getattr(base, name)
            axes, k = w.get_metadata()["logical_axes"], in_dims(name)
            L, in_shape, out_shape = w.shape[0], tuple(w.shape[1:1 + k]), tuple(w.shape[1 + k:])
            bound = 1.0 / math.sqrt(math.prod(in_shape))
            a = jax.random.uniform(rngs.params(), (L, *in_shape, r), jnp.float32, -bound, bound).astype(dtype)
            a_key, b_key = adapter_keys(name)
            setattr(self, a_key, nnx.LoRAParam(a, logical_axes=(axes[0], *axes[1:1 + k], "lora_rank")))
            setattr(self, b_key, nnx.LoRAParam(jnp.zeros((L, r, *out_shape), dtype),
                                               logical_axes=(axes[0], "lora_rank", *axes[1 + k:])))
        self.targets = spec.targets

    def arrays(self) -> dict[str, jax.Array]:
        """``{"wq_lora_a": [L, D, r], "wq_lora_b": [L, r, H, hd], ...}`` for the targeted projections."""
        out = {}
        for target in self.targets:
            for key in adapter_keys(LORA_MODULES[target][0]):
                out[key] = getattr(self, key)[...]
        return out


def lora_delta(x: jax.Array, a: jax.Array, b: jax.Array, scale: float, dtype: Any, k: int = 1) -> jax.Array:
    """``scale * (x A) B`` for one layer: ``x [..., *in]``, ``a [*in, r]``, ``b [r, *out]`` -> ``[..., *out]``
    in ``dtype``. Two flattened 2-D matmuls in ``dtype`` with float32 accumulation, as the base projection
    (``model.qwen2``: XLA CPU's backward of 2-D dots is the fast one)."""
    lead, inner, r = x.shape[:-k], math.prod(x.shape[-k:]), a.shape[-1]
    xa = jnp.dot(x.reshape(-1, inner), a.astype(dtype).reshape(inner, r), preferred_element_type=jnp.float32)
    # (x A) B as a dot with a size-1 batch dimension: ``remat: block`` keeps the outputs of dots WITHOUT
    # batch dimensions (the projections' x W, [tokens, out]); this term is as large but cheap to recompute
    # from the kept x A (r wide), so it is not kept a second time (XLA drops the unit batch dimension)
    y = jax.lax.dot_general(xa.astype(dtype)[None], b.astype(dtype).reshape(1, r, -1), (((2,), (1,)), ((0,), (0,))),
                            preferred_element_type=jnp.float32)[0]
    return (y * scale).astype(dtype).reshape(lead + b.shape[1:])


# ------------------------------------------------------------------------------------------------
# From the config
# ------------------------------------------------------------------------------------------------
def lora_spec(section: LoraSection, num_layers: int) -> LoraSpec | None:
    """The :class:`LoraSpec` of the config's ``model.lora`` for a model of ``num_layers`` layers (None when
    LoRA is off). ``target_regex``, when set, replaces ``targets`` (:func:`regex_targets`)."""
    if not section.enabled:
        return None
    targets = section.targets if section.target_regex is None else regex_targets(section.target_regex, num_layers)
    return LoraSpec(rank=section.rank, alpha=section.alpha, targets=tuple(targets), base_dtype=section.base_dtype)


def regex_targets(pattern: str, num_layers: int) -> tuple[str, ...]:
    """The projections whose PEFT module names (``model.layers.N.self_attn.q_proj``, ...) ``pattern``
    full-matches, as PEFT reads a string ``target_modules``. The adapters are stacked over the layers, so a
    projection must be selected in every layer or in none: a :class:`ConfigError` (one line) otherwise, and
    when nothing is selected."""
    chosen = []
    for target in LORA_MODULES:
        hits = [i for i in range(num_layers) if re.fullmatch(pattern, peft_module_name(target, i))]
        if hits and len(hits) < num_layers:
            raise ConfigError(f"model.lora.target_regex: {pattern!r} selects {target} in {len(hits)} of the "
                              f"{num_layers} layers (e.g. {peft_module_name(target, hits[0])}); adapters are stacked "
                              "over the layers: select a projection in every layer or in none")
        if hits:
            chosen.append(target)
    if not chosen:
        raise ConfigError(f"model.lora.target_regex: {pattern!r} selects none of the projections LoRA can adapt "
                          f"(full names like {peft_module_name('q_proj', 0)}; projections: {', '.join(LORA_MODULES)})")
    return tuple(chosen)
