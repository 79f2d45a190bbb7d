"""The diagnostics of docs/method.md §5 and the one quantile over valid entries.

:func:`step_metrics` turns a rollout batch, its mask and token statistics into the §5 device scalars
the train step returns (stable names: plots and tables read them). :func:`valid_quantile` is the
quantile of an array over its valid entries, shared by those metrics (the lower median of H1,
``stats/js_p90``) and by STAPO's entropy quantile (:func:`ict_jax.rl.selectors.stapo_quantile`).
"""

from __future__ import annotations

import fractions
from typing import Literal

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from ict_jax.rl.batch import RolloutBatch
from ict_jax.rl.losses import zero_std_groups
from ict_jax.rl.token_stats import TokenStats

F32 = jnp.float32
#: Largest denominator a float quantile is written with (STAPO's tau_h, the §5 percentiles).
QUANTILE_DENOMINATOR = 10_000


def quantile_fraction(q: float | tuple[int, int]) -> tuple[int, int]:
    """``q`` as an exact integer fraction ``(a, b)``, ``0 <= a <= b``: a float is written with the
    closest fraction of denominator at most :data:`QUANTILE_DENOMINATOR` (0.8 -> (4, 5))."""
    if isinstance(q, tuple):
        a, b = (int(v) for v in q)
    else:
        f = fractions.Fraction(q).limit_denominator(QUANTILE_DENOMINATOR)
        a, b = f.numerator, f.denominator
    if b < 1 or not 0 <= a <= b:
        raise ValueError(f"a quantile is a fraction in [0, 1]; got {q!r}")
    return a, b


def valid_quantile(
    x: Float[Array, "*S"], valid: Float[Array, "*S"] | Bool[Array, "*S"], q: float | tuple[int, int], *,
    interpolation: Literal["linear", "lower"] = "linear", empty: float = 0.0,
) -> Float[Array, ""]:
    """The ``q`` quantile of ``x`` over its ``n`` valid entries (float32 scalar).

    The valid values are sorted ascending (invalid entries as ``+inf``, last: their values are never
    read, NaN included). The position ``(n-1) q`` is split exactly, in integers, from ``q = a/b``:
    ``(n-1) a = i b + r`` gives the index ``i`` and the fraction ``f = r / b``.

    - ``'linear'`` (NumPy's default method): ``s[i] + f (s[i+1] - s[i])``, and ``s[i]`` when ``f = 0``;
    - ``'lower'``: ``s[i]``; with ``q = 1/2`` the lower median ``s[(n-1) // 2]``.

    ``n = 0`` gives ``empty``. Used by STAPO's ``tau_h`` quantile of H1 (docs/method.md §2) and by the
    §5 metrics (the lower median of H1, the 90th percentile of u).
    """
    if interpolation not in ("linear", "lower"):
        raise ValueError(f"interpolation: {interpolation!r}; allowed: ['linear', 'lower']")
    a, b = quantile_fraction(q)
    ok = (jnp.asarray(valid) > 0).reshape(-1)
    s = jnp.sort(jnp.where(ok, jnp.asarray(x, F32).reshape(-1), jnp.inf))
    n = jnp.sum(ok, dtype=jnp.int32)
    m = jnp.maximum(n - 1, 0)
    # (n-1) a = i b + r without overflow: n-1 = qt b + rm, so (n-1) a = qt a b + rm a with rm a < b^2
    qt, rm = m // b, m % b
    i = qt * a + (rm * a) // b
    value = s[i]
    if interpolation == "linear":
        f = ((rm * a) % b).astype(F32) / b
        hi = s[jnp.minimum(i + 1, m)]
        value = jnp.where(f > 0, value + f * (hi - value), value)
    return jnp.where(n > 0, value, empty)


def _masked_mean(x: jax.Array, w: jax.Array) -> jax.Array:
    return jnp.where(w > 0, x, 0.0).sum() / jnp.maximum(w.sum(), 1.0)


def step_metrics(batch: RolloutBatch, valid: Float[Array, "B T"], mask: Float[Array, "B T"], stats: TokenStats,
                 logp_old: Float[Array, "B T"], group_size: int) -> dict[str, jax.Array]:
    """docs/method.md §5 metrics of the rollout batch, masks and statistics (device scalars).

    The train step adds the loss metrics (``loss/*``, ``kl/*``, ``clip/*``) and ``grad/norm``; the
    statistics a pass did not compute (a ``None`` field of ``stats``) give no metric.
    ``mask/high_low_entropy_ratio`` = #(M and H1 > med) / max(1, #(M and H1 <= med)), med the lower
    median of H1 over valid tokens; ``stats/js_p90`` the linear 0.9 quantile of u over valid tokens.
    """
    rv = batch.row_valid > 0
    sel = mask * valid
    n_rows = jnp.maximum(rv.sum(), 1)
    m: dict[str, jax.Array] = {
        "reward/mean": jnp.where(rv, batch.rewards, 0.0).sum() / n_rows,
        "reward/accuracy": jnp.where(rv, batch.correct, 0.0).sum() / n_rows,
        "adv/zero_std_group_frac": zero_std_groups(batch.rewards, group_size, batch.row_valid).mean(),
        "response/length_mean": jnp.where(rv, batch.response_valid.sum(-1), 0.0).sum() / n_rows,
        "response/truncated_frac": jnp.where(rv, batch.truncated, 0.0).sum() / n_rows,
        "mask/selected_frac": sel.sum() / jnp.maximum(valid.sum(), 1.0),
        "rollout/logp_abs_diff_mean": _masked_mean(jnp.abs(batch.sampler_logp - logp_old), valid),
    }
    if stats.logp is not None:
        m["mask/selected_prob_mean"] = _masked_mean(jnp.exp(jax.lax.stop_gradient(stats.logp)), sel)
    if stats.H1 is not None:
        med = valid_quantile(stats.H1, valid, (1, 2), interpolation="lower", empty=jnp.inf)
        hi = ((sel > 0) & (stats.H1 > med)).sum()
        lo = ((sel > 0) & (stats.H1 <= med)).sum()
        m["mask/high_low_entropy_ratio"] = hi / jnp.maximum(lo, 1)
        m["stats/H1_mean"] = _masked_mean(stats.H1, valid)
        m["stats/H1_selected_mean"] = _masked_mean(stats.H1, sel)
    if stats.H2 is not None:
        m["stats/H2_mean"] = _masked_mean(stats.H2, valid)
        m["stats/H2_selected_mean"] = _masked_mean(stats.H2, sel)
    if stats.js is not None:
        m["stats/js_mean"] = _masked_mean(stats.js, valid)
        m["stats/js_p90"] = valid_quantile(stats.js, valid, (9, 10))
        m["stats/js_selected_mean"] = _masked_mean(stats.js, sel)
    return m
