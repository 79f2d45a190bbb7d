"""Exact fractions and the quantile over valid entries: the integer arithmetic behind the selectors'
counts (docs/method.md §2) and every quantile the step takes (STAPO's tau_h, the §5 percentiles).

* :func:`rho_fraction` / :func:`quantile_fraction`: a float written as an exact integer fraction
  ``(a, b)`` (rho has at most 4 decimals; a quantile is the closest fraction of denominator at most
  :data:`QUANTILE_DENOMINATOR`); both are the same fraction for a rho of at most 4 decimals.
* :func:`keep_count`: the selectors' k = 0 if n = 0 else max(1, ceil(a n / b)), in int32 without overflow.
* :func:`valid_quantile`: the ``q`` quantile of an array over its valid entries (NumPy's ``linear``
  method, or ``lower``), its position split exactly in integers from ``q = a/b``.
"""

from __future__ import annotations

import fractions
from typing import Literal

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

F32 = jnp.float32
#: Largest denominator a float fraction is written with (rho's 4 decimals, STAPO's tau_h, the §5 percentiles).
QUANTILE_DENOMINATOR = 10_000


def quantile_fraction(q: float | tuple[int, int]) -> tuple[int, int]:
    """``q`` as an exact integer fraction ``(a, b)``, ``0 <= a <= b``: a float is written with the
    closest fraction of denominator at most :data:`QUANTILE_DENOMINATOR` (0.8 -> (4, 5)); a tuple is
    taken as given (checked)."""
    if isinstance(q, tuple):
        a, b = (int(v) for v in q)
    else:
        f = fractions.Fraction(q).limit_denominator(QUANTILE_DENOMINATOR)
        a, b = f.numerator, f.denominator
    if b < 1 or not 0 <= a <= b:
        raise ValueError(f"a quantile is a fraction in [0, 1]; got {q!r}")
    return a, b


def rho_fraction(rho: float) -> tuple[int, int]:
    """The selectors' fraction rho (``0 < rho <= 1``, at most 4 decimals: docs/method.md §2 stores rho as
    a fraction) as an exact integer fraction ``(a, b)`` in lowest terms: 0.3 -> (3, 10), 0.1234 ->
    (617, 5000). The same fraction as :func:`quantile_fraction` gives (no other fraction of
    denominator <= 10^4 is within 10^-8 of a 4-decimal number)."""
    if not 0.0 < rho <= 1.0:
        raise ValueError(f"rho: {rho} is out of range; allowed: 0 < rho <= 1")
    if round(rho, 4) != rho:
        raise ValueError(f"rho: {rho} has more than 4 decimals (docs/method.md §2 stores rho as a fraction)")
    return quantile_fraction(rho)


def keep_count(n: Int[Array, "*S"], a: int, b: int) -> Int[Array, "*S"]:
    """k = 0 if n = 0 else max(1, ceil(a n / b)), at most n (docs/method.md §2): the number of tokens a
    candidate set of ``n`` valid positions keeps at rho = a/b. Exact in int32: a n could overflow, so
    n = q b + r gives ceil(a n / b) = a q + ceil(a r / b), with a r < b^2 <= 10^8."""
    n = n.astype(jnp.int32)
    q, r = n // b, n % b
    k = a * q + (a * r + b - 1) // b
    return jnp.where(n > 0, jnp.minimum(jnp.maximum(k, 1), n), 0)


def valid_quantile(
    x: Float[Array, "*S"], valid: Float[Array, "*S"] | Bool[Array, "*S"], q: float | tuple[int, int], *,
    interpolation: Literal["linear", "lower"] = "linear", empty: float = 0.0,
) -> Float[Array, ""]:
    """The ``q`` quantile of ``x`` over its ``n`` valid entries (float32 scalar).

    The valid values are sorted ascending (invalid entries as ``+inf``, last: their values are never
    read, NaN included). The position ``(n-1) q`` is split exactly, in integers, from ``q = a/b``
    (:func:`quantile_fraction`): ``(n-1) a = i b + r`` gives the index ``i`` and the fraction ``f = r / b``.

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

