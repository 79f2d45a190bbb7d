"""Qwen2 / Qwen2.5 decoder in flax.nnx.

Layout: the decoder layers' parameters are stacked along a leading ``layers`` axis (one array per kind
of weight), so the same parameters run either under ``lax.scan`` (``scan_layers=True``: one compiled
layer body) or an unrolled loop, and checkpoints do not depend on that switch. Projection weights keep
their head structure (``wq: [L, D, H, hd]``) so the rule table can shard or replicate whole heads.

Numerics (docs/architecture.md): parameters in ``param_dtype``; activations and matmul inputs in the compute dtype
with float32 accumulation; RMSNorm, RoPE, softmax and the logits in float32.

Positions count real tokens only: ``pos = cumsum(attention_mask) - 1``, so left- and right-padded rows
give the same outputs at their real tokens as the unpadded sequence.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from ict_jax.model.attention import attend, blocked_attend
from ict_jax.model.config import ModelConfig
from ict_jax.model.fused_attention import IMPLEMENTATIONS as FUSED
from ict_jax.model.fused_attention import RESIDUALS, fused_attend
from ict_jax.model.lora import LoraStack, adapter_keys, lora_delta
from ict_jax.sharding import constrain, state_shardings


class KVCache(NamedTuple):
    """Decode state. ``k``/``v``: ``[L, B, KV, S, hd]`` (this layout is ~3x faster than ``[B, S, KV, hd]``
    for XLA CPU attention); ``mask[B, S]``: slot holds a real token; ``pos[B]``: next position id;
    ``index``: next slot to write (all rows advance together)."""

    k: jax.Array
    v: jax.Array
    mask: jax.Array
    pos: jax.Array
    index: jax.Array


def _dtype(name: str) -> Any:
    return jnp.dtype(name)


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple[str, ...], dtype: Any,
           init: str = "normal") -> nnx.Param:
    if init == "ones":
        value = jnp.ones(shape, dtype)
    elif init == "zeros":
        value = jnp.zeros(shape, dtype)
    else:
        value = (0.02 * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
    return nnx.Param(value, logical_axes=axes)


class DecoderStack(nnx.Module):
    """All decoder layers' weights, stacked on a leading ``layers`` axis; ``lora``: their LoRA adapters
    (:class:`ict_jax.model.lora.LoraStack`, set by :class:`Qwen2` when the config has ``lora``) or None."""

    def __init__(self, c: ModelConfig, rngs: nnx.Rngs):
        L, D, F, H, KV, hd = (c.num_layers, c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads,
                              c.resolved_head_dim)
        pd = _dtype(c.base_param_dtype)
        self.attn_norm = _param(rngs, (L, D), ("layers", "norm"), pd, "ones")
        self.wq = _param(rngs, (L, D, H, hd), ("layers", "embed", "q_heads", "head_dim"), pd)
        self.wk = _param(rngs, (L, D, KV, hd), ("layers", "embed", "kv_heads", "head_dim"), pd)
        self.wv = _param(rngs, (L, D, KV, hd), ("layers", "embed", "kv_heads", "head_dim"), pd)
        if c.qkv_bias:
            self.bq = _param(rngs, (L, H, hd), ("layers", "q_heads", "head_dim"), pd)
            self.bk = _param(rngs, (L, KV, hd), ("layers", "kv_heads", "head_dim"), pd)
            self.bv = _param(rngs, (L, KV, hd), ("layers", "kv_heads", "head_dim"), pd)
        self.wo = _param(rngs, (L, H, hd, D), ("layers", "q_heads", "head_dim", "embed"), pd)
        self.mlp_norm = _param(rngs, (L, D), ("layers", "norm"), pd, "ones")
        self.w_gate = _param(rngs, (L, D, F), ("layers", "embed", "mlp"), pd)
        self.w_up = _param(rngs, (L, D, F), ("layers", "embed", "mlp"), pd)
        self.w_down = _param(rngs, (L, F, D), ("layers", "mlp", "embed"), pd)
        self.lora = nnx.data(None)

    def arrays(self, adapters: bool = True) -> dict[str, jax.Array]:
        """Every stacked weight by name; with ``adapters`` (and LoRA) also the adapters (``wq_lora_a``, ...)."""
        names = ["attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down"]
        if hasattr(self, "bq"):
            names += ["bq", "bk", "bv"]
        out = {n: getattr(self, n)[...] for n in names}
        if adapters and self.lora is not None:
            out.update(self.lora.arrays())
        return out


# ------------------------------------------------------------------------------------------------
# Pure layer functions
# ------------------------------------------------------------------------------------------------
def rms_norm(x: jax.Array, weight: jax.Array, eps: float, out_dtype: Any) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * _lead(weight.astype(jnp.float32), y.ndim)).astype(out_dtype)


def _lead(w: jax.Array, ndim: int) -> jax.Array:
    """``w`` with leading axes of size 1 up to ``ndim``: broadcasting against activations is explicit
    (the package runs under ``jax_numpy_rank_promotion='raise'`` in the tests)."""
    return w.reshape((1,) * (ndim - w.ndim) + w.shape)


def rope_tables(pos: Int[Array, "B T"], head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos/sin ``[B, T, hd]`` in float32 (HF's non-interleaved ``rotate_half`` convention)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    ang = pos.astype(jnp.float32)[..., None] * inv_freq.reshape((1,) * pos.ndim + (-1,))
    ang = jnp.concatenate([ang, ang], axis=-1)
    return jnp.cos(ang), jnp.sin(ang)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """``x [B, T, N, hd]``; computed in float32, returned in x's dtype."""
    x32 = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rot = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    out = x32 * cos[:, :, None, :] + rot * sin[:, :, None, :]
    return out.astype(x.dtype)


def _proj(p: dict[str, jax.Array], name: str, x: jax.Array, c: ModelConfig, dtype: Any, k: int = 1,
          wide: bool = False) -> jax.Array:
    """Projection ``name`` of one layer's weights ``p``: ``x W``, plus ``(alpha / r) (x A) B`` when ``p``
    carries the projection's LoRA adapters (docs/lora.md)."""
    y = _mm(x, p[name], dtype, k, wide)
    a_key, b_key = adapter_keys(name)
    if a_key in p:
        y = y + lora_delta(x, p[a_key], p[b_key], c.lora.scale, dtype, k)
    return y


def _mm(a: jax.Array, b: jax.Array, dtype: Any, k: int = 1, wide: bool = False) -> jax.Array:
    """Contract the last ``k`` dims of activations ``a`` with the first ``k`` dims of weights ``b`` as ONE
    2-D matmul in ``dtype``: float32 accumulation inside the dot, the result in ``dtype``. Flattening to
    2-D makes XLA CPU's backward pass ~2.5x faster than the equivalent batched einsum (the weight gradient
    becomes a plain [in, M] x [M, out] dot).

    The result type is the compute dtype, not float32 cast back: a float32 result is written to memory
    and read again by the cast, and its transpose hands the backward dots float32 cotangents with the
    bfloat16 operands converted up (on the 0.5B TPU step 23 % of the bytes, docs/benchmarks.md "The
    step's bytes by category"); with ``preferred_element_type=dtype`` both passes stay in ``dtype``.
    ``wide``: the float32 result cast to ``dtype`` instead (the KV-cache passes' k and v, :func:`attention_qkv`)."""
    lead, inner, out = a.shape[:-k], math.prod(a.shape[-k:]), b.shape[k:]
    y = jnp.dot(a.astype(dtype).reshape(-1, inner), b.astype(dtype).reshape(inner, -1),
                preferred_element_type=jnp.float32 if wide else dtype)
    return y.astype(dtype).reshape(lead + out)


def attention_qkv(p: dict[str, jax.Array], x: jax.Array, c: ModelConfig, cos: jax.Array, sin: jax.Array, dtype: Any,
                  cache: bool = False):
    """The first half of a decoder block: pre-norm, q/k/v projections (+ biases) and RoPE.
    x ``[B, T, D]`` -> q ``[B, T, H, hd]``, k and v ``[B, KV, T, hd]`` (the KV-cache layout).

    ``cache`` (the KV-cache passes, never differentiated): k and v come out of float32 matmul results
    cast to ``dtype``. Returned in ``dtype`` by the dot itself, XLA TPU fuses the projection into the
    cache's in-place update and then copies each layer's cache out for attention: 2x the bytes of a
    decode step (tests/sampling/test_decode_bytes.py)."""
    h = rms_norm(x, p["attn_norm"], c.rms_norm_eps, dtype)
    q = _proj(p, "wq", h, c, dtype)  # [B, T, H, hd]
    k = _proj(p, "wk", h, c, dtype, wide=cache)
    v = _proj(p, "wv", h, c, dtype, wide=cache)
    if "bq" in p:
        q = q + _lead(p["bq"].astype(dtype), q.ndim)
        k = k + _lead(p["bk"].astype(dtype), k.ndim)
        v = v + _lead(p["bv"].astype(dtype), v.ndim)
    q = constrain(apply_rope(q, cos, sin), ("batch", "seq", "q_heads", "head_dim"))
    k = apply_rope(k, cos, sin)
    return q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # k, v: [B, KV, T, hd]


def finish_layer(p: dict[str, jax.Array], x: jax.Array, attn: jax.Array, c: ModelConfig, dtype: Any) -> jax.Array:
    """The second half of a decoder block: the output projection of ``attn`` ``[B, T, H, hd]`` added to
    the residual ``x``, then the pre-norm SwiGLU MLP and its residual."""
    x = x + _proj(p, "wo", attn, c, dtype, k=2)
    h = rms_norm(x, p["mlp_norm"], c.rms_norm_eps, dtype)
    g = _proj(p, "w_gate", h, c, dtype)
    u = _proj(p, "w_up", h, c, dtype)
    a = constrain((jax.nn.silu(g.astype(jnp.float32)) * u.astype(jnp.float32)).astype(dtype),
                  ("batch", "seq", "mlp"))
    x = x + _proj(p, "w_down", a, c, dtype)
    return constrain(x, ("batch", "seq", "act_embed"))


def decoder_layer(p, x, cos, sin, allowed, c: ModelConfig, dtype):
    """One pre-norm decoder block over a full sequence: x ``[B, T, D]`` -> ``[B, T, D]``; its attention
    by ``c.attention`` (:func:`sequence_attention`; ``allowed``: :meth:`Qwen2._full_sequence_tables`'s)."""
    q, k, v = attention_qkv(p, x, c, cos, sin, dtype)
    return finish_layer(p, x, sequence_attention(q, k, v, allowed, c, dtype), c, dtype)


def sequence_attention(q, k, v, allowed, c: ModelConfig, dtype) -> jax.Array:
    """Causal self-attention of a full sequence, q ``[B, T, H, hd]``, k/v ``[B, KV, T, hd]``, by
    ``c.resolved_attention()``: ``dense`` or ``blocked`` (:mod:`ict_jax.model.attention`) read ``allowed``
    as the causal & key mask ``[B, T, T]``; the fused kernels (:mod:`ict_jax.model.fused_attention`)
    read it as the key mask ``[B, T]`` (1: a real token) and are causal themselves."""
    kind = c.resolved_attention()
    if kind in FUSED:
        return fused_attend(q, k, v, allowed, dtype, kind)
    if kind == "blocked":
        return blocked_attend(q, k, v, allowed, dtype, c.attention_block)
    return attend(q, k, v, allowed, dtype)


def _remat(fn, mode: str):
    if mode == "none":
        return fn
    cp = jax.checkpoint_policies
    # block: the matmul outputs and the splash kernel's residuals (its output and log-sum-exp), so the
    # backward pass does not run the attention kernel's forward again
    policy = (cp.save_from_both_policies(cp.dots_with_no_batch_dims_saveable, cp.save_only_these_names(RESIDUALS))
              if mode == "block" else cp.nothing_saveable)
    return jax.checkpoint(fn, policy=policy, static_argnums=(5, 6))


def positions_from_mask(mask: Int[Array, "B T"]) -> Int[Array, "B T"]:
    """Position ids that count real tokens only (0 at padding before the first real token)."""
    return jnp.maximum(jnp.cumsum(mask.astype(jnp.int32), axis=1) - 1, 0)


# ------------------------------------------------------------------------------------------------
# The module
# ------------------------------------------------------------------------------------------------
class Qwen2(nnx.Module):
    """Qwen2 causal LM: token embedding, RoPE, GQA attention (q/k/v bias flag), SwiGLU MLP, RMSNorm,
    tied or untied head.

    - ``model(input_ids, attention_mask)`` -> float32 logits ``[B, T, V]``.
    - ``model.hidden_states(...)`` -> post-final-norm hidden states ``[B, T, D]`` (compute dtype) and
      ``model.unembedding()`` -> ``[D, V]``: token statistics multiply the two in blocks.
    - ``model.init_cache`` / ``model.extend`` / ``model.decode`` -> KV-cache incremental decoding.
    - with ``config.lora``: LoRA adapters (``nnx.LoRAParam``) on the targeted projections; every forward
      (and the sampler) runs the adapted model, ``hidden_states(..., adapters=False)`` the base alone.
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        c = config
        self.config = c
        pd = _dtype(c.base_param_dtype)
        self.embed = _param(rngs, (c.vocab_size, c.hidden_size), ("vocab", "embed"), pd)
        self.layers = DecoderStack(c, rngs)
        self.final_norm = _param(rngs, (c.hidden_size,), ("norm",), pd, "ones")
        if not c.tie_word_embeddings:
            self.lm_head = _param(rngs, (c.hidden_size, c.vocab_size), ("embed", "vocab"), pd)
        if c.lora is not None:  # last: the base weights draw the same numbers with and without adapters
            self.layers.lora = LoraStack(self.layers, c.lora, _dtype(c.param_dtype), rngs)

    # -- helpers ---------------------------------------------------------------------------------
    @property
    def compute_dtype(self) -> Any:
        return _dtype(self.config.resolved_compute_dtype())

    def unembedding(self) -> Float[Array, "D V"]:
        """The ``[D, V]`` output matrix in the compute dtype (the transposed embedding when tied)."""
        w = self.embed[...].T if self.config.tie_word_embeddings else self.lm_head[...]
        return w.astype(self.compute_dtype)

    def _embed(self, ids: jax.Array) -> jax.Array:
        x = jnp.take(self.embed[...], ids, axis=0).astype(self.compute_dtype)
        return constrain(x, ("batch", "seq", "act_embed"))

    def _run_layers(self, x, cos, sin, allowed, adapters: bool = True):
        c, dtype = self.config, self.compute_dtype
        params = self.layers.arrays(adapters)
        layer = _remat(decoder_layer, c.remat)
        if c.scan_layers:
            def body(h, p):
                return layer(p, h, cos, sin, allowed, c, dtype), None

            x, _ = jax.lax.scan(body, x, params)
        else:
            for i in range(c.num_layers):
                x = layer({k: v[i] for k, v in params.items()}, x, cos, sin, allowed, c, dtype)
        return x

    # -- full forward ----------------------------------------------------------------------------
    def _full_sequence_tables(self, input_ids, attention_mask):
        """RoPE tables from real-token positions, and the attention's mask: the causal & key-padding mask
        ``[B, T, T]`` for ``dense`` and ``blocked``, the key mask ``[B, T]`` for a fused kernel
        (:func:`sequence_attention`)."""
        B, T = input_ids.shape
        mask = jnp.ones((B, T), jnp.int32) if attention_mask is None else attention_mask.astype(jnp.int32)
        cos, sin = rope_tables(positions_from_mask(mask), self.config.resolved_head_dim, self.config.rope_theta)
        if self.config.resolved_attention() in FUSED:
            return cos, sin, mask
        allowed = jnp.tril(jnp.ones((T, T), bool))[None] & (mask[:, None, :] > 0)
        return cos, sin, allowed

    def hidden_states(self, input_ids: Int[Array, "B T"], attention_mask: Int[Array, "B T"] | None = None, *,
                      adapters: bool = True) -> Float[Array, "B T D"]:
        """Post-final-norm hidden states ``[B, T, D]`` in the compute dtype. ``adapters=False``: the LoRA
        adapters' contribution removed, i.e. the frozen base model (the KL reference, docs/lora.md)."""
        cos, sin, allowed = self._full_sequence_tables(input_ids, attention_mask)
        x = self._run_layers(self._embed(input_ids), cos, sin, allowed, adapters)
        return rms_norm(x, self.final_norm[...], self.config.rms_norm_eps, self.compute_dtype)

    def predicting_states(self, tokens: Int[Array, "B L"], attention_mask: Int[Array, "B L"] | None = None,
                          num_targets: int | None = None, *, adapters: bool = True
                          ) -> tuple[Float[Array, "B N D"], Int[Array, "B N"]]:
        """The hidden states that predict ``tokens``' last ``num_targets`` positions, and those targets.

        ``hidden[:, t]`` predicts ``tokens[:, t + 1]``: the forward pass reads ``tokens[:, :-1]`` and the
        last ``N`` of its states predict ``tokens[:, -N:]`` (``N = num_targets``, default all ``L - 1``).
        Returns ``(hidden [B, N, D], targets [B, N])``, the inputs of
        :func:`ict_jax.rl.token_stats.stats_from_hidden` for a prompt + response row. ``adapters``: as in
        :meth:`hidden_states`."""
        n = tokens.shape[1] - 1 if num_targets is None else num_targets
        if not 1 <= n <= tokens.shape[1] - 1:
            raise ValueError(f"num_targets={n}: a row of {tokens.shape[1]} tokens has 1..{tokens.shape[1] - 1} "
                             "predicted positions")
        mask = None if attention_mask is None else attention_mask[:, :-1]
        return self.hidden_states(tokens[:, :-1], mask, adapters=adapters)[:, -n:], tokens[:, -n:]

    def layer_states(self, input_ids: Int[Array, "B T"],
                     attention_mask: Int[Array, "B T"] | None = None) -> list[jax.Array]:
        """The residual stream after each decoder layer (unrolled; for layered parity tests and
        inspection), then the post-final-norm state: ``num_layers + 1`` arrays ``[B, T, D]``."""
        c, dtype = self.config, self.compute_dtype
        cos, sin, allowed = self._full_sequence_tables(input_ids, attention_mask)
        params, x, out = self.layers.arrays(), self._embed(input_ids), []
        for i in range(c.num_layers):
            x = decoder_layer({k: v[i] for k, v in params.items()}, x, cos, sin, allowed, c, dtype)
            out.append(x)
        return out + [rms_norm(x, self.final_norm[...], c.rms_norm_eps, dtype)]

    def logits_from_hidden(self, h: jax.Array) -> jax.Array:
        return jnp.einsum("...d,dv->...v", h, self.unembedding(), preferred_element_type=jnp.float32)

    def __call__(self, input_ids: Int[Array, "B T"], attention_mask: Int[Array, "B T"] | None = None, *,
                 adapters: bool = True) -> Float[Array, "B T V"]:
        """float32 logits ``[B, T, V]``. Materialises the full logits: training code uses
        :meth:`hidden_states` + :func:`ict_jax.stats_from_hidden` instead."""
        return self.logits_from_hidden(self.hidden_states(input_ids, attention_mask, adapters=adapters))

    # -- KV-cache decoding -----------------------------------------------------------------------
    def init_cache(self, batch: int, max_len: int, dtype: Any = None) -> KVCache:
        c = self.config
        dt = self.compute_dtype if dtype is None else _dtype(dtype) if isinstance(dtype, str) else dtype
        shape = (c.num_layers, batch, c.num_kv_heads, max_len, c.resolved_head_dim)
        return KVCache(k=jnp.zeros(shape, dt), v=jnp.zeros(shape, dt), mask=jnp.zeros((batch, max_len), jnp.int32),
                       pos=jnp.zeros((batch,), jnp.int32), index=jnp.zeros((), jnp.int32))

    def extend(self, input_ids: Int[Array, "B T"], attention_mask: Int[Array, "B T"] | None,
               cache: KVCache, window: int | None = None, *,
               prefill: bool = False) -> tuple[Float[Array, "B T D"], KVCache]:
        """Append ``T`` tokens to the cache (slots ``index .. index+T-1``) and return their post-norm
        hidden states. Prefill is ``extend`` on an empty cache; decode is ``extend`` with ``T = 1``.
        Padding tokens (mask 0) occupy a slot that no later token attends to. ``window`` (static): the
        new tokens attend over the cache's first ``window`` slots only (the caller keeps
        ``index + T <= window``; the sampler's decode phases, docs/sampler.md); None = every slot.
        ``prefill`` (static): the cache is empty (``index`` 0), so the new tokens attend among themselves:
        with a fused ``model.attention`` through its kernel (:func:`sequence_attention`), else over the
        cache as any extend does (the same result)."""
        c, dtype = self.config, self.compute_dtype
        B, T = input_ids.shape
        S = cache.mask.shape[1] if window is None else window
        mask = jnp.ones((B, T), jnp.int32) if attention_mask is None else attention_mask.astype(jnp.int32)
        # a row continues from cache.pos: its first new real token gets position cache.pos
        pos = jnp.maximum(cache.pos[:, None] + jnp.cumsum(mask, axis=1) - 1, 0)
        cos, sin = rope_tables(pos, c.resolved_head_dim, c.rope_theta)
        new_mask = jax.lax.dynamic_update_slice(cache.mask, mask, (0, cache.index))
        slot = jnp.arange(S)
        qslot = cache.index + jnp.arange(T)
        seen = new_mask if window is None else new_mask[:, :window]
        allowed = (slot[None, None, :] <= qslot[None, :, None]) & (seen[:, None, :] > 0)
        params = self.layers.arrays()
        kdt = cache.k.dtype
        fused = prefill and T > 1 and c.resolved_attention() in FUSED

        def body(x, inputs):
            p, k_l, v_l = inputs
            q, k, v = attention_qkv(p, x, c, cos, sin, dtype, cache=True)
            k_l = jax.lax.dynamic_update_slice(k_l, k.astype(kdt), (0, 0, cache.index, 0))
            v_l = jax.lax.dynamic_update_slice(v_l, v.astype(kdt), (0, 0, cache.index, 0))
            if fused:  # an empty cache: the new tokens' own keys, in the cache's dtype as a decode reads them
                attn = sequence_attention(q, k.astype(kdt), v.astype(kdt), mask, c, dtype)
            else:
                k_a, v_a = (k_l, v_l) if window is None else (k_l[:, :, :window], v_l[:, :, :window])
                attn = attend(q, k_a.astype(dtype), v_a.astype(dtype), allowed, dtype)
            x = finish_layer(p, x, attn, c, dtype)
            return x, (k_l, v_l)

        def scan_body(carry, p):
            # a decode step: the whole cache rides in the carry and each layer writes its new slot in place;
            # scanning over the cache as xs and stacking ys copies every layer's cache at every step (read
            # and written once more than attention needs: 3x the cache traffic, measured on the HLO)
            x, ks, vs, i = carry
            q, k, v = attention_qkv(p, x, c, cos, sin, dtype, cache=True)
            at = (i, 0, 0, cache.index, 0)
            ks = jax.lax.dynamic_update_slice(ks, k.astype(kdt)[None], at)
            vs = jax.lax.dynamic_update_slice(vs, v.astype(kdt)[None], at)
            k_a = jax.lax.dynamic_index_in_dim(ks, i, 0, keepdims=False)
            v_a = jax.lax.dynamic_index_in_dim(vs, i, 0, keepdims=False)
            if window is not None:
                k_a, v_a = k_a[:, :, :window], v_a[:, :, :window]
            x = finish_layer(p, x, attend(q, k_a.astype(dtype), v_a.astype(dtype), allowed, dtype), c, dtype)
            return (x, ks, vs, i + 1), None

        x = self._embed(input_ids)
        if c.scan_layers and T == 1:  # a decode step
            (x, ks, vs, _), _ = jax.lax.scan(scan_body, (x, cache.k, cache.v, jnp.int32(0)), params)
        elif c.scan_layers:  # a prefill writes whole layers of the cache: xs in, ys out
            x, (ks, vs) = jax.lax.scan(body, x, (params, cache.k, cache.v))
        else:
            ks_l, vs_l = [], []
            for i in range(c.num_layers):
                x, (k_i, v_i) = body(x, ({k: v[i] for k, v in params.items()}, cache.k[i], cache.v[i]))
                ks_l.append(k_i)
                vs_l.append(v_i)
            ks, vs = jnp.stack(ks_l), jnp.stack(vs_l)
        h = rms_norm(x, self.final_norm[...], c.rms_norm_eps, dtype)
        new_cache = KVCache(k=ks, v=vs, mask=new_mask, pos=cache.pos + mask.sum(axis=1), index=cache.index + T)
        return h, new_cache

    def decode(self, tokens: Int[Array, " B"], cache: KVCache,
               window: int | None = None) -> tuple[Float[Array, "B V"], KVCache]:
        """One decode step: float32 logits ``[B, V]`` for the next token, and the updated cache
        (``window``: as in :meth:`extend`)."""
        h, cache = self.extend(tokens[:, None], None, cache, window)
        return self.logits_from_hidden(h[:, 0]), cache


# ------------------------------------------------------------------------------------------------
# Construction
# ------------------------------------------------------------------------------------------------
def init_model(config: ModelConfig, *, seed: int | jax.Array = 0, mesh: jax.sharding.Mesh | None = None) -> Qwen2:
    """A randomly initialised :class:`Qwen2`, built by one jitted init. ``seed``: an int or a key (a run
    passes its init stream, ``ict_jax.rng``). With ``mesh`` it is created directly sharded by the rule
    table (``out_shardings``: no host copy, no per-device copy)."""
    abstract = nnx.eval_shape(lambda: Qwen2(config, rngs=nnx.Rngs(seed)))
    graphdef, abs_state = nnx.split(abstract)

    def _init():
        return nnx.split(Qwen2(config, rngs=nnx.Rngs(seed)))[1]

    if mesh is None:
        # committed to the default device, as every jit output that later replaces them will be: the
        # first call of a jitted step then sees the same placement as all later ones (one executable)
        return nnx.merge(graphdef, jax.jit(_init, out_shardings=jax.sharding.SingleDeviceSharding(jax.devices()[0]))())
    with jax.set_mesh(mesh):
        state = jax.jit(_init, out_shardings=state_shardings(abs_state, mesh))()
    return nnx.merge(graphdef, state)


def param_count(config_or_model: ModelConfig | Qwen2) -> int:
    """Parameter count of a :class:`ModelConfig` (from ``jax.eval_shape``: allocates nothing) or of a
    model (its own parameters). Anything else is a ``TypeError`` that says what it takes."""
    if isinstance(config_or_model, Qwen2):
        return sum(int(x.size) for x in jax.tree.leaves(nnx.state(config_or_model, nnx.Param)))
    if not isinstance(config_or_model, ModelConfig):
        raise TypeError(f"param_count takes a ModelConfig or a Qwen2 model, got {type(config_or_model).__name__}")
    abstract = nnx.eval_shape(lambda: Qwen2(config_or_model, rngs=nnx.Rngs(0)))
    return sum(int(x.size) for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
