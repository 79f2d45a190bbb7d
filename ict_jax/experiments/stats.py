"""The statistics of a pre-registered experiment (:mod:`ict_jax.experiments.runner`): paired differences
between arms that share seeds, the paired t test, and the design's minimum detectable effect.

Python floats (double precision); Student's t and the chi-squared distribution are SciPy's
(``scipy.stats.t``, ``scipy.stats.chi2``), the ``stats`` extra: without SciPy the functions that need a
distribution raise :class:`~ict_jax.data.extras.MissingExtra`, one line naming the extra.
docs/experiments.md gives the formulas.

- Paired differences of arm a against reference r over the seeds both finished: d_s = x_a,s - x_r,s;
  mean d, sample sd s_d (ddof 1), n, t = mean / (s_d / sqrt(n)), df = n - 1, two-sided
  p = 2 (1 - F_t(|t|; df)). With n < 2 (or s_d = 0) the sd, t and p are None.
- Minimum detectable effect of a paired design with n seeds, an assumed sd of the paired differences
  sigma, two-sided level alpha and power 1 - beta: MDE = (t_{1-alpha/2, n-1} + t_{1-beta, n-1}) sigma / sqrt(n)
  (the t-based approximation that ignores the noncentral t's skew; exact enough to size a pilot).
- Planning from an observed sd s of the paired differences with df = n - 1: its two-sided confidence
  interval for sigma, [s sqrt(df / chi2_{1-a/2, df}), s sqrt(df / chi2_{a/2, df})] (normal differences),
  and the seeds a next design needs, the smallest n >= 2 whose MDE with a given sd is at most an effect.
"""

from __future__ import annotations

import math
from types import ModuleType
from typing import Any, Iterable, Mapping

from ict_jax.data.extras import MissingExtra
from ict_jax.install import install_line

__all__ = ["mean_sd", "paired_differences", "t_cdf", "t_quantile", "minimum_detectable_effect", "chi2_quantile",
           "sd_interval", "seeds_needed"]


def _distributions() -> ModuleType:
    """``scipy.stats``, imported on first use; :class:`MissingExtra` naming the ``stats`` extra without it."""
    try:
        from scipy import stats
    except ImportError:
        raise MissingExtra("an experiment's statistics (Student's t, chi-squared) need SciPy, the stats extra: "
                           f"{install_line('stats')}") from None
    return stats


def mean_sd(values: Iterable[float | None]) -> dict[str, Any]:
    """``{"mean", "sd", "n"}`` over the finite values; sd is the sample sd (ddof 1), None when n < 2."""
    vals = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    n = len(vals)
    if n == 0:
        return {"mean": None, "sd": None, "n": 0}
    mean = math.fsum(vals) / n
    sd = math.sqrt(math.fsum((v - mean) ** 2 for v in vals) / (n - 1)) if n > 1 else None
    return {"mean": mean, "sd": sd, "n": n}


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with ``df`` > 0 degrees of freedom (``scipy.stats.t.cdf``)."""
    if not df > 0:
        raise ValueError(f"t_cdf: df = {df}: must be > 0")
    return float(_distributions().t.cdf(t, df))


def t_quantile(q: float, df: float) -> float:
    """The ``q`` quantile of Student's t with ``df`` > 0 degrees of freedom (0 < q < 1; ``scipy.stats.t.ppf``)."""
    if not 0.0 < q < 1.0:
        raise ValueError(f"t_quantile: q = {q}: must be in (0, 1)")
    if not df > 0:
        raise ValueError(f"t_quantile: df = {df}: must be > 0")
    return float(_distributions().t.ppf(q, df))


def paired_differences(arm: Mapping[Any, float | None], reference: Mapping[Any, float | None]) -> dict[str, Any]:
    """Arm minus reference, paired by seed (the keys), over the seeds where both values are finite:
    ``{"seeds", "diffs", "mean", "sd", "n", "se", "t", "df", "p"}`` (module docstring)."""
    seeds = [s for s in arm if s in reference and _finite(arm[s]) and _finite(reference[s])]
    seeds = sorted(seeds, key=lambda s: (str(type(s)), s))
    diffs = [float(arm[s]) - float(reference[s]) for s in seeds]
    stat = mean_sd(diffs)
    n, sd = stat["n"], stat["sd"]
    se = t = p = None
    df = n - 1 if n >= 2 else None
    if sd is not None and sd > 0:
        se = sd / math.sqrt(n)
        t = stat["mean"] / se
        p = min(1.0, 2.0 * float(_distributions().t.sf(abs(t), df)))  # 2 (1 - F_t(|t|)), its far tail exact
    return {"seeds": seeds, "diffs": diffs, "mean": stat["mean"], "sd": sd, "n": n, "se": se, "t": t, "df": df,
            "p": p}


def minimum_detectable_effect(sd: float, n: int, alpha: float = 0.05, power: float = 0.8) -> float | None:
    """The smallest true mean paired difference a two-sided paired t test at level ``alpha`` detects with
    probability ``power`` over ``n`` pairs whose differences have sd ``sd`` (module docstring); None with
    n < 2 (no test)."""
    if not (0.0 < alpha < 1.0 and 0.0 < power < 1.0):
        raise ValueError(f"alpha {alpha}, power {power}: both must be in (0, 1)")
    if not sd >= 0:
        raise ValueError(f"sd {sd}: must be >= 0")
    if n < 2:
        return None
    df = n - 1
    return (t_quantile(1.0 - alpha / 2.0, df) + t_quantile(power, df)) * sd / math.sqrt(n)


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def chi2_quantile(q: float, df: float) -> float:
    """The ``q`` quantile of the chi-squared distribution with ``df`` > 0 degrees of freedom (0 < q < 1;
    ``scipy.stats.chi2.ppf``)."""
    if not 0.0 < q < 1.0:
        raise ValueError(f"chi2_quantile: q = {q}: must be in (0, 1)")
    if not df > 0:
        raise ValueError(f"chi2_quantile: df = {df}: must be > 0")
    return float(_distributions().chi2.ppf(q, df))


def sd_interval(sd: float, df: int, level: float = 0.95) -> tuple[float, float]:
    """The two-sided ``level`` confidence interval of sigma from a sample sd ``sd`` with ``df`` >= 1 degrees
    of freedom (normal data): ``(sd sqrt(df / chi2_{(1+level)/2}), sd sqrt(df / chi2_{(1-level)/2}))``."""
    if not 0.0 < level < 1.0:
        raise ValueError(f"sd_interval: level {level}: must be in (0, 1)")
    if not (isinstance(df, int) and df >= 1):
        raise ValueError(f"sd_interval: df {df!r}: must be an int >= 1")
    if not sd >= 0:
        raise ValueError(f"sd_interval: sd {sd}: must be >= 0")
    tail = (1.0 - level) / 2.0
    return (sd * math.sqrt(df / chi2_quantile(1.0 - tail, df)), sd * math.sqrt(df / chi2_quantile(tail, df)))


def seeds_needed(sd: float, effect: float, alpha: float = 0.05, power: float = 0.8, max_seeds: int = 100_000) -> int:
    """The fewest seeds n >= 2 of a paired design whose :func:`minimum_detectable_effect` with ``sd`` is at
    most ``effect`` (> 0); ``ValueError`` past ``max_seeds``."""
    if not effect > 0:
        raise ValueError(f"seeds_needed: effect {effect}: must be > 0")
    if minimum_detectable_effect(sd, max_seeds, alpha, power) > effect:
        raise ValueError(f"seeds_needed: more than {max_seeds} seeds to detect {effect:g} with sd {sd:g}")
    lo, hi = 1, max_seeds  # MDE(lo) > effect (none at n 1), MDE(hi) <= effect; MDE falls with n
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if minimum_detectable_effect(sd, mid, alpha, power) <= effect:
            hi = mid
        else:
            lo = mid
    return hi
