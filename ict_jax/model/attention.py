"""Grouped-query attention of a query block over a key sequence, two ways with one result.

- :func:`attend` (``model.attention: dense``): the scores ``[B, KV, G, T, S]`` in float32, masked,
  softmax, then the values: simple, and what the decode step uses (``T = 1``).
- :func:`blocked_attend` (``model.attention: blocked``): the keys in blocks of ``block`` positions with
  an online softmax (a running maximum and sum per query row), and a backward pass that recomputes each
  block's probabilities from the saved row maxima and sums (the flash-attention schedule, Dao et al. 2022,
  written in plain JAX): neither pass holds more than one ``[B, KV, G, T, block]`` block of scores, where
  the dense form holds the whole ``T x S`` matrix per layer (and remat keeps or recomputes it).

Both give a fully masked query row (a left-padding position, which no loss reads) the mean of every
value, as a softmax over equal masked scores does; keys padded up to a whole block weigh nothing.
docs/architecture.md "Attention"; tests: tests/model/test_attention.py (values and gradients against
:func:`attend`, float64 NumPy for the forward)."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

MASKED = -1e9  # large finite negative: a fully masked (padding) query row stays NaN-free
_PADDED = 2 * MASKED  # keys added to fill the last block: exp(_PADDED - MASKED) is 0 in float32


def attend(q: jax.Array, k: jax.Array, v: jax.Array, allowed: jax.Array, dtype: Any) -> jax.Array:
    """q ``[B, T, H, hd]``, k/v ``[B, KV, S, hd]``, allowed ``[B, T, S]`` -> ``[B, T, H, hd]``."""
    B, T, H, hd = q.shape
    KV = k.shape[1]
    qg = q.reshape(B, T, KV, H // KV, hd)
    scores = jnp.einsum("btkgd,bksd->bkgts", qg, k, preferred_element_type=jnp.float32)
    scores = scores * (1.0 / jnp.sqrt(jnp.float32(hd)))
    scores = jnp.where(allowed[:, None, None, :, :], scores, MASKED)
    probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
    out = jnp.einsum("bkgts,bksd->btkgd", probs, v, preferred_element_type=jnp.float32).astype(dtype)
    return out.reshape(B, T, H, hd)


def blocked_attend(q: jax.Array, k: jax.Array, v: jax.Array, allowed: jax.Array, dtype: Any,
                   block: int = 128) -> jax.Array:
    """:func:`attend`'s result from key blocks of ``block`` positions (the last padded with keys that
    weigh nothing), with a backward pass that recomputes each block (module docstring)."""
    if block < 1:
        raise ValueError(f"blocked_attend: block must be >= 1, got {block}")
    B, T, H, hd = q.shape
    KV, S = k.shape[1], k.shape[2]
    if allowed.shape != (B, T, S):
        raise ValueError(f"blocked_attend: allowed has shape {allowed.shape}, expected {(B, T, S)}")
    block = min(block, S)
    pad = -S % block
    if pad:
        k = jnp.pad(k, ((0, 0), (0, 0), (0, pad), (0, 0)))
        v = jnp.pad(v, ((0, 0), (0, 0), (0, pad), (0, 0)))
    # per key position: 1 allowed, 0 masked (scored MASKED), -1 a padding key (scored _PADDED)
    state = jnp.pad(allowed.astype(jnp.int8), ((0, 0), (0, 0), (0, pad)), constant_values=-1)
    qg = q.reshape(B, T, KV, H // KV, hd)
    out = _blocked(qg, k, v, state, jnp.dtype(dtype).name, block)
    return out.reshape(B, T, H, hd)


def _blocks(x: jax.Array, axis: int, block: int) -> jax.Array:
    """``x`` with its ``axis`` cut into blocks of ``block``, the block index first (the scan's xs)."""
    n = x.shape[axis] // block
    x = x.reshape(*x.shape[:axis], n, block, *x.shape[axis + 1:])
    return jnp.moveaxis(x, axis, 0)


def _unblocks(x: jax.Array, axis: int) -> jax.Array:
    """The inverse of :func:`_blocks` (``axis``: where the blocked axis sits in the result)."""
    x = jnp.moveaxis(x, 0, axis)
    return x.reshape(*x.shape[:axis], x.shape[axis] * x.shape[axis + 1], *x.shape[axis + 2:])


def _scores(qg: jax.Array, kb: jax.Array, sb: jax.Array) -> jax.Array:
    """One block's scaled, masked float32 scores ``[B, KV, G, T, block]``."""
    hd = qg.shape[-1]
    s = jnp.einsum("btkgd,bksd->bkgts", qg, kb, preferred_element_type=jnp.float32)
    s = s * (1.0 / jnp.sqrt(jnp.float32(hd)))
    sb = sb[:, None, None, :, :]
    return jnp.where(sb > 0, s, jnp.where(sb == 0, jnp.float32(MASKED), jnp.float32(_PADDED)))


def _forward(qg, k, v, state, dtype: str, block: int):
    """(out ``[B, T, KV, G, hd]`` in ``dtype``, the rows' score maximum and softmax sum ``[B, KV, G, T]``
    float32: kept apart, not as a log-sum-exp, which at a fully masked row's ``MASKED`` scale (1e9) would
    lose the sum to float32 rounding)."""
    B, T, KV, G, hd = qg.shape
    m0 = jnp.full((B, KV, G, T), -jnp.inf, jnp.float32)
    z0 = jnp.zeros((B, KV, G, T), jnp.float32)
    acc0 = jnp.zeros((B, KV, G, T, hd), jnp.float32)

    def step(carry, xs):
        m, z, acc = carry
        kb, vb, sb = xs
        s = _scores(qg, kb, sb)
        m_new = jnp.maximum(m, s.max(-1))
        scale = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[..., None])
        z = z * scale + p.sum(-1)
        acc = acc * scale[..., None] + jnp.einsum("bkgts,bksd->bkgtd", p.astype(dtype), vb,
                                                  preferred_element_type=jnp.float32)
        return (m_new, z, acc), None

    xs = (_blocks(k, 2, block), _blocks(v, 2, block), _blocks(state, 2, block))
    (m, z, acc), _ = jax.lax.scan(step, (m0, z0, acc0), xs)
    out = (acc / z[..., None]).astype(dtype)  # [B, KV, G, T, hd]
    return out.transpose(0, 3, 1, 2, 4), (m, z)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _blocked(qg, k, v, state, dtype: str, block: int):
    return _forward(qg, k, v, state, dtype, block)[0]


def _blocked_fwd(qg, k, v, state, dtype: str, block: int):
    out, (m, z) = _forward(qg, k, v, state, dtype, block)
    return out, (qg, k, v, state, out, m, z)


def _blocked_bwd(dtype: str, block: int, res, d_out):
    qg, k, v, state, out, m, z = res
    hd = qg.shape[-1]
    scale = 1.0 / jnp.sqrt(jnp.float32(hd))
    d_out = d_out.astype(jnp.float32)  # [B, T, KV, G, hd]
    delta = jnp.einsum("btkgd,btkgd->bkgt", d_out, out.astype(jnp.float32))  # rowsum(dO * O)

    def step(dq, xs):
        kb, vb, sb = xs
        p = jnp.exp(_scores(qg, kb, sb) - m[..., None]) / z[..., None]  # this block's probabilities, recomputed
        dv = jnp.einsum("bkgts,btkgd->bksd", p.astype(dtype), d_out.astype(dtype),
                        preferred_element_type=jnp.float32)
        dp = jnp.einsum("btkgd,bksd->bkgts", d_out, vb.astype(jnp.float32))
        # masked scores are constants (jnp.where in attend): no gradient reaches q or k through them
        ds = jnp.where(sb[:, None, None, :, :] > 0, p * (dp - delta[..., None]), 0.0) * scale
        dq = dq + jnp.einsum("bkgts,bksd->btkgd", ds, kb.astype(jnp.float32))
        dk = jnp.einsum("bkgts,btkgd->bksd", ds, qg.astype(jnp.float32))
        return dq, (dk, dv)

    xs = (_blocks(k, 2, block), _blocks(v, 2, block), _blocks(state, 2, block))
    dq, (dk, dv) = jax.lax.scan(step, jnp.zeros(qg.shape, jnp.float32), xs)
    dk, dv = _unblocks(dk, 2), _unblocks(dv, 2)
    return dq.astype(qg.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_blocked.defvjp(_blocked_fwd, _blocked_bwd)
