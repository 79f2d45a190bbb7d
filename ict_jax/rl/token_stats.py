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

``u_form`` picks the reading of u (docs/method.md §1, ``stats.u_form``), i.e. the distribution Q[i,t] that
p[i,t] is compared with (w = valid, n[g,t] = sum_{j in g} w[j,t] the rollouts of group g active at t):

* ``aligned`` (default): Q = Pbar[g,t] = sum_{j in g} w[j,t] p[j,t] / n[g,t], the rollout itself included;
* ``loo``: the rollout itself excluded, Q = sum_{j != i} w[j,t] p[j,t] / (n[g,t] - 1); u = 0 when no
  other rollout of the group is active at t;
* ``literal``: the paper's (1/G) sum_j p[j,t] read literally over all G rows, a finished row contributing
  no mass: Q = sum_{j in g} w[j,t] p[j,t] / G (a sub-probability where rows have ended; its KL-form JS
  still lies in [0, ln 2]);
* ``pooled``: a shared context instead of a shared index: Q = the group's pooled next-token
  distribution, sum_{j in g, tau} w[j,tau] p[j,tau] / sum_{j,tau} w[j,tau], the same for every position
  of the group (one more vocabulary pass over the group's positions first).

``pbar_tok`` is Q's mass on the sampled token, Q[i,t](o_{i,t}) (docs/method.md §5 diagnostics), and
``pmax`` = max_v p[i,t](v); both are optional statistics (not in the default ``compute``).
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Bool, Float, Int

from ict_jax.config import StatsSection, UForm

#: Every statistic the functions can compute (``compute``), in TokenStats field order.
ALL_STATS = ("logp", "H1", "H2", "js", "pbar_tok", "pmax")
_ALL = ALL_STATS
#: What the statistics functions compute unless told otherwise (the train step's set).
DEFAULT_COMPUTE = ("logp", "H1", "H2", "js")
#: The readings of u (docs/method.md §1): ``config.UForm``'s names.
U_FORMS: tuple[str, ...] = typing.get_args(UForm)
GROUP_STATS = frozenset({"js", "pbar_tok"})  # statistics that need Q (the group's distributions)
#: The ``stats`` section's defaults (block size, reading of u): the functions' defaults are these.
_SECTION = StatsSection()
_LN2 = 0.6931471805599453


class TokenStats(NamedTuple):
    """Per-token statistics, each float32 ``[B, T]`` and 0 where ``valid`` is 0 (docs/method.md §1).

    A field that was not asked for in ``compute`` is ``None``. ``logp`` is differentiable; ``H1``,
    ``H2`` and ``js`` carry ``stop_gradient``.
    """

    logp: Float[Array, "B T"] | None  # log p(o_t)
    H1: Float[Array, "B T"] | None  # -sum_v p log p
    H2: Float[Array, "B T"] | None  # -log sum_v p^2
    js: Float[Array, "B T"] | None  # u = JS(p || Q), clipped to [0, ln 2]; Q by the reading u_form
    pbar_tok: Float[Array, "B T"] | None = None  # Q(o_t): the compared distribution's mass on the token
    pmax: Float[Array, "B T"] | None = None  # max_v p(v)


@dataclasses.dataclass(frozen=True)
class StatsPlan:
    """The static settings of one statistics pass, one hashable value: the private block functions, the
    custom VJPs and ``jax.jit`` take it as ONE static argument.

    ``group_size`` G (rows ``p*G + j``); ``temperature`` T_s; ``chunk`` the positions of one block (already
    evened out, :func:`block_size`); ``want`` the statistics computed (names of :data:`ALL_STATS`);
    ``u_form`` the reading of u (module docstring)."""

    group_size: int
    temperature: float = 1.0
    chunk: int = _SECTION.chunk
    want: frozenset = frozenset(DEFAULT_COMPUTE)
    u_form: str = _SECTION.u_form

    def wanting(self, want: frozenset) -> StatsPlan:
        """The same plan computing ``want`` instead."""
        return dataclasses.replace(self, want=frozenset(want))

    @property
    def needs_pool(self) -> bool:
        """The ``pooled`` reading's Q needs one more walk over the blocks first (for u or Q(o_t) only)."""
        return self.u_form == "pooled" and bool(self.want & GROUP_STATS)


def _check_compute(compute: Sequence[str]) -> tuple[str, ...]:
    compute = tuple(compute)
    bad = [c for c in compute if c not in _ALL]
    if bad:
        raise ValueError(f"compute: unknown statistics {bad}; allowed: {list(_ALL)}")
    return compute


def _check_u_form(u_form: str) -> str:
    if u_form not in U_FORMS:
        raise ValueError(f"u_form: {u_form!r}; allowed: {list(U_FORMS)}")
    return u_form


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


def _group_q(pg, w, u_form: str):
    """Q of docs/method.md §1's reading ``u_form`` (not ``pooled``) from the group's p, one ``[P, C, V]``
    array per row j of the groups (``pg[j]``), and weights ``w [P, G, C]``. Returns ``(Q, alone)``: Q
    ``[P, 1, C, V]`` shared by the group (aligned, literal) or ``[P, G, C, V]`` per row (loo); ``alone
    [P, G, C]`` marks rows whose u is 0 by definition (loo: no other rollout active), or None."""
    group_size = len(pg)
    # G static slices added up: XLA CPU runs a middle-axis reduce ~5x slower than this loop fusion
    terms = [w[:, j, :, None] * pg[j] for j in range(group_size)]
    cnt = jnp.sum(w, axis=1)  # [P, C] active rollouts of the group at t
    if u_form == "loo":
        # sum over j != i from prefix and suffix sums (never total - own: no cancellation)
        zero = jnp.zeros_like(terms[0])
        pre, suf = [zero], [zero]
        for j in range(group_size - 1):
            pre.append(pre[-1] + terms[j])
            suf.append(suf[-1] + terms[group_size - 1 - j])
        others = jnp.stack([pre[i] + suf[group_size - 1 - i] for i in range(group_size)], axis=1)
        n_others = cnt[:, None] - w  # [P, G, C]
        return others / jnp.maximum(n_others, 1.0)[..., None], n_others <= 0
    num = terms[0]
    for t in terms[1:]:
        num = num + t
    denom = jnp.maximum(cnt, 1.0) if u_form == "aligned" else jnp.full_like(cnt, float(group_size))
    return (num / denom[..., None])[:, None], None  # aligned: 0 where no rollout is active


def _block_stats(z, tokens, valid, plan: StatsPlan, *, with_p: bool = False, qpool=None):
    """Statistics ``plan.want`` of one block from temperature-scaled float32 logits ``z [B, C, V]``.

    Returns ``(logZ, logp, H1, H2, js, pbar_tok, pmax)`` each ``[B, C]`` (``None`` when not wanted);
    ``logZ`` is always returned (the custom VJP saves it). Not masked by ``valid`` here except inside Q.
    ``with_p=True`` appends p ``[B, C, V]`` (the one-pass gradient reuses it). ``qpool [P, V]`` is the
    ``pooled`` reading's Q (:func:`_pooled_q`).

    Cost per vocabulary entry (this is the hot loop of every train step, and memory-bound on an
    accelerator): the block's logits are the only ``[B, C, V]`` array the statistics need in memory. p
    is the normalised exponential of the logsumexp pass (one ``exp``, not a second one), formed where
    it is used; H1 = log Z - sum_v p z, as sum_v p (log S - (z - max z)) (no log p array); Q is formed
    once per group (per row under ``loo``), and each row's JS, H1 and H2 are one pass over its logits
    and its group's Q, row by row (:func:`_row_stats`), so Q is never broadcast to every row of its
    group (``[P, G, C, V]``). The JS stays in docs/method.md §1's KL form with ``log`` of both
    arguments, so p == Q gives exactly 0.
    """
    B, C, V = z.shape
    want, group_size = plan.want, plan.group_size
    zmax = jnp.max(z, axis=-1, keepdims=True)
    zmax = jnp.where(jnp.isfinite(zmax), zmax, 0.0)  # an all -inf row gives no NaN
    zs = z - zmax
    S = jnp.sum(jnp.exp(zs), axis=-1)
    logS = jnp.log(S)
    logZ = logS + zmax[..., 0]
    inv = 1.0 / S
    out = dict.fromkeys(_ALL)
    if "logp" in want:
        z_tok = jnp.take_along_axis(z, tokens[..., None], axis=-1)[..., 0]
        out["logp"] = z_tok - logZ
    if "pmax" in want:
        out["pmax"] = inv  # the largest exp(z - max z) is exp(0) = 1
    if want & ({"H1", "H2"} | GROUP_STATS):
        P = B // group_size
        zg, invg, logSg = zs.reshape(P, group_size, C, V), inv.reshape(P, group_size, C), logS.reshape(P, group_size, C)
        q, logq, alone = None, None, None
        if want & GROUP_STATS:
            w = valid.astype(jnp.float32).reshape(P, group_size, C)
            if plan.u_form == "pooled":
                q = qpool[:, None, None, :]  # [P, 1, 1, V]
            else:
                q, alone = _group_q([jnp.exp(zg[:, j]) * invg[:, j, :, None] for j in range(group_size)], w,
                                    plan.u_form)
            logq = _safe_log(q)  # once per group (per row under loo)
        rows = [_row_stats(zg[:, j], invg[:, j], logSg[:, j],
                           None if q is None else q[:, j if q.shape[1] > 1 else 0],
                           None if logq is None else logq[:, j if logq.shape[1] > 1 else 0],
                           tokens.reshape(P, group_size, C)[:, j], want) for j in range(group_size)]
        for name in ("H1", "H2", "js", "pbar_tok"):
            if name in want:
                x = jnp.stack([r[name] for r in rows], axis=1)  # [P, G, C]
                if name == "js" and alone is not None:
                    x = jnp.where(alone, 0.0, x)
                out[name] = x.reshape(B, C)
    extra = (jnp.exp(zs) * inv[..., None],) if with_p else ()
    return (logZ,) + tuple(out[k] for k in _ALL) + extra


def _row_stats(zs, inv, logS, q, logq, tok, want) -> dict[str, jax.Array]:
    """Row j of every group (``[P, C, V]`` shifted logits ``zs``, ``inv`` = 1/S and ``log S`` ``[P, C]``,
    its Q and log Q ``[P, C, V]`` or ``[P, 1, V]``): H1, H2, JS and Q(o) as asked, each ``[P, C]``."""
    p = jnp.exp(zs) * inv[..., None]
    out = {}
    if "H1" in want:
        # H1 = -sum p log p = log Z - sum p z; log p = (z - max z) - log S where p > 0
        out["H1"] = jnp.sum(jnp.where(p > 0, p * (logS[..., None] - zs), 0.0), axis=-1)
    if "H2" in want:
        out["H2"] = -jnp.log(jnp.sum(p * p, axis=-1))
    if "js" in want:
        out["js"] = _js_logs(p, _safe_log(p), q, logq)
    if "pbar_tok" in want:
        qb = jnp.broadcast_to(q, p.shape)  # [P, 1, V] under pooled
        out["pbar_tok"] = jnp.take_along_axis(qb, tok[..., None], axis=-1)[..., 0]
    return out


def _pooled_sum(z, valid, group_size: int):
    """One block's share of the ``pooled`` reading's Q: ``(sum_{j in g, t} w p [P, V], sum w [P])`` from
    temperature-scaled logits ``z [B, C, V]`` and ``valid [B, C]``."""
    B, C, V = z.shape
    zmax = jnp.max(z, axis=-1, keepdims=True)
    e = jnp.exp(z - jnp.where(jnp.isfinite(zmax), zmax, 0.0))
    w = valid.astype(jnp.float32)
    # p = e / S, weighted by w, summed over the block's positions: one [B, C] x [B, C, V] contraction
    wp = jnp.einsum("bc,bcv->bv", w / jnp.sum(e, axis=-1), e, preferred_element_type=jnp.float32)
    P = B // group_size
    return wp.reshape(P, group_size, V).sum(axis=1), w.reshape(P, group_size * C).sum(axis=1)


def _pooled_q(num, cnt):
    """Q of the ``pooled`` reading from the summed :func:`_pooled_sum` parts (0 for a group with no
    valid position)."""
    return num / jnp.maximum(cnt, 1.0)[:, None]


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
    """Zero invalid positions, stop gradients of all but logp, drop what was not asked for."""
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
    compute: Sequence[str] = DEFAULT_COMPUTE,
    u_form: str = _SECTION.u_form,
) -> TokenStats:
    """docs/method.md §1 statistics from full logits (the reference path; holds ``[B, T, V]``).

    With z = logits / T_s, p = softmax(z):
      logp = z[o] - logsumexp(z);  H1 = -sum_v xlogy(p, p);  H2 = -log sum_v p^2;
      Q = the reading ``u_form`` (module docstring; ``aligned``: Pbar[g,t] = sum_{j in g} valid[j,t]
      p[j,t] / sum_{j in g} valid[j,t], 0 if no rollout active);
      m = (p + Q)/2;  u = 1/2 sum_v [xlogy(p,p) - xlogy(p,m)] + 1/2 sum_v [xlogy(Q,Q) - xlogy(Q,m)],
      clipped to [0, ln 2];  pbar_tok = Q(o);  pmax = max_v p.
    All outputs are float32 ``[B, T]``, 0 where ``valid`` is 0; ``logp`` is differentiable with
    respect to ``logits``, the others are stop-gradient. ``-inf`` logits are allowed (p = 0 there).
    """
    compute = _check_compute(compute)
    u_form = _check_u_form(u_form)
    B, T, V = logits.shape
    _check_group(B, group_size)
    valid = valid > 0
    tokens = tokens.astype(jnp.int32)
    z = logits.astype(jnp.float32) / temperature
    z = jnp.where(valid[..., None], z, 0.0)  # padding positions may hold anything, even all -inf
    plan = StatsPlan(group_size, float(temperature), T, frozenset(compute), u_form)
    zs = lax.stop_gradient(z)
    qpool = _pooled_q(*_pooled_sum(zs, valid, group_size)) if plan.needs_pool else None
    # logp through autodiff; the rest from stop-gradient logits.
    logp = _block_stats(z, tokens, valid, plan.wanting(plan.want & {"logp"}))[1]
    rest = _block_stats(zs, tokens, valid, plan.wanting(plan.want - {"logp"}), qpool=qpool)[2:]
    return _finish((logp,) + rest, valid, compute)


# --------------------------------------------------------------------------------------------------
# Chunked path
# --------------------------------------------------------------------------------------------------
def block_size(T: int, chunk: int) -> int:
    """Positions per block of the statistics of ``T`` positions at ``stats.chunk`` = ``chunk``: ``chunk`` is
    the largest block; the blocks are evened out so that padding is under one position per block (T = 96,
    chunk = 64 gives 2 blocks of 48, not 2 of 64). ``ict-jax compile`` asks it for the largest
    vocabulary-wide array a program may hold."""
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
    """One block's d(sum g*logp): dz = g (onehot(o) - p) / T_s; returns (dh [B, C, D] in h's dtype,
    dW [D, V] in float32). ``unembed_t`` is W^T [V, D]: dh contracts over V as a plain matmul (XLA CPU's
    NT form was ~1.7x slower).

    dz is computed in float32 and enters both matmuls in the compute dtype (h's), as every matmul of
    the model does (docs/architecture.md "Precision"): a float32 dz would have the compiler convert
    the [V, D] head and the block's h up to float32 and multiply at float32 width. Accumulation is
    float32 inside both dots; dW stays float32 (summed over the blocks)."""
    V = unembed_t.shape[0]
    onehot = tok[..., None] == lax.broadcasted_iota(jnp.int32, (1, 1, V), 2)
    g = (g / temperature)[..., None]  # fold 1/T_s into the [B, C] cotangent
    dz = (jnp.where(onehot, g, 0.0) - g * p).astype(h.dtype)
    dh = jnp.einsum("bcv,vd->bcd", dz, unembed_t.astype(h.dtype), preferred_element_type=h.dtype)
    dW = jnp.einsum("bcd,bcv->dv", h, dz, preferred_element_type=jnp.float32)
    return dh, dW


def _scan_pooled(hb, vb, unembed_t, plan: StatsPlan):
    """The ``pooled`` reading's Q ``[P, V]`` from blocked hidden states ``hb [nb, B, C, D]`` and
    ``vb [nb, B, C]``: one more walk over the blocks (a logits matmul and a softmax per position)."""
    B, V = hb.shape[1], unembed_t.shape[0]
    P = B // plan.group_size

    def body(acc, x):
        h, val = x
        num, cnt = _pooled_sum(_block_logits(h, unembed_t, plan.temperature, transposed=True), val, plan.group_size)
        return (acc[0] + num, acc[1] + cnt), None

    (num, cnt), _ = lax.scan(body, (jnp.zeros((P, V), jnp.float32), jnp.zeros((P,), jnp.float32)), (hb, vb))
    return _pooled_q(num, cnt)


def _scan_stats(hidden, unembed, tokens, valid, plan: StatsPlan):
    """Forward scan over blocks; inputs already padded to nb*chunk. Returns logZ then the _ALL stats."""
    B, Tp, _ = hidden.shape
    chunk = plan.chunk
    nb = Tp // chunk
    xs = (_blocks(hidden, nb, chunk), _blocks(tokens, nb, chunk), _blocks(valid, nb, chunk))

    unembed_t = jnp.transpose(unembed)  # free for a tied embedding; saves XLA CPU a [D, V] copy
    qpool = _scan_pooled(xs[0], xs[2], unembed_t, plan) if plan.needs_pool else None

    def body(_, x):
        h, tok, val = x
        z = _block_logits(h, unembed_t, plan.temperature, transposed=True)
        out = _block_stats(z, tok, val, plan, qpool=qpool)
        return None, tuple(jnp.zeros((B, chunk), jnp.float32) if o is None else o for o in out)

    _, ys = lax.scan(body, None, xs)
    return tuple(_unblocks(y) for y in ys)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _chunked(hidden, unembed, tokens, valid, plan: StatsPlan):
    return _scan_stats(hidden, unembed, tokens, valid, plan)[1:]


def _chunked_fwd(hidden, unembed, tokens, valid, plan: StatsPlan):
    logZ, *rest = _scan_stats(hidden, unembed, tokens, valid, plan)
    return tuple(rest), (hidden, unembed, tokens, logZ)


def _chunked_bwd(plan: StatsPlan, res, cts):
    """d logp[b,c] / d z[b,c,v] = onehot(o)[v] - p[v]; dz -> dlogits = dz / T_s; one block at a time.

    Only the ``logp`` cotangent is used (every other statistic is stop-gradient outside this function).
    """
    hidden, unembed, tokens, logZ = res
    g_logp = cts[0]
    B, Tp, D = hidden.shape
    chunk, temperature = plan.chunk, plan.temperature
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
def _scan_stats_grad(hidden, unembed, tokens, valid, g, plan: StatsPlan):
    """Forward scan that also accumulates d(sum g*logp)/d(hidden, unembed) from each block's p."""
    B, Tp, D = hidden.shape
    chunk, temperature = plan.chunk, plan.temperature
    nb = Tp // chunk
    V = unembed.shape[1]
    unembed_t = jnp.transpose(unembed)  # see _block_grad
    xs = (_blocks(hidden, nb, chunk), _blocks(tokens, nb, chunk), _blocks(valid, nb, chunk),
          _blocks(g.astype(jnp.float32), nb, chunk))
    qpool = (_scan_pooled(lax.stop_gradient(xs[0]), xs[2], lax.stop_gradient(unembed_t), plan)
             if plan.needs_pool else None)
    with_logp = plan.wanting(plan.want | {"logp"})

    def body(dW, x):
        h, tok, val, gb = x
        z = _block_logits(h, unembed_t, temperature, transposed=True)  # no [D, V] copy of a tied W
        *out, p = _block_stats(z, tok, val, with_logp, with_p=True, qpool=qpool)
        dh, dW_blk = _block_grad(h, tok, gb, p, unembed_t, temperature)
        out = tuple(jnp.zeros((B, chunk), jnp.float32) if o is None else o for o in out[1:])
        return dW + dW_blk, out + (dh.astype(hidden.dtype),)

    dW, ys = lax.scan(body, jnp.zeros((D, V), jnp.float32), xs)
    *stats, dh = (_unblocks(y) for y in ys)
    return tuple(stats), dh, dW.astype(unembed.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _one_pass(hidden, unembed, tokens, valid, g, plan: StatsPlan):
    stats, _, _ = _scan_stats_grad(hidden, unembed, tokens, valid, g, plan)
    return stats, jnp.sum(g * stats[0])


def _one_pass_fwd(hidden, unembed, tokens, valid, g, plan: StatsPlan):
    stats, dh, dW = _scan_stats_grad(hidden, unembed, tokens, valid, g, plan)
    return (stats, jnp.sum(g * stats[0])), (dh, dW)


def _one_pass_bwd(plan: StatsPlan, res, cts):
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
    chunk = block_size(T, chunk)
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
    chunk: int = _SECTION.chunk,
    compute: Sequence[str] = DEFAULT_COMPUTE,
    u_form: str = _SECTION.u_form,
) -> tuple[TokenStats, Float[Array, ""]]:
    """:func:`stats_from_hidden` plus ``s = sum_t g_logp[t] * logp[t]`` whose gradient costs no second pass.

    For a loss whose derivative with respect to ``logp`` is known before the forward pass (a constant
    ``g_logp``: the fused GRPO step with r = 1, no KL and a mask that does not depend on the statistics),
    ``jax.grad`` of ``s`` equals the loss's gradient. Each block's softmax p is then used twice while it
    is in memory, once for the statistics and once for d s / d z = g (onehot - p), so the backward pass
    neither recomputes the block logits nor their softmax: three vocabulary matmuls per token instead
    of four. ``dh`` ``[B, T, D]`` and ``dW`` ``[D, V]`` are kept from the forward pass for the backward.
    Every returned statistic is stop-gradient (differentiate ``s``); ``g_logp`` is treated as a
    constant. Statistics equal :func:`stats_from_hidden`'s to float32 rounding (``u_form: pooled`` walks
    the blocks once more first, for its Q).
    """
    if g_logp.shape != tokens.shape:
        raise ValueError(f"g_logp has shape {g_logp.shape}; expected the tokens' {tokens.shape}")
    u_form = _check_u_form(u_form)
    g_logp = jnp.where(valid > 0, lax.stop_gradient(g_logp).astype(jnp.float32), 0.0)
    compute, T, chunk, valid, hidden, tokens, valid_p, (g_logp,) = _prepare(
        hidden, unembed, tokens, valid, group_size, chunk, compute, (g_logp,))
    plan = StatsPlan(group_size, float(temperature), chunk, frozenset(compute), u_form)
    out, s = _one_pass(hidden, unembed, tokens, valid_p, g_logp, plan)
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
    chunk: int = _SECTION.chunk,
    compute: Sequence[str] = DEFAULT_COMPUTE,
    u_form: str = _SECTION.u_form,
) -> TokenStats:
    """docs/method.md §1 statistics from hidden states, in blocks of ``chunk`` positions (the production path).

    ``hidden[:, t]`` is the post-final-norm state at the position that predicts ``tokens[:, t]`` (the
    caller shifts); ``unembed`` is ``Qwen2.unembedding()`` ``[D, V]``. Both may be bfloat16: block
    logits ``(hidden[:, blk] @ unembed) / T_s`` come from a matmul with float32 accumulation. The
    formulas are those of :func:`stats_from_logits`, ``u_form`` the reading of u (module docstring). T
    need not divide by ``chunk`` (padded internally). Peak extra memory is a few float32
    ``[B, chunk, V]`` blocks in both the forward pass and the backward pass of ``logp`` (custom VJP
    recomputing each block's logits), plus ``[P, V]`` for ``pooled``. ``compute`` skips statistics not
    asked for (``("logp",)`` needs only a logsumexp per position).
    """
    u_form = _check_u_form(u_form)
    compute, T, chunk, valid, hidden, tokens, valid_p, _ = _prepare(
        hidden, unembed, tokens, valid, group_size, chunk, compute)
    plan = StatsPlan(group_size, float(temperature), chunk, frozenset(compute), u_form)
    if "logp" in plan.want:
        out = _chunked(hidden, unembed, tokens, valid_p, plan)
    else:
        out = _scan_stats(lax.stop_gradient(hidden), lax.stop_gradient(unembed), tokens, valid_p, plan)[1:]
    out = tuple(o[:, :T] for o in out)
    return _finish(out, valid, compute)
