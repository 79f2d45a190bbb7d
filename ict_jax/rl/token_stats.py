"""Per-token statistics of docs/method.md §1: logp, Shannon H1, Renyi-2 H2 and the group-mean JS score u.

Two paths that agree to float32 rounding:

* :func:`stats_from_logits` takes logits ``[B, T, V]`` (the plain reference path, small V);
* :func:`stats_from_hidden` takes post-final-norm hidden states ``[B, T, D]`` and the unembedding
  ``[D, V]`` and walks blocks of ``chunk`` positions (all B rows of a block together, so the group mean
  Pbar is exact), recomputing each block's logits with a float32-accumulating matmul. Neither its
  forward nor its backward pass ever holds a float32 ``[B, T, V]`` array (docs/method.md §1, last bullet): the
  gradient of ``logp`` comes from a custom VJP that recomputes the block's logits and applies
  d logp / d z = onehot(token) - p block by block.

Rows are P prompts x G rollouts, prompt-major (row = p*G + j); ``group_size`` is G. Every statistic uses
p = softmax(L / T_s) with T_s = ``temperature``; natural logarithms.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Bool, Float, Int

_ALL = ("logp", "H1", "H2", "js")
_LN2 = 0.6931471805599453


class TokenStats(NamedTuple):
    """Per-token statistics, each float32 ``[B, T]`` and 0 where ``valid`` is 0 (docs/method.md §1).

    A field that was not asked for in ``compute`` is ``None``. ``logp`` is differentiable; ``H1``,
    ``H2`` and ``js`` carry ``stop_gradient``.
    """

    logp: Float[Array, "B T"] | None  # log p(o_t)
    H1: Float[Array, "B T"] | None  # -sum_v p log p
    H2: Float[Array, "B T"] | None  # -log sum_v p^2
    js: Float[Array, "B T"] | None  # JS(p || Pbar), clipped to [0, ln 2]


def _check_compute(compute: Sequence[str]) -> tuple[str, ...]:
    compute = tuple(compute)
    bad = [c for c in compute if c not in _ALL]
    if bad:
        raise ValueError(f"compute: unknown statistics {bad}; allowed: {list(_ALL)}")
    return compute


def _check_group(B: int, group_size: int) -> int:
    if group_size < 1 or B % group_size:
        raise ValueError(f"group_size={group_size} must be >= 1 and divide the batch size B={B}")
    return B // group_size


def _safe_log(x):
    """log x where x > 0, else 0 (so x * _safe_log(x) = xlogy(x, x))."""
    return jnp.log(jnp.where(x > 0, x, 1.0))


def _js(p, q):
    """JS(p || q) over the last axis in docs/method.md §1's KL form, m = (p + q)/2, clipped to [0, ln 2]."""
    return _js_logs(p, _safe_log(p), q, _safe_log(q))


def _block_stats(z, tokens, valid, group_size: int, want: frozenset, *, with_p: bool = False):
    """Statistics of one block from temperature-scaled float32 logits ``z [B, C, V]``.

    Returns ``(logZ, logp, H1, H2, js)`` each ``[B, C]`` (``None`` when not wanted); ``logZ`` is
    always returned (the custom VJP saves it). Not masked by ``valid`` here except inside Pbar.
    ``with_p=True`` appends p ``[B, C, V]`` (the one-pass gradient reuses it).

    Cost per vocabulary entry (this is the hot loop of every train step): one ``exp`` (p is the
    normalised exponential of the logsumexp pass, not a second ``exp``), and with ``js`` one ``log p``
    shared by H1 and JS, one ``log m``, and ``log Pbar`` once per group (not once per rollout). The JS
    stays in docs/method.md §1's KL form with ``log`` of both arguments, so p == Pbar gives exactly 0.
    """
    B, C, V = z.shape
    zmax = jnp.max(z, axis=-1, keepdims=True)
    zmax = jnp.where(jnp.isfinite(zmax), zmax, 0.0)  # an all -inf row gives no NaN
    e = jnp.exp(z - zmax)
    S = jnp.sum(e, axis=-1)
    logZ = jnp.log(S) + zmax[..., 0]
    logp = H1 = H2 = js = None
    if "logp" in want:
        z_tok = jnp.take_along_axis(z, tokens[..., None], axis=-1)[..., 0]
        logp = z_tok - logZ
    p = None
    if with_p or want & {"H1", "H2", "js"}:
        p = e * (1.0 / S)[..., None]
        if want & {"H1", "js"}:
            logp_v = _safe_log(p)
        if "H1" in want:
            H1 = -jnp.sum(p * logp_v, axis=-1)
        if "H2" in want:
            H2 = -jnp.log(jnp.sum(p * p, axis=-1))
        if "js" in want:
            P = B // group_size
            w = valid.astype(jnp.float32).reshape(P, group_size, C)
            pg = p.reshape(P, group_size, C, V)
            cnt = jnp.sum(w, axis=1)  # [P, C] active rollouts of the group at t
            # G static slices added up: XLA CPU runs a middle-axis reduce ~5x slower than this loop fusion
            num = w[:, 0, :, None] * pg[:, 0]
            for j in range(1, group_size):
                num = num + w[:, j, :, None] * pg[:, j]
            pbar = num / jnp.maximum(cnt, 1.0)[..., None]  # 0 where no rollout is active
            logpbar = _safe_log(pbar)  # [P, C, V]: once per group
            js = _js_logs(pg, logp_v.reshape(pg.shape), pbar[:, None], logpbar[:, None]).reshape(B, C)
    return (logZ, logp, H1, H2, js) + ((p,) if with_p else ())


def _js_logs(p, logp, q, logq):
    """:func:`_js` given ``log`` of both arguments (0 where the argument is 0); ``q`` may broadcast."""
    m = 0.5 * (p + q)
    ok = m > 0
    logm = jnp.log(jnp.where(ok, m, 1.0))
    # m = (p + q)/2 >= p/2 can underflow to 0 beside a tiny positive p (a subnormal halved), which would
    # give p * inf; the true term is <= p ln 2 there, so it is taken as 0 (an error below 1e-38)
    t = jnp.where(ok, p * (logp - logm) + q * (logq - logm), 0.0)
    return jnp.clip(0.5 * jnp.sum(t, axis=-1), 0.0, _LN2)


def _finish(stats, valid, compute) -> TokenStats:
    """Zero invalid positions, stop gradients of H1/H2/js, drop what was not asked for."""
    out = {}
    for name, x in zip(_ALL, stats):
        if name not in compute or x is None:
            out[name] = None
            continue
        x = jnp.where(valid, x, 0.0).astype(jnp.float32)
        out[name] = x if name == "logp" else lax.stop_gradient(x)
    return TokenStats(**out)


def stats_from_logits(
    logits: Float[Array, "B T V"],
    tokens: Int[Array, "B T"],
    valid: Float[Array, "B T"] | Bool[Array, "B T"],
    *,
    group_size: int,
    temperature: float = 1.0,
    compute: Sequence[str] = _ALL,
) -> TokenStats:
    """docs/method.md §1 statistics from full logits (the reference path; holds ``[B, T, V]``).

    With z = logits / T_s, p = softmax(z):
      logp = z[o] - logsumexp(z);  H1 = -sum_v xlogy(p, p);  H2 = -log sum_v p^2;
      Pbar[g,t] = sum_{j in g} valid[j,t] p[j,t] / sum_{j in g} valid[j,t]  (0 if no rollout active);
      m = (p + Pbar)/2;  u = 1/2 sum_v [xlogy(p,p) - xlogy(p,m)] + 1/2 sum_v [xlogy(Pbar,Pbar) -
      xlogy(Pbar,m)], clipped to [0, ln 2].
    All outputs are float32 ``[B, T]``, 0 where ``valid`` is 0; ``logp`` is differentiable with
    respect to ``logits``, the others are stop-gradient. ``-inf`` logits are allowed (p = 0 there).
    """
    compute = _check_compute(compute)
    B, T, V = logits.shape
    _check_group(B, group_size)
    valid = valid > 0
    tokens = tokens.astype(jnp.int32)
    z = logits.astype(jnp.float32) / temperature
    z = jnp.where(valid[..., None], z, 0.0)  # padding positions may hold anything, even all -inf
    want = frozenset(compute)
    # logp through autodiff; the rest from stop-gradient logits.
    logp = _block_stats(z, tokens, valid, group_size, want & {"logp"})[1]
    _, _, H1, H2, js = _block_stats(lax.stop_gradient(z), tokens, valid, group_size, want - {"logp"})
    return _finish((logp, H1, H2, js), valid, compute)


# --------------------------------------------------------------------------------------------------
# Chunked path
# --------------------------------------------------------------------------------------------------
def _block_size(T: int, chunk: int) -> int:
    """Positions per block: ``chunk`` is the largest block; the blocks are evened out so that padding
    is under one position per block (T = 96, chunk = 64 gives 2 blocks of 48, not 2 of 64)."""
    nb = -(-T // min(chunk, T))
    return -(-T // nb)


def _blocks(x, nb: int, chunk: int):
    """[B, T_pad, ...] -> [nb, B, chunk, ...] (the scan axis first)."""
    B = x.shape[0]
    return jnp.moveaxis(x.reshape(B, nb, chunk, *x.shape[2:]), 1, 0)


def _unblocks(x):
    """[nb, B, chunk, ...] -> [B, nb*chunk, ...]."""
    nb, B, C = x.shape[:3]
    return jnp.moveaxis(x, 0, 1).reshape(B, nb * C, *x.shape[3:])


def _block_logits(h, unembed, temperature: float, *, transposed: bool = False):
    """z = (h @ W) / T_s with float32 accumulation; h [B, C, D], W [D, V] (or W^T [V, D] when
    ``transposed``) -> [B, C, V] float32."""
    spec = "bcd,vd->bcv" if transposed else "bcd,dv->bcv"
    z = jnp.einsum(spec, h, unembed, preferred_element_type=jnp.float32)
    return z if temperature == 1.0 else z / temperature  # skip a [B, C, V] pass when T_s = 1


def _block_grad(h, tok, g, p, unembed_t, temperature: float):
    """One block's d(sum g*logp): dz = g (onehot(o) - p) / T_s; returns (dh [B, C, D], dW [D, V]) in
    float32. ``unembed_t`` is W^T [V, D]: dh contracts over V as a plain matmul (XLA CPU's NT form
    was ~1.7x slower)."""
    V = unembed_t.shape[0]
    onehot = tok[..., None] == lax.broadcasted_iota(jnp.int32, (1, 1, V), 2)
    g = (g / temperature)[..., None]  # fold 1/T_s into the [B, C] cotangent
    dz = jnp.where(onehot, g, 0.0) - g * p
    dh = jnp.einsum("bcv,vd->bcd", dz, unembed_t, preferred_element_type=jnp.float32)
    dW = jnp.einsum("bcd,bcv->dv", h, dz, preferred_element_type=jnp.float32)
    return dh, dW


def _scan_stats(hidden, unembed, tokens, valid, group_size, temperature, chunk, want):
    """Forward scan over blocks; inputs already padded to nb*chunk. Returns logZ, logp, H1, H2, js."""
    B, Tp, _ = hidden.shape
    nb = Tp // chunk
    xs = (_blocks(hidden, nb, chunk), _blocks(tokens, nb, chunk), _blocks(valid, nb, chunk))

    unembed_t = jnp.transpose(unembed)  # free for a tied embedding; saves XLA CPU a [D, V] copy

    def body(_, x):
        h, tok, val = x
        z = _block_logits(h, unembed_t, temperature, transposed=True)
        out = _block_stats(z, tok, val, group_size, want)
        return None, tuple(jnp.zeros((B, chunk), jnp.float32) if o is None else o for o in out)

    _, ys = lax.scan(body, None, xs)
    return tuple(_unblocks(y) for y in ys)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _chunked(hidden, unembed, tokens, valid, group_size, temperature, chunk, want):
    return _scan_stats(hidden, unembed, tokens, valid, group_size, temperature, chunk, want)[1:]


def _chunked_fwd(hidden, unembed, tokens, valid, group_size, temperature, chunk, want):
    logZ, *rest = _scan_stats(hidden, unembed, tokens, valid, group_size, temperature, chunk, want)
    return tuple(rest), (hidden, unembed, tokens, logZ)


def _chunked_bwd(group_size, temperature, chunk, want, res, cts):
    """d logp[b,c] / d z[b,c,v] = onehot(o)[v] - p[v]; dz -> dlogits = dz / T_s; one block at a time.

    Only the ``logp`` cotangent is used (H1, H2, js are stop-gradient outside this function).
    """
    hidden, unembed, tokens, logZ = res
    g_logp = cts[0]
    B, Tp, D = hidden.shape
    nb = Tp // chunk
    V = unembed.shape[1]
    unembed_t = jnp.transpose(unembed)  # one transpose per step; free when W is a tied embedding's
    xs = (_blocks(hidden, nb, chunk), _blocks(tokens, nb, chunk), _blocks(logZ, nb, chunk),
          _blocks(g_logp.astype(jnp.float32), nb, chunk))

    def body(dW, x):
        h, tok, lz, g = x
        z = _block_logits(h, unembed_t, temperature, transposed=True)
        dh, dW_blk = _block_grad(h, tok, g, jnp.exp(z - lz[..., None]), unembed_t, temperature)
        return dW + dW_blk, dh.astype(hidden.dtype)

    dW, dh = lax.scan(body, jnp.zeros((D, V), jnp.float32), xs)
    return _unblocks(dh), dW.astype(unembed.dtype), None, None


_chunked.defvjp(_chunked_fwd, _chunked_bwd)


# --------------------------------------------------------------------------------------------------
# One-pass head: statistics and the gradient of a linear function of logp in the same block walk
# --------------------------------------------------------------------------------------------------
def _scan_stats_grad(hidden, unembed, tokens, valid, g, group_size, temperature, chunk, want):
    """Forward scan that also accumulates d(sum g*logp)/d(hidden, unembed) from each block's p."""
    B, Tp, D = hidden.shape
    nb = Tp // chunk
    V = unembed.shape[1]
    unembed_t = jnp.transpose(unembed)  # see _block_grad
    xs = (_blocks(hidden, nb, chunk), _blocks(tokens, nb, chunk), _blocks(valid, nb, chunk),
          _blocks(g.astype(jnp.float32), nb, chunk))

    def body(dW, x):
        h, tok, val, gb = x
        z = _block_logits(h, unembed_t, temperature, transposed=True)  # no [D, V] copy of a tied W
        *out, p = _block_stats(z, tok, val, group_size, want | {"logp"}, with_p=True)
        dh, dW_blk = _block_grad(h, tok, gb, p, unembed_t, temperature)
        out = tuple(jnp.zeros((B, chunk), jnp.float32) if o is None else o for o in out[1:])
        return dW + dW_blk, out + (dh.astype(hidden.dtype),)

    dW, ys = lax.scan(body, jnp.zeros((D, V), jnp.float32), xs)
    *stats, dh = (_unblocks(y) for y in ys)
    return tuple(stats), dh, dW.astype(unembed.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _one_pass(hidden, unembed, tokens, valid, g, group_size, temperature, chunk, want):
    stats, _, _ = _scan_stats_grad(hidden, unembed, tokens, valid, g, group_size, temperature, chunk, want)
    return stats, jnp.sum(g * stats[0])


def _one_pass_fwd(hidden, unembed, tokens, valid, g, group_size, temperature, chunk, want):
    stats, dh, dW = _scan_stats_grad(hidden, unembed, tokens, valid, g, group_size, temperature, chunk, want)
    return (stats, jnp.sum(g * stats[0])), (dh, dW)


def _one_pass_bwd(group_size, temperature, chunk, want, res, cts):
    """Only the surrogate's cotangent is used: the statistics are stop-gradient outside."""
    dh, dW = res
    c = cts[1]
    return (c.astype(dh.dtype) * dh, c.astype(dW.dtype) * dW, None, None, None)


_one_pass.defvjp(_one_pass_fwd, _one_pass_bwd)


def _prepare(hidden, unembed, tokens, valid, group_size: int, chunk: int, compute, extra=()):
    """Checks shared by the chunked entry points, then pads T to whole blocks. Returns
    ``(compute, T, chunk, valid, hidden_p, tokens_p, valid_p, extra_p)`` (``_p``: padded; ``extra``:
    more ``[B, T]`` arrays padded alike)."""
    compute = _check_compute(compute)
    B, T, D = hidden.shape
    _check_group(B, group_size)
    if unembed.shape[0] != D:
        raise ValueError(f"unembed has shape {unembed.shape}; expected [D={D}, V]")
    if chunk < 1:
        raise ValueError(f"chunk={chunk} must be >= 1")
    chunk = _block_size(T, chunk)
    valid = valid > 0
    tokens = tokens.astype(jnp.int32)
    pad = (-T) % chunk
    pad2 = lambda x: jnp.pad(x, ((0, 0), (0, pad))) if pad else x  # noqa: E731
    hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0))) if pad else hidden
    return compute, T, chunk, valid, hidden, pad2(tokens), pad2(valid), tuple(pad2(x) for x in extra)


def stats_and_surrogate(
    hidden: Float[Array, "B T D"],
    unembed: Float[Array, "D V"],
    tokens: Int[Array, "B T"],
    valid: Float[Array, "B T"] | Bool[Array, "B T"],
    g_logp: Float[Array, "B T"],
    *,
    group_size: int,
    temperature: float = 1.0,
    chunk: int = 64,
    compute: Sequence[str] = _ALL,
) -> tuple[TokenStats, Float[Array, ""]]:
    """:func:`stats_from_hidden` plus ``s = sum_t g_logp[t] * logp[t]`` whose gradient costs no second pass.

    For a loss whose derivative with respect to ``logp`` is known before the forward pass (a constant
    ``g_logp``: the fused GRPO step with r = 1, no KL and a mask that does not depend on the statistics),
    ``jax.grad`` of ``s`` equals the loss's gradient. Each block's softmax p is then used twice while it
    is in memory, once for the statistics and once for d s / d z = g (onehot - p), so the backward pass
    neither recomputes the block logits nor their softmax: three vocabulary matmuls per token instead
    of four. ``dh`` ``[B, T, D]`` and ``dW`` ``[D, V]`` are kept from the forward pass for the backward.
    Every returned statistic is stop-gradient (differentiate ``s``); ``g_logp`` is treated as a
    constant. Statistics equal :func:`stats_from_hidden`'s to float32 rounding.
    """
    if g_logp.shape != tokens.shape:
        raise ValueError(f"g_logp has shape {g_logp.shape}; expected the tokens' {tokens.shape}")
    g_logp = jnp.where(valid > 0, lax.stop_gradient(g_logp).astype(jnp.float32), 0.0)
    compute, T, chunk, valid, hidden, tokens, valid_p, (g_logp,) = _prepare(
        hidden, unembed, tokens, valid, group_size, chunk, compute, (g_logp,))
    out, s = _one_pass(hidden, unembed, tokens, valid_p, g_logp, group_size, float(temperature), chunk,
                       frozenset(compute))
    out = tuple(lax.stop_gradient(o[:, :T]) for o in out)
    return _finish(out, valid, compute), s


def stats_from_hidden(
    hidden: Float[Array, "B T D"],
    unembed: Float[Array, "D V"],
    tokens: Int[Array, "B T"],
    valid: Float[Array, "B T"] | Bool[Array, "B T"],
    *,
    group_size: int,
    temperature: float = 1.0,
    chunk: int = 64,
    compute: Sequence[str] = _ALL,
) -> TokenStats:
    """docs/method.md §1 statistics from hidden states, in blocks of ``chunk`` positions (the production path).

    ``hidden[:, t]`` is the post-final-norm state at the position that predicts ``tokens[:, t]`` (the
    caller shifts); ``unembed`` is ``Qwen2.unembedding()`` ``[D, V]``. Both may be bfloat16: block
    logits ``(hidden[:, blk] @ unembed) / T_s`` come from a matmul with float32 accumulation. The
    formulas are those of :func:`stats_from_logits`. T need not divide by ``chunk`` (padded
    internally). Peak extra memory is a few float32 ``[B, chunk, V]`` blocks in both the forward pass
    and the backward pass of ``logp`` (custom VJP recomputing each block's logits). ``compute`` skips
    statistics not asked for (``("logp",)`` needs only a logsumexp per position).
    """
    compute, T, chunk, valid, hidden, tokens, valid_p, _ = _prepare(
        hidden, unembed, tokens, valid, group_size, chunk, compute)
    want = frozenset(compute)
    if "logp" in want:
        out = _chunked(hidden, unembed, tokens, valid_p, group_size, float(temperature), chunk, want)
    else:
        out = _scan_stats(lax.stop_gradient(hidden), lax.stop_gradient(unembed), tokens, valid_p,
                          group_size, float(temperature), chunk, want)[1:]
    out = tuple(o[:, :T] for o in out)
    return _finish(out, valid, compute)
