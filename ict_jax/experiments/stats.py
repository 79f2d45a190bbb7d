"""The statistics of a pre-registered experiment (:mod:`ict_jax.experiments.runner`): paired differences
between arms that share seeds, the paired t test, and the design's minimum detectable effect.

Pure Python floats (double precision), no SciPy: Student's t distribution through the regularised
incomplete beta function, evaluated by its continued fraction (modified Lentz), and its quantiles by
bisection on the CDF. docs/experiments.md gives the formulas.

- Paired differences of arm a against reference r over the seeds both finished: d_s = x_a,s - x_r,s;
  mean d, sample sd s_d (ddof 1), n, t = mean / (s_d / sqrt(n)), df = n - 1, two-sided
  p = 2 (1 - F_t(|t|; df)). With n < 2 (or s_d = 0) the sd, t and p are None.
- Minimum detectable effect of a paired design with n seeds, an assumed sd of the paired differences
  sigma, two-sided level alpha and power 1 - beta: MDE = (t_{1-alpha/2, n-1} + t_{1-beta, n-1}) sigma / sqrt(n)
  (the t-based approximation that ignores the noncentral t's skew; exact enough to size a pilot).
- Planning from an observed sd s of the paired differences with df = n - 1: its two-sided confidence
  interval for sigma, [s sqrt(df / chi2_{1-a/2, df}), s sqrt(df / chi2_{a/2, df})] (normal differences),
  and the seeds a next design needs, the smallest n >= 2 whose MDE with a given sd is at most an effect.
  chi2 through the regularised lower incomplete gamma function (its series below a + 1, else its
  continued fraction) and its quantiles by bisection.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping

__all__ = ["mean_sd", "paired_differences", "t_cdf", "t_quantile", "minimum_detectable_effect", "betainc",
           "gammainc", "chi2_quantile", "sd_interval", "seeds_needed"]

_EPS = 1e-15
_TINY = 1e-300


def mean_sd(values: Iterable[float | None]) -> dict[str, Any]:
    """``{"mean", "sd", "n"}`` over the finite values; sd is the sample sd (ddof 1), None when n < 2."""
    vals = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    n = len(vals)
    if n == 0:
        return {"mean": None, "sd": None, "n": 0}
    mean = math.fsum(vals) / n
    sd = math.sqrt(math.fsum((v - mean) ** 2 for v in vals) / (n - 1)) if n > 1 else None
    return {"mean": mean, "sd": sd, "n": n}


def _betacf(a: float, b: float, x: float) -> float:
    """The continued fraction of the regularised incomplete beta function (modified Lentz)."""
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > _TINY else _TINY)
    h = d
    for m in range(1, 10_000):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > _TINY else _TINY)
        c = 1.0 + aa / c
        c = c if abs(c) > _TINY else _TINY
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > _TINY else _TINY)
        c = 1.0 + aa / c
        c = c if abs(c) > _TINY else _TINY
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < _EPS:
            return h
    raise ArithmeticError(f"betainc({a}, {b}, {x}): the continued fraction did not converge")


def betainc(a: float, b: float, x: float) -> float:
    """The regularised incomplete beta function I_x(a, b) for a, b > 0 and 0 <= x <= 1."""
    if not (a > 0 and b > 0):
        raise ValueError(f"betainc: a = {a}, b = {b}: both must be > 0")
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"betainc: x = {x}: must be in [0, 1]")
    if x in (0.0, 1.0):
        return x
    log_front = (math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _betacf(a, b, x) / a
    return 1.0 - math.exp(log_front) * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with ``df`` > 0 degrees of freedom."""
    if not df > 0:
        raise ValueError(f"t_cdf: df = {df}: must be > 0")
    if math.isinf(t):
        return 1.0 if t > 0 else 0.0
    tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))  # P(T > |t|)
    return 1.0 - tail if t >= 0 else tail


def t_quantile(q: float, df: float) -> float:
    """The ``q`` quantile of Student's t with ``df`` degrees of freedom (0 < q < 1), by bisection on
    :func:`t_cdf` to ~1e-12 relative."""
    if not 0.0 < q < 1.0:
        raise ValueError(f"t_quantile: q = {q}: must be in (0, 1)")
    if q == 0.5:
        return 0.0
    if q < 0.5:
        return -t_quantile(1.0 - q, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < q:
        lo, hi = hi, hi * 2.0
        if hi > 1e300:
            raise ArithmeticError(f"t_quantile({q}, {df}): no finite quantile")
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if t_cdf(mid, df) < q:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-12 * max(1.0, hi):
            break
    return 0.5 * (lo + hi)


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
        p = min(1.0, 2.0 * (1.0 - t_cdf(abs(t), df)))
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


def gammainc(a: float, x: float) -> float:
    """The regularised lower incomplete gamma function P(a, x) for a > 0 and x >= 0."""
    if not a > 0:
        raise ValueError(f"gammainc: a = {a}: must be > 0")
    if not x >= 0:
        raise ValueError(f"gammainc: x = {x}: must be >= 0")
    if x == 0.0:
        return 0.0
    if math.isinf(x):
        return 1.0
    log_front = a * math.log(x) - x - math.lgamma(a)
    if x < a + 1.0:  # the series sum_n x^n / (a (a+1) ... (a+n))
        term = total = 1.0 / a
        for n in range(1, 10_000):
            term *= x / (a + n)
            total += term
            if abs(term) < abs(total) * _EPS:
                return math.exp(log_front) * total
        raise ArithmeticError(f"gammainc({a}, {x}): the series did not converge")
    # Q(a, x) by its continued fraction (modified Lentz), P = 1 - Q
    b = x + 1.0 - a
    c, d = 1.0 / _TINY, 1.0 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2.0
        d = an * d + b
        d = 1.0 / (d if abs(d) > _TINY else _TINY)
        c = b + an / c
        c = c if abs(c) > _TINY else _TINY
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < _EPS:
            return 1.0 - math.exp(log_front) * h
    raise ArithmeticError(f"gammainc({a}, {x}): the continued fraction did not converge")


def chi2_quantile(q: float, df: float) -> float:
    """The ``q`` quantile of the chi-squared distribution with ``df`` > 0 degrees of freedom (0 < q < 1), by
    bisection on its CDF ``P(df / 2, x / 2)`` to ~1e-12 relative."""
    if not 0.0 < q < 1.0:
        raise ValueError(f"chi2_quantile: q = {q}: must be in (0, 1)")
    if not df > 0:
        raise ValueError(f"chi2_quantile: df = {df}: must be > 0")
    lo, hi = 0.0, max(1.0, float(df))
    while gammainc(df / 2.0, hi / 2.0) < q:
        lo, hi = hi, hi * 2.0
    for _ in range(400):
        mid = 0.5 * (lo + hi)
        if gammainc(df / 2.0, mid / 2.0) < q:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-12 * hi:
            break
    return 0.5 * (lo + hi)


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
