"""rl/quantile.py: the exact fractions and the selectors' count k (docs/method.md §2) against references
written from the definitions in Python integers. (The quantile over valid entries is tested in
test_metrics.py.)"""

import math
from fractions import Fraction

import jax.numpy as jnp
import numpy as np
import pytest

from ict_jax.rl.quantile import keep_count, quantile_fraction, rho_fraction


def test_rho_fraction_is_exact_for_every_four_decimal_rho():
    """Every rho = i / 10^4 in (0, 1]: the fraction in lowest terms, and the quantile fraction of the same
    float (one source for both: no other fraction of denominator <= 10^4 is that close)."""
    for i in range(1, 10_001):
        rho = i / 10_000
        want = Fraction(i, 10_000)
        assert rho_fraction(rho) == (want.numerator, want.denominator), rho
        assert quantile_fraction(rho) == (want.numerator, want.denominator), rho


@pytest.mark.parametrize("rho", [0.0, -0.1, 1.5, 0.12345])
def test_rho_fraction_refuses_what_is_not_a_four_decimal_fraction(rho):
    with pytest.raises(ValueError, match="rho: "):
        rho_fraction(rho)


def test_keep_count_against_integer_reference():
    """k = 0 if n = 0 else max(1, ceil(a n / b)) <= n, including n where a * n overflows int32."""
    ns = np.array([0, 1, 2, 3, 9, 10, 11, 49, 50, 51, 1000, 123_457, 2**31 // 3, 2**31 - 1], np.int64)
    for rho in (0.0001, 0.1, 0.2, 0.3, 0.1234, 0.9999, 1.0):
        a, b = rho_fraction(rho)
        got = np.asarray(keep_count(jnp.asarray(ns, jnp.int32), a, b))
        want = [0 if n == 0 else min(int(n), max(1, math.ceil(Fraction(a * int(n), b)))) for n in ns]
        np.testing.assert_array_equal(got, want, err_msg=str(rho))
