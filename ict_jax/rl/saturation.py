"""How much of a top-k cut is decided by saturation rather than by the score: u's ceiling and the tokens
a cut takes by the tie rule (docs/statistics.md "u at its ceiling, and ties").

- :func:`u_ceiling`: the largest u the reading ``stats.u_form`` can give at each position, from the
  group's validity alone. Every reading compares p with Q = alpha p + beta r, r a distribution of the
  other tokens' mass (docs/method.md §1): ``aligned`` alpha = 1/n, beta = (n-1)/n with n the group's
  rollouts active at t; ``loo`` alpha = 0, beta = 1; ``literal`` alpha = 1/G, beta = (n-1)/G; ``pooled``
  alpha = 1/N, beta = (N-1)/N with N the group's valid tokens. u in its KL form is jointly convex in
  (p, r), so its largest value is at a vertex: p a point mass on a token r gives no mass,
  ceiling = 1/2 [ln(2/(1+alpha)) + alpha ln(2 alpha/(1+alpha))] + 1/2 beta ln 2 (ln 2 for ``loo``;
  0.497 for ``aligned`` at n = 8, 0.380 at n = 4). A rollout alone at t has ceiling 0 (u = 0 there)
  except under ``literal``, whose Q = p/G gives exactly u = ceiling = 1/2 [ln(2G/(G+1)) + ln(2/(G+1))/G].
- :func:`u_at_ceiling`: the share of valid tokens with ceiling > 0 and u >= 0.95 ceiling.
- :func:`tie_decided`: the selected tokens whose selection the tie at a top-k cut decided (docs/method.md
  §2, ``rl.selector.ties``): under ``position`` (ties to the lower flat index), in a candidate set whose
  k-th largest score s_k is also the score of a valid token left out, the selected tokens with score s_k;
  under ``all`` (every token tied at the cut kept), in a set with more than k valid tokens at or above
  s_k, the selected tokens with score s_k.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from ict_jax.rl.quantile import keep_count, rho_fraction

__all__ = ["CEILING_FRACTION", "RANKED_BY", "tie_decided", "tie_selected_frac", "u_at_ceiling", "u_ceiling"]

#: "At its ceiling": u >= CEILING_FRACTION x ceiling (within 5 %).
CEILING_FRACTION = 0.95
#: The top-k selectors and the statistic (a :class:`~ict_jax.rl.token_stats.TokenStats` field) each
#: ranks by: the ones whose cut can fall inside a tie of that statistic (``random``'s scores are not a
#: statistic; ``frequent`` is the complement of ICT's cut).
RANKED_BY = {"ict": "js", "entropy": "H1"}
_LN2 = 0.6931471805599453
Valid = Float[Array, "B T"] | Bool[Array, "B T"]


def _rows_by_group(x: jax.Array, group_size: int) -> jax.Array:
    B = x.shape[0]
    if group_size < 1 or B % group_size:
        raise ValueError(f"group_size={group_size} must be >= 1 and divide the batch size B={B}")
    return x.reshape(B // group_size, group_size, *x.shape[1:])


def u_ceiling(valid: Valid, group_size: int, u_form: str = "aligned") -> Float[Array, "B T"]:
    """The largest u the reading ``u_form`` can give at each position (module docstring), float32
    ``[B, T]``, 0 where ``valid`` is 0. Rows are prompt-major (row = p*G + j)."""
    w = _rows_by_group(jnp.asarray(valid) > 0, group_size).astype(jnp.float32)  # [P, G, T]
    G = float(group_size)
    n = jnp.sum(w, axis=1, keepdims=True)  # active rollouts at t
    if u_form == "pooled":
        n = jnp.broadcast_to(jnp.sum(w, axis=(1, 2), keepdims=True), n.shape)  # the group's valid tokens
    if u_form in ("aligned", "pooled"):
        alpha, beta = 1.0 / jnp.maximum(n, 1.0), (n - 1.0) / jnp.maximum(n, 1.0)
    elif u_form == "literal":
        alpha, beta = jnp.full_like(n, 1.0 / G), (n - 1.0) / G
    elif u_form == "loo":
        alpha, beta = jnp.zeros_like(n), (n > 1).astype(jnp.float32)
    else:
        raise ValueError(f"u_form: {u_form!r}; allowed: aligned, loo, literal, pooled")
    own = jnp.log(2.0 / (1.0 + alpha)) + jnp.where(alpha > 0, alpha * jnp.log(2.0 * alpha / (1.0 + alpha)), 0.0)
    c = 0.5 * own + 0.5 * beta * _LN2
    if u_form == "loo":
        c = jnp.where(n > 1, c, 0.0)  # alone at t: u = 0 by definition
    return jnp.where(w > 0, jnp.broadcast_to(c, w.shape), 0.0).reshape(jnp.shape(valid))


def u_at_ceiling(js: Float[Array, "B T"], valid: Valid, group_size: int, u_form: str = "aligned",
                 fraction: float = CEILING_FRACTION) -> Float[Array, ""]:
    """The share of valid tokens whose u is within ``1 - fraction`` of its ceiling (:func:`u_ceiling`
    > 0 and u >= fraction x ceiling); 0 with no valid token."""
    v = jnp.asarray(valid) > 0
    c = u_ceiling(v, group_size, u_form)
    at = v & (c > 0) & (jnp.asarray(js, jnp.float32) >= fraction * c)
    return jnp.sum(at) / jnp.maximum(jnp.sum(v), 1)


def _sets(x: jax.Array, scope: str, group_size: int | None, set_rows: int | None) -> jax.Array:
    """``[B, T]`` -> candidate sets ``[S, L]`` as the selectors form them (docs/method.md §2):
    ``sequence`` a row, ``group`` G rows, ``batch`` ``set_rows`` rows (a mini-batch; None = all),
    ``micro_batch`` ``set_rows`` rows (a micro-batch; None = all)."""
    B, T = x.shape
    rows = {"sequence": 1, "group": group_size, "batch": set_rows or B, "micro_batch": set_rows or B}.get(scope)
    if rows is None or rows < 1 or B % rows:
        raise ValueError(f"scope {scope!r} needs rows per candidate set dividing B={B}; got {rows}")
    return x.reshape(B // rows, rows * T)


def tie_decided(score: Float[Array, "B T"], mask: Valid, valid: Valid, *, scope: str,
                group_size: int | None = None, set_rows: int | None = None, ties: str = "position",
                rho: float | None = None) -> Bool[Array, "B T"]:
    """The selected tokens of a top-k ``mask`` whose selection the tie at the cut decided, per candidate set
    (``scope``; ``set_rows`` = the rows of a mini-batch under ``batch``, of a micro-batch under
    ``micro_batch``). bool ``[B, T]``.

    - ``ties='position'`` (the mask keeps exactly k): when a valid token left out has the k-th largest
      score s_k (the smallest selected score), the selected tokens whose score is s_k: kept by position.
    - ``ties='all'`` (the mask keeps every token >= s_k; ``rho`` gives k = max(1, ceil(rho n))): when more
      than k valid tokens score >= s_k (the cut fell inside the tie), the selected tokens whose score is
      s_k: kept because they tie. Only where ``mask`` is that cut (not during a warm-up's M = valid, unless
      the cut itself keeps every valid token)."""
    shape = jnp.shape(score)
    s = _sets(jnp.asarray(score, jnp.float32), scope, group_size, set_rows)
    v = _sets(jnp.asarray(valid) > 0, scope, group_size, set_rows)
    sel = _sets(jnp.asarray(mask) > 0, scope, group_size, set_rows) & v
    if ties == "position":
        kth = jnp.min(jnp.where(sel, s, jnp.inf), axis=1, keepdims=True)
        cut_in_tie = jnp.any(v & ~sel & (s == kth), axis=1, keepdims=True)
        return (sel & (s == kth) & cut_in_tie).reshape(shape)
    if ties != "all":
        raise ValueError(f"ties: {ties!r}; allowed: ['position', 'all']")
    if rho is None:
        raise ValueError("tie_decided(ties='all') needs rho (the count k of the cut)")
    a, b = rho_fraction(rho)
    k = keep_count(jnp.sum(v, axis=1), a, b)[:, None]  # [S, 1]
    desc = -jnp.sort(jnp.where(v, -s, jnp.inf), axis=1)  # valid scores descending, then -inf
    kth = jnp.take_along_axis(desc, jnp.maximum(k - 1, 0), axis=1)  # s_k
    at_or_above = v & (s >= kth)
    is_cut = jnp.all(sel == at_or_above, axis=1, keepdims=True) & (k > 0)
    cut_in_tie = jnp.sum(at_or_above, axis=1, keepdims=True) > k
    return (sel & (s == kth) & cut_in_tie & is_cut).reshape(shape)


def tie_selected_frac(score: Float[Array, "B T"], mask: Valid, valid: Valid, *, scope: str,
                      group_size: int | None = None, set_rows: int | None = None, ties: str = "position",
                      rho: float | None = None) -> Float[Array, ""]:
    """The share of selected tokens (mask and valid) that the tie at the cut decided (:func:`tie_decided`)."""
    sel = (jnp.asarray(mask) > 0) & (jnp.asarray(valid) > 0)
    tied = tie_decided(score, mask, valid, scope=scope, group_size=group_size, set_rows=set_rows, ties=ties,
                       rho=rho)
    return jnp.sum(tied) / jnp.maximum(jnp.sum(sel), 1)
