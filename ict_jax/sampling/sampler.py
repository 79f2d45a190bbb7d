"""Rollouts: a jitted KV-cache sampler that draws G responses per prompt (docs/architecture.md data path).

One compiled program per (shapes, static settings): prefill the P left-padded prompts once, repeat the
KV cache G times along the batch (rows prompt-major: ``row = p * G + j``, docs/method.md notation), then a
``lax.while_loop`` decode that stops as soon as every row has emitted an EOS id. Output shapes are fixed
at ``max_new_tokens`` whatever the stopping step.

Each decoded token is drawn by :func:`ict_jax.sampling.draw.sample_token` (one uniform per row, exact
inverse CDF; its ``logp`` is over the full vocabulary before top-k/top-p truncation, the ``Rollout.logp``
below).

Randomness: the uniforms of decode step t are ``uniform(fold_in(key, t), [P*G])`` drawn for the whole
batch at once, so a row's draw does not depend on how the batch is sharded: 1 and 8 devices give the
same tokens for the same key.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding
from jaxtyping import Array, Bool, Float, Int

from ict_jax.buckets import response_buckets
from ict_jax.config import RolloutSection
from ict_jax.model.attention import MASKED, attend
from ict_jax.model.qwen2 import KVCache, attention_qkv, finish_layer, rms_norm, rope_tables
from ict_jax.sampling.draw import sample_token as _sample_token
from ict_jax.sharding import BATCH_AXES, check_prompts_divide, constrain, gather_fsdp

#: On CPU, decode unrolls the layer loop over per-layer weights by default up to this depth (no
#: per-layer scan overhead and no per-step weight copies; compile time grows with depth). Elsewhere the
#: default is the model's ``lax.scan`` decode: the per-layer weights are a temporary copy of the layer
#: weights for the duration of a call, memory an accelerator training run may not have.
UNROLL_MAX_LAYERS = 32
_ROLLOUT = RolloutSection()  # the config tree's defaults (one source per default)


@struct.dataclass
class Rollout:
    """G responses per prompt, rows prompt-major (``row = p * G + j``), N = ``max_new_tokens``.

    - ``tokens [P*G, N]`` int32: sampled ids, ``pad_id`` after the EOS that ended the row;
    - ``valid [P*G, N]`` bool: real response tokens, the ending EOS included, padding excluded;
    - ``logp [P*G, N]`` float32: log softmax(logits / temperature)[token] before top-k/top-p truncation
      (0 where not valid);
    - ``lengths [P*G]`` int32: ``valid.sum(1)``;
    - ``truncated [P*G]`` bool: the row hit ``max_new_tokens`` without an EOS.
    """

    tokens: Int[Array, "B N"]
    valid: Bool[Array, "B N"]
    logp: Float[Array, "B N"]
    lengths: Int[Array, " B"]
    truncated: Bool[Array, " B"]


# ------------------------------------------------------------------------------------------------
# The generation program
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SampleSettings:
    """Static settings of a compiled generate program (part of its cache key)."""

    num_samples: int = 1
    max_new_tokens: int = 64
    temperature: float = _ROLLOUT.temperature
    top_p: float = _ROLLOUT.top_p
    top_k: int = _ROLLOUT.top_k
    eos_ids: tuple[int, ...] = ()
    greedy: bool = False
    kv_cache_dtype: str | None = None
    pad_id: int = 0
    unroll_layers: bool | None = None  # None: unroll on CPU when num_layers <= UNROLL_MAX_LAYERS
    # decode phases of a growing KV cache (ict_jax.buckets.response_buckets); None: one phase, the whole cache
    min_response_bucket: int | None = _ROLLOUT.min_response_bucket
    # under an FSDP mesh: the weights gathered once a call, before the decode loop (sharding.gather_fsdp)
    gather_weights: bool = True

    def __post_init__(self) -> None:
        if self.num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {self.num_samples}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.greedy and not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 (use greedy=True for argmax), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.min_response_bucket is not None and self.min_response_bucket < 1:
            raise ValueError("min_response_bucket must be >= 1 (None = one decode phase), "
                             f"got {self.min_response_bucket}")


def decode_unrolled(settings: SampleSettings, num_layers: int, backend: str | None = None) -> bool:
    """Whether the decode unrolls the layer loop over per-layer weights: ``settings.unroll_layers``, or
    when that is None, on a CPU (``backend``: the platform the program is compiled for, default JAX's
    default backend) for a model of at most :data:`UNROLL_MAX_LAYERS` layers."""
    if settings.unroll_layers is not None:
        return bool(settings.unroll_layers)
    backend = jax.default_backend() if backend is None else backend
    return backend == "cpu" and num_layers <= UNROLL_MAX_LAYERS


def phase_ends(settings: SampleSettings, prompt_len: int) -> tuple[int, ...] | None:
    """The KV-cache slots where each decode phase ends, ``prompt_len + w - 1`` for each response bucket
    ``w`` of ``max_new_tokens`` (``min_response_bucket``, docs/sampler.md); None when the decode is one
    phase over the whole cache of ``prompt_len + max_new_tokens - 1`` slots."""
    windows = response_buckets(settings.max_new_tokens, settings.min_response_bucket)
    return tuple(prompt_len + w - 1 for w in windows) if len(windows) > 1 else None


def decode_steps(max_new_tokens: int, min_response_bucket: int | None) -> tuple[int, ...]:
    """The decode steps of each phase of a sampler that runs to ``max_new_tokens`` (no row stops early):
    the first token is drawn from the prefill's logits, so phase 0 decodes ``windows[0] - 1`` steps and
    phase j ``windows[j] - windows[j-1]`` (:func:`ict_jax.buckets.response_buckets`); ``ict-jax compile``'s
    roofline counts the decode loops at these lengths."""
    windows = response_buckets(max_new_tokens, min_response_bucket)
    return tuple(w - p for w, p in zip(windows, (1, *windows)))


def cache_chunks(settings: SampleSettings, num_layers: int, prompt_len: int,
                 backend: str | None = None) -> tuple[int, ...] | None:
    """The slots of each chunk of one layer's KV cache as the sampler holds it: one chunk a decode phase
    when the decode is unrolled (:func:`decode_unrolled`) and has more than one phase
    (:func:`phase_ends`); None when each layer's cache is one array. ``ict-jax compile`` asks it which
    arrays a sampler program holds."""
    ends = phase_ends(settings, prompt_len)
    if ends is None or not decode_unrolled(settings, num_layers, backend):
        return None
    return tuple(b - a for a, b in zip((0, *ends), ends))


def _cache_constrain(cache: KVCache) -> KVCache:
    return KVCache(k=constrain(cache.k, ("layers", "batch", "kv_heads", "cache_seq", "head_dim")),
                   v=constrain(cache.v, ("layers", "batch", "kv_heads", "cache_seq", "head_dim")),
                   mask=constrain(cache.mask, ("batch", "cache_seq")), pos=constrain(cache.pos, ("batch",)),
                   index=cache.index)


def _repeat_cache(cache: KVCache, g: int) -> KVCache:
    """Rows p -> p*G .. p*G+G-1 (prompt-major)."""
    return KVCache(k=jnp.repeat(cache.k, g, axis=1), v=jnp.repeat(cache.v, g, axis=1),
                   mask=jnp.repeat(cache.mask, g, axis=0), pos=jnp.repeat(cache.pos, g, axis=0), index=cache.index)


_CACHE_AXES = ("batch", "kv_heads", "cache_seq", "head_dim")


def _split_layers(model: Any) -> list[dict[str, jax.Array]]:
    """Per-layer weight dicts sliced from the stacked ``[L, ...]`` parameters. Done once per generate
    call, outside the decode loop: XLA CPU copies a static slice of a stacked weight feeding a dot on
    every use (24 sliced GEMMs cost ~4x 24 separate ones), so slicing inside the loop would copy all
    the weights at every step."""
    params = model.layers.arrays()
    return [{k: v[i] for k, v in params.items()} for i in range(model.config.num_layers)]


def _attend_chunks(q: jax.Array, ks: Sequence[jax.Array], vs: Sequence[jax.Array], allowed: jax.Array,
                   dtype: Any) -> jax.Array:
    """:func:`ict_jax.model.attention.attend` over a cache held in chunks along the slots (``ks[c], vs[c]:
    [B, KV, S_c, hd]``, ``allowed [B, T, sum S_c]``): one softmax over every chunk's scores, the
    weighted values summed chunk by chunk (float32). One chunk is ``attend`` itself."""
    if len(ks) == 1:
        return attend(q, ks[0], vs[0], allowed, dtype)
    B, T, H, hd = q.shape
    KV = ks[0].shape[1]
    qg = q.reshape(B, T, KV, H // KV, hd)
    scores = jnp.concatenate([jnp.einsum("btkgd,bksd->bkgts", qg, k, preferred_element_type=jnp.float32)
                              for k in ks], axis=-1) * (1.0 / jnp.sqrt(jnp.float32(hd)))
    probs = jax.nn.softmax(jnp.where(allowed[:, None, None, :, :], scores, MASKED), axis=-1).astype(dtype)
    out, start = None, 0
    for v in vs:
        part = jnp.einsum("bkgts,bksd->btkgd", probs[..., start:start + v.shape[2]], v,
                          preferred_element_type=jnp.float32)
        out, start = part if out is None else out + part, start + v.shape[2]
    return out.astype(dtype).reshape(B, T, H, hd)


def _decode_unrolled(model: Any, layers: list[dict], tok: Int[Array, " B"], ks: list, vs: list,
                     mask: Int[Array, "B S"], pos: Int[Array, " B"], index: jax.Array,
                     bounds: tuple[int, ...] | None = None, phase: int = 0):
    """One decode step over per-layer weights and per-layer caches ``ks[i], vs[i]: [B, KV, S, hd]``
    (updated in place in the while loop; no restacking). The same computation as
    ``Qwen2.extend(tok[:, None], None, cache)`` + ``logits_from_hidden`` (tests compare with the
    full forward).

    Decode phases (``bounds``: the slots where the cache's chunks end, static): ``ks[i], vs[i]`` are
    tuples of chunks, slots ``[bounds[c-1], bounds[c])`` in chunk c; step ``index`` of ``phase`` writes
    chunk ``phase`` and attends over chunks ``0..phase`` (:func:`_attend_chunks`). The written chunk is
    read after its in-place write and the others only read: no copy of the cache (a window cut from a
    whole cache made XLA CPU copy the cache at every step)."""
    c, dtype = model.config, model.compute_dtype
    cos, sin = rope_tables(pos[:, None], c.resolved_head_dim, c.rope_theta)
    mask = jax.lax.dynamic_update_slice(mask, jnp.ones((mask.shape[0], 1), mask.dtype), (0, index))
    seen = mask if bounds is None else mask[:, :bounds[phase]]
    allowed = ((jnp.arange(seen.shape[1]) <= index)[None, :] & (seen > 0))[:, None, :]  # [B, 1, S or window]
    x = model._embed(tok[:, None])
    ks, vs = list(ks), list(vs)

    def write(cache: jax.Array, new: jax.Array, at: jax.Array) -> jax.Array:
        return constrain(jax.lax.dynamic_update_slice(cache, new.astype(cache.dtype), (0, 0, at, 0)), _CACHE_AXES)

    for i, p in enumerate(layers):
        q, k, v = attention_qkv(p, x, c, cos, sin, dtype)
        if bounds is None:
            ks[i], vs[i] = write(ks[i], k, index), write(vs[i], v, index)
            att = attend(q, ks[i].astype(dtype), vs[i].astype(dtype), allowed, dtype)
        else:
            at = index - (bounds[phase - 1] if phase else 0)  # the slot within the phase's chunk
            kc, vc = list(ks[i]), list(vs[i])
            kc[phase], vc[phase] = write(kc[phase], k, at), write(vc[phase], v, at)
            ks[i], vs[i] = tuple(kc), tuple(vc)
            att = _attend_chunks(q, [a.astype(dtype) for a in kc[:phase + 1]],
                                 [a.astype(dtype) for a in vc[:phase + 1]], allowed, dtype)
        x = finish_layer(p, x, att, c, dtype)
    h = rms_norm(x[:, 0], model.final_norm[...], c.rms_norm_eps, dtype)
    return model.logits_from_hidden(h), tuple(ks), tuple(vs), mask, pos + 1


def _phase_cache(cache: Any, bounds: tuple[int, ...]) -> Any:
    """The prefilled cache (prompt slots only) laid out for the decode phases ending at slots ``bounds``:
    a :class:`KVCache` (``[L, B, KV, S, hd]``, the scan decode, which attends over a window of it) is
    widened to ``bounds[-1]`` slots; the unrolled path's ``(ks, vs, mask, pos, index)`` keeps each
    layer's cache as a tuple of chunks, slots ``[bounds[c-1], bounds[c])`` in chunk c, of which only
    chunk 0 exists yet (:func:`_add_chunk` adds the next when a phase starts). New slots are empty
    (zeros, mask 0): allocated, never copied."""
    def pad(x: jax.Array, axis: int, to: int) -> jax.Array:
        widths = [(0, 0)] * x.ndim
        widths[axis] = (0, to - x.shape[axis])
        return jnp.pad(x, widths)

    if isinstance(cache, KVCache):
        return _cache_constrain(cache._replace(k=pad(cache.k, 3, bounds[-1]), v=pad(cache.v, 3, bounds[-1]),
                                               mask=pad(cache.mask, 1, bounds[-1])))
    ks, vs, mask, pos, index = cache

    def first(x: jax.Array) -> tuple[jax.Array]:
        return (constrain(pad(x, 2, bounds[0]), _CACHE_AXES),)

    return (tuple(map(first, ks)), tuple(map(first, vs)), constrain(pad(mask, 1, bounds[-1]), ("batch", "cache_seq")),
            pos, index)


def _add_chunk(cache: tuple, phase: int, bounds: tuple[int, ...]) -> tuple:
    """The unrolled path's chunked cache with chunk ``phase`` (slots ``[bounds[phase-1], bounds[phase])``,
    empty) appended to every layer's k and v."""
    ks, vs, mask, pos, index = cache

    def add(chunks: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        x = chunks[0]
        size = bounds[phase] - bounds[phase - 1]
        return (*chunks, constrain(jnp.zeros(x.shape[:2] + (size, x.shape[3]), x.dtype), _CACHE_AXES))

    return tuple(map(add, ks)), tuple(map(add, vs)), mask, pos, index


def _decode_phases(body_for: Any, carry: tuple, windows: tuple[int, ...], grow: Any = None) -> tuple:
    """The decode loop in phases (docs/sampler.md "How it runs"): phase j decodes the steps
    ``t < windows[j]``, attending over the cache's first ``prompt_len + windows[j] - 1`` slots, so a
    step reads the filled bucket of the cache, not ``max_new_tokens``. One compiled body per phase,
    ``body_for(j)``. ``carry = (t, cache, tok, done, tokens, logps, valid)``; returns ``(done, tokens,
    logps, valid)``.

    ``grow`` None (one full-size cache, the scan decode): the phases follow one another at the top
    level over the same carry, nothing copied between them; a phase whose rows are all done runs no step.
    ``grow(cache, j)`` (the unrolled decode's chunks, :func:`_add_chunk`): phase j + 1 runs under a
    ``lax.cond``, only when a row is still generating, with its chunk added: a batch whose answers end
    early never allocates the rest of the cache, and no chunk is ever copied."""
    def cond(w: int) -> Any:
        return lambda c: (c[0] < w) & ~jnp.all(c[3])

    if grow is None:
        for j, w in enumerate(windows):
            carry = jax.lax.while_loop(cond(w), body_for(j), carry)
        return carry[3:]

    def run(j: int, c: tuple) -> tuple:
        c = jax.lax.while_loop(cond(windows[j]), body_for(j), c)
        if j + 1 == len(windows):
            return c[3:]
        more = (c[0] < windows[-1]) & ~jnp.all(c[3])
        return jax.lax.cond(more, lambda c: run(j + 1, (c[0], grow(c[1], j + 1), *c[2:])), lambda c: c[3:], c)

    return run(0, carry)


def _decode_step(model: Any, unroll: bool, cache: KVCache, bounds: tuple[int, ...] | None) -> tuple[Any, Any, Any]:
    """``(step, cache, grow)``: ``step(tok, cache, phase) -> (logits, cache)`` decodes one token;
    ``cache`` is the prefilled cache in the form ``step`` takes (per-layer caches when ``unroll``; laid
    out for the decode phases ending at ``bounds`` by :func:`_phase_cache`); ``grow`` is
    :func:`_decode_phases`'s (the unrolled path's chunks) or None. Phase j attends over ``bounds[j]``
    slots."""
    c = model.config
    if unroll:  # decode state: per-layer caches (split once) and per-layer weights (sliced once)
        layers = _split_layers(model)
        cache = (tuple(cache.k[i] for i in range(c.num_layers)), tuple(cache.v[i] for i in range(c.num_layers)),
                 cache.mask, cache.pos, cache.index)

        def step(tok, cache, phase):
            ks, vs, mask, pos, index = cache
            logits, ks, vs, mask, pos = _decode_unrolled(model, layers, tok, ks, vs, mask, pos, index, bounds, phase)
            return logits, (ks, vs, constrain(mask, ("batch", "cache_seq")), constrain(pos, ("batch",)), index + 1)
    else:
        def step(tok, cache, phase):
            logits, cache = model.decode(tok, cache, None if bounds is None else bounds[phase])
            return logits, _cache_constrain(cache)

    if bounds is None:
        return step, cache, None
    grow = functools.partial(_add_chunk, bounds=bounds) if unroll else None
    return step, _phase_cache(cache, bounds), grow


def _in_compute_dtype(graphdef: Any, state: Any) -> Any:
    """``state`` with every weight the model casts to its compute dtype before use (matmul weights, the
    embedding and head, biases, LoRA adapters; not the norms' scales, which RMSNorm reads in float32)
    cast once, here: the decode loop then reads each weight in the compute dtype, once a step, instead
    of reading the float32 parameters and casting them again at every token (twice the bytes, and a
    copy where the compiler does not fuse the cast into the matmul). The values are those the model's
    own casts give, so the samples are bitwise the same; the cost is a compute-dtype copy of the
    weights while the program runs (half the float32 parameters' bytes, a shard of them under FSDP)."""
    dtype = jnp.dtype(nnx.merge(graphdef, state).compute_dtype)

    def cast(path: tuple, x: Any) -> Any:
        names = [str(getattr(k, "key", "")) for k in path]
        if (not hasattr(x, "dtype") or not jnp.issubdtype(x.dtype, jnp.floating)
                or x.dtype.itemsize <= dtype.itemsize or any(n.endswith("norm") for n in names)):
            return x
        return x.astype(dtype)

    return jax.tree_util.tree_map_with_path(cast, state)


def _generate_pure(graphdef: Any, s: SampleSettings, state: Any, prompt_ids: Int[Array, "P Lp"],
                   prompt_mask: Int[Array, "P Lp"], key: jax.Array) -> Rollout:
    state = _in_compute_dtype(graphdef, state)
    model = nnx.merge(graphdef, gather_fsdp(state) if s.gather_weights else state)
    c = model.config
    unroll = decode_unrolled(s, c.num_layers)
    G, N = s.num_samples, s.max_new_tokens
    P, Lp = prompt_ids.shape
    B = P * G
    windows = response_buckets(N, s.min_response_bucket)  # the decode phases (docs/sampler.md)
    prompt_ids = constrain(prompt_ids.astype(jnp.int32), ("batch", "seq"))
    prompt_mask = constrain(prompt_mask.astype(jnp.int32), ("batch", "seq"))
    sample = dict(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, greedy=s.greedy)
    eos = jnp.asarray(s.eos_ids if s.eos_ids else (-1,), jnp.int32)

    def draw(logits, step):
        u = jax.random.uniform(jax.random.fold_in(key, step), (B,), jnp.float32)
        return _sample_token(logits, constrain(u, ("batch",)), **sample)

    # prefill the P prompts once; Lp + N - 1 slots: the last sampled token is never decoded. With decode
    # phases the prompts fill Lp slots, repeated G times, then widened with empty slots: nothing of size
    # max_new_tokens is copied, only allocated
    bounds = phase_ends(s, Lp)  # where each phase's slots end; None: one phase
    phased = bounds is not None
    cache = _cache_constrain(model.init_cache(P, Lp if phased else Lp + N - 1, s.kv_cache_dtype))
    h, cache = model.extend(prompt_ids, prompt_mask, cache, prefill=True)
    logits = jnp.repeat(model.logits_from_hidden(h[:, -1]), G, axis=0)  # [B, V], prompt-major
    cache = _cache_constrain(_repeat_cache(cache, G))

    tok, lp = draw(constrain(logits, ("batch", "vocab")), 0)
    done = jnp.isin(tok, eos)
    tokens = jnp.full((B, N), s.pad_id, jnp.int32).at[:, 0].set(tok)
    logps = jnp.zeros((B, N), jnp.float32).at[:, 0].set(lp)
    valid = jnp.zeros((B, N), bool).at[:, 0].set(True)
    step, cache, grow = _decode_step(model, unroll, cache, bounds)

    def body_for(phase):
        return lambda carry: body(carry, phase)

    def body(carry, phase):
        t, cache, tok, done, tokens, logps, valid = carry
        logits, cache = step(tok, cache, phase)
        new, lp = draw(logits, t)
        live = ~done
        new = jnp.where(live, new, s.pad_id)
        tokens = jax.lax.dynamic_update_slice(tokens, new[:, None], (0, t))
        logps = jax.lax.dynamic_update_slice(logps, jnp.where(live, lp, 0.0)[:, None], (0, t))
        valid = jax.lax.dynamic_update_slice(valid, live[:, None], (0, t))
        done = done | jnp.isin(new, eos)
        return (t + 1, cache, new, constrain(done, ("batch",)), tokens, logps, valid)

    carry = (jnp.int32(1), cache, tok, done, tokens, logps, valid)
    done, tokens, logps, valid = _decode_phases(body_for, carry, windows, grow)
    row = ("batch", None)
    return Rollout(tokens=constrain(tokens, row), valid=constrain(valid, row), logp=constrain(logps, row),
                   lengths=constrain(valid.sum(axis=1, dtype=jnp.int32), ("batch",)),
                   truncated=constrain(~done, ("batch",)))


class GenerateFn:
    """``fn(state, prompt_ids [P, Lp], prompt_mask [P, Lp], key) -> Rollout``: the jitted program for
    one model graph and one :class:`SampleSettings`, run under ``mesh`` when given. ``state`` is
    ``nnx.split(model)[1]`` (e.g. the trainer's current policy parameters; no copy is made).
    ``.jitted`` is the underlying ``jax.jit`` object (one compiled executable per input shapes)."""

    def __init__(self, graphdef: Any, settings: SampleSettings, mesh: Mesh | None = None):
        self.graphdef, self.settings, self.mesh = graphdef, settings, mesh

        def pure(state, prompt_ids, prompt_mask, key):
            return _generate_pure(graphdef, settings, state, prompt_ids, prompt_mask, key)

        self.jitted = jax.jit(pure)

    def __call__(self, state: Any, prompt_ids: Int[Array, "P Lp"], prompt_mask: Int[Array, "P Lp"] | None,
                 key: jax.Array) -> Rollout:
        if prompt_mask is None:
            prompt_mask = jnp.ones(prompt_ids.shape, jnp.int32)
        if self.mesh is None:
            return self.jitted(state, prompt_ids, prompt_mask, key)
        check_prompts_divide(prompt_ids.shape[0], self.mesh)
        rows = NamedSharding(self.mesh, jax.sharding.PartitionSpec(BATCH_AXES, None))
        prompt_ids, prompt_mask = jax.device_put((prompt_ids, prompt_mask), rows)
        with jax.set_mesh(self.mesh):
            return self.jitted(state, prompt_ids, prompt_mask, key)


def make_generate_fn(graphdef: Any, *, num_samples: int = 1, max_new_tokens: int = 64,
                     temperature: float = _ROLLOUT.temperature, top_p: float = _ROLLOUT.top_p,
                     top_k: int = _ROLLOUT.top_k, eos_ids: Sequence[int] = (), greedy: bool = False,
                     kv_cache_dtype: str | None = None, pad_id: int = 0, unroll_layers: bool | None = None,
                     mesh: Mesh | None = None,
                     min_response_bucket: int | None = _ROLLOUT.min_response_bucket,
                     gather_weights: bool = True) -> GenerateFn:
    """The pure jitted generate function for ``graphdef`` (from ``nnx.split(model)``), for callers that
    hold the state themselves (the trainer calls it every step with the current policy state).
    ``min_response_bucket`` (``rollout.min_response_bucket``): the smallest decode phase of the growing
    KV cache; None decodes over the whole cache in one phase. ``gather_weights``
    (``rollout.gather_weights``): under a mesh with ``fsdp`` > 1, gather the weights once a call, before
    the decode loop, instead of at every decoded token (a whole copy of them a device; the same samples)."""
    settings = SampleSettings(num_samples=int(num_samples), max_new_tokens=int(max_new_tokens),
                              temperature=float(temperature), top_p=float(top_p), top_k=int(top_k),
                              eos_ids=tuple(int(i) for i in eos_ids), greedy=bool(greedy),
                              kv_cache_dtype=None if kv_cache_dtype is None else str(jnp.dtype(kv_cache_dtype)),
                              pad_id=int(pad_id), unroll_layers=unroll_layers,
                              min_response_bucket=None if min_response_bucket is None else int(min_response_bucket),
                              gather_weights=bool(gather_weights))
    return GenerateFn(graphdef, settings, mesh)


_FNS: dict[tuple, GenerateFn] = {}


def state_mesh(state: Any) -> Mesh | None:
    for leaf in jax.tree.leaves(state):
        sh = getattr(leaf, "sharding", None)
        if isinstance(sh, NamedSharding) and sh.mesh.size > 1:
            return sh.mesh
    return None


def generate(model: Any, prompt_ids: Int[Array, "P Lp"], prompt_mask: Int[Array, "P Lp"] | None, key: jax.Array, *,
             num_samples: int = 1, max_new_tokens: int = 64, temperature: float = _ROLLOUT.temperature,
             top_p: float = _ROLLOUT.top_p, top_k: int = _ROLLOUT.top_k, eos_ids: Sequence[int] = (),
             greedy: bool = False, kv_cache_dtype: str | None = None, pad_id: int = 0,
             unroll_layers: bool | None = None, mesh: Mesh | None = None,
             min_response_bucket: int | None = _ROLLOUT.min_response_bucket,
             gather_weights: bool = True) -> Rollout:
    """Sample ``num_samples`` (G) responses for each of the P left-padded prompts -> :class:`Rollout`
    with ``P * G`` rows, prompt-major.

    Compiles once per (model graph, settings, P, Lp): later calls with new weights, prompts or keys reuse
    the program. ``mesh`` defaults to the mesh the model's parameters are sharded on (if any); prompts
    are then split over ('data', 'fsdp') and P must be a multiple of data * fsdp.
    """
    graphdef, state = nnx.split(model)
    mesh = mesh if mesh is not None else state_mesh(state)
    fn = make_generate_fn(graphdef, num_samples=num_samples, max_new_tokens=max_new_tokens, temperature=temperature,
                          top_p=top_p, top_k=top_k, eos_ids=eos_ids, greedy=greedy, kv_cache_dtype=kv_cache_dtype,
                          pad_id=pad_id, unroll_layers=unroll_layers, mesh=mesh,
                          min_response_bucket=min_response_bucket, gather_weights=gather_weights)
    cache_key = (graphdef, fn.settings, mesh)
    fn = _FNS.setdefault(cache_key, fn)
    return fn(state, jnp.asarray(prompt_ids), None if prompt_mask is None else jnp.asarray(prompt_mask), key)
