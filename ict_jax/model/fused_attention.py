"""Causal grouped-query self-attention of a full sequence through a fused kernel (``model.attention``:
``xla``, ``cudnn``, ``splash``; ``auto`` picks the backend's, :func:`ict_jax.model.config.resolve_attention`).

Rows are left-padded prompts followed by responses: a key counts when its position's ``mask`` is 1 and
it is not after the query, the mask of :func:`ict_jax.model.attention.attend` (``allowed = causal &
mask[key]``). The kernels state that mask two ways:

- ``xla`` and ``cudnn`` (``jax.nn.dot_product_attention``, GQA native): padding through sequence lengths,
  which means right-padded rows. Each row is re-laid with its real tokens first, in order (a stable sort
  of the mask: any mask, not only left padding), attended causally with ``query_seq_lengths =
  key_value_seq_lengths = mask.sum()``, and laid back. Keeping the real tokens' order keeps causality
  among them; the re-lay is a permutation whose gradient is the inverse permutation (a gather, not a
  scatter). ``xla`` is the reference the CPU and the tests run; ``cudnn`` is cuDNN's flash attention (a
  GPU; bfloat16 or float16 inputs).
- ``splash`` (the Pallas TPU kernel that ships with jax, ``jax.experimental.pallas.ops.tpu.
  splash_attention``): a causal mask and segment ids, 1 at real tokens and 0 at padding, so a real query
  sees exactly the real keys up to it. The sequence is padded to a multiple of 128 with segment 0 (block
  sizes must divide it); GQA by the multi-query kernel over each KV head's group of query heads. Its
  residuals (output and log-sum-exp) carry the name :data:`RESIDUALS`, which ``remat: block`` saves: the
  backward pass reads them instead of running the forward kernel again.

A padding query's output differs from :func:`attend`'s (the mean of every value there; here zero, or
the attention among the padding tokens): no real position reads it, in this layer or a later one, since
padding keys weigh nothing. Equal to :func:`attend` at every real position, values and gradients, to
float rounding (tests/model/test_fused_attention.py). docs/architecture.md "Attention"."""

from __future__ import annotations

import concurrent.futures
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ict_jax.sharding import MESH_AXES, logical_to_spec

#: the implementations, by ``model.attention`` value
IMPLEMENTATIONS = ("xla", "cudnn", "splash")
#: the checkpoint name of the splash kernel's residuals (``remat: block`` saves them)
RESIDUALS = "attention_residuals"
#: splash pads the sequence to a multiple of this (its smallest block)
SPLASH_MULTIPLE = 128


def fused_attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, dtype: Any, implementation: str,
                 *, interpret: bool = False) -> jax.Array:
    """q ``[B, T, H, hd]``, k/v ``[B, KV, T, hd]``, mask ``[B, T]`` (1: a real token) -> ``[B, T, H, hd]``
    in ``dtype``: causal self-attention over the real tokens (module docstring). ``interpret``: run the
    splash kernel in Pallas' interpreter (a CPU; tests)."""
    B, T, H, hd = q.shape
    if k.shape != (B, k.shape[1], T, hd) or v.shape != k.shape or H % k.shape[1]:
        raise ValueError(f"fused_attend: q {q.shape}, k {k.shape}, v {v.shape}: expected q [B, T, H, hd] and "
                         "k, v [B, KV, T, hd] with KV dividing H")
    if mask.shape != (B, T):
        raise ValueError(f"fused_attend: mask has shape {mask.shape}, expected {(B, T)}")
    mask = mask.astype(jnp.int32)
    q, k, v = q.astype(dtype), k.astype(dtype), v.astype(dtype)
    if implementation == "splash":
        return _splash(q, k, v, mask, interpret).astype(dtype)
    if implementation in ("xla", "cudnn"):
        return _sequence_lengths(q, k, v, mask, implementation).astype(dtype)
    raise ValueError(f"fused_attend: implementation must be one of {', '.join(IMPLEMENTATIONS)}; "
                     f"got {implementation!r}")


# ------------------------------------------------------------------------------------------------
# xla / cudnn: right-padded rows and sequence lengths
# ------------------------------------------------------------------------------------------------
@jax.custom_vjp
def _permute(x: jax.Array, order: jax.Array, inverse: jax.Array) -> jax.Array:
    """``x [B, T, ...]`` with each row's positions taken in ``order [B, T]`` (``inverse``: its inverse)."""
    return jnp.take_along_axis(x, order.reshape(order.shape + (1,) * (x.ndim - 2)), axis=1)


def _permute_fwd(x, order, inverse):
    return _permute(x, order, inverse), (order, inverse)


def _permute_bwd(res, g):
    order, inverse = res
    # the transpose of a permutation is its inverse: a gather again (no scatter-add)
    return _permute(g, inverse, order), None, None


_permute.defvjp(_permute_fwd, _permute_bwd)


def _sequence_lengths(q, k, v, mask, implementation: str) -> jax.Array:
    # real tokens first, in their order; padding after them (a stable sort of 0 = real, 1 = padding)
    order = jnp.argsort(1 - mask, axis=1, stable=True).astype(jnp.int32)
    inverse = jnp.argsort(order, axis=1).astype(jnp.int32)
    lengths = mask.sum(axis=1).astype(jnp.int32)
    qr = _permute(q, order, inverse)
    kr = _permute(k.transpose(0, 2, 1, 3), order, inverse)  # [B, T, KV, hd], the kernel's layout
    vr = _permute(v.transpose(0, 2, 1, 3), order, inverse)
    out = jax.nn.dot_product_attention(qr, kr, vr, is_causal=True, query_seq_lengths=lengths,
                                       key_value_seq_lengths=lengths, implementation=implementation)
    return _permute(out, inverse, order)


# ------------------------------------------------------------------------------------------------
# splash (TPU): causal mask + segment ids
# ------------------------------------------------------------------------------------------------
def splash_block(length: int) -> int:
    """The splash kernel's block size for a sequence of ``length`` positions padded to a multiple of
    :data:`SPLASH_MULTIPLE`: the largest of 512, 256, 128 that divides it."""
    padded = -(-length // SPLASH_MULTIPLE) * SPLASH_MULTIPLE
    return next(b for b in (512, 256, 128) if padded % b == 0)


@functools.lru_cache(maxsize=32)
def _splash_kernel(length: int, group: int, interpret: bool):
    """The multi-query splash kernel for ``group`` query heads over ``length`` positions (a multiple of
    :data:`SPLASH_MULTIPLE`), causal; built once per shape (its block masks are NumPy work)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    b = splash_block(length)
    sizes = sa.BlockSizes(block_q=b, block_kv=b, block_kv_compute=b, block_q_dkv=b, block_kv_dkv=b,
                          block_kv_dkv_compute=b, block_q_dq=b, block_kv_dq=b)
    mask = sa.MultiHeadMask([sa.CausalMask((length, length)) for _ in range(group)])

    def build():
        kernel = sa.make_splash_mqa_single_device(mask, block_sizes=sizes, residual_checkpoint_name=RESIDUALS,
                                                  interpret=interpret)
        # its block-mask tables as NumPy arrays: constants of the compiled program (jax arrays closed over
        # by a jitted function become parameters of it, which the compile's argument check counts)
        return jax.tree.map(np.asarray, kernel)

    # built in a thread of its own: outside the caller's trace and mesh (both are per thread), its tables
    # are concrete arrays on the default device, not tracers of the program being traced
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(build).result()


def _splash(q, k, v, mask, interpret: bool) -> jax.Array:
    from jax.experimental.pallas.ops.tpu.splash_attention import SegmentIds

    B, T, H, hd = q.shape
    KV = k.shape[1]
    G = H // KV
    pad = -T % SPLASH_MULTIPLE
    Tp = T + pad
    kernel = _splash_kernel(Tp, G, bool(interpret))
    # the kernel does not scale the scores: fold 1/sqrt(hd) into q (float32, then the compute dtype)
    qs = (q.astype(jnp.float32) * np.float32(1.0 / np.sqrt(hd))).astype(q.dtype)
    qs = jnp.pad(qs, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(B, Tp, KV, G, hd).transpose(0, 2, 3, 1, 4)
    k = jnp.pad(k, ((0, 0), (0, 0), (0, pad), (0, 0)))
    v = jnp.pad(v, ((0, 0), (0, 0), (0, pad), (0, 0)))
    seg = jnp.pad(mask, ((0, 0), (0, pad)))  # the padded tail is padding (segment 0)

    def one_row(qr, kr, vr, sr):  # qr [KV, G, Tp, hd], kr/vr [KV, Tp, hd], sr [Tp]
        ids = SegmentIds(q=sr, kv=sr)
        return jax.vmap(lambda qh, kh, vh: kernel(qh, kh, vh, segment_ids=ids))(qr, kr, vr)

    axes = (("batch", "kv_heads", None, None, None), ("batch", "kv_heads", None, None),
            ("batch", "kv_heads", None, None), ("batch", None))
    out = _per_shard(jax.vmap(one_row), axes, qs, k, v, seg)  # [B, KV, G, Tp, hd]
    return out.transpose(0, 3, 1, 2, 4).reshape(B, Tp, H, hd)[:, :T]


def _per_shard(fn, axes, *args):
    """``fn(*args)`` under ``shard_map`` when a mesh is set, each argument split by its logical ``axes``
    (the rule table's ``batch`` and ``kv_heads``; a dimension the mesh does not divide stays whole), the
    result split as the first argument: a Pallas kernel is one custom call the SPMD partitioner cannot
    split, so each device runs it on its own rows and KV heads (a KV head's query heads come with it)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty or not set(MESH_AXES) <= set(mesh.axis_names):
        return fn(*args)
    specs = tuple(logical_to_spec(a, x.shape, mesh) for a, x in zip(axes, args))
    if all(d is None for spec in specs for d in spec):
        return fn(*args)
    return jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=specs[0], check_vma=False)(*args)
