"""The quantile over valid entries shared by STAPO and the docs/method.md §5 metrics, and the §5 metrics
that use it, against float64 NumPy references written from the definitions."""

from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ict_jax.rl.batch import RolloutBatch
from ict_jax.rl.metrics import step_metrics
from ict_jax.rl.quantile import quantile_fraction, valid_quantile
from ict_jax.rl.token_stats import TokenStats

RTOL, ATOL = 1e-6, 1e-7


# ------------------------------------------------------------------------------------------------
# float64 NumPy reference: sorted valid values, position (n-1) q computed exactly from q = a/b
# ------------------------------------------------------------------------------------------------
def ref_quantile(x, valid, q, interpolation="linear", empty=0.0):
    s = np.sort(np.asarray(x, np.float64)[np.asarray(valid) > 0])
    if s.size == 0:
        return empty
    pos = (s.size - 1) * Fraction(q)
    i = pos.numerator // pos.denominator
    f = float(pos - i)
    if interpolation == "lower" or f == 0:
        return s[i]
    return s[i] + f * (s[i + 1] - s[i])


def test_quantile_hand_cases():
    x = np.array([[5.0, 2.0, 1.0], [2.0, 2.0, 9.0]], np.float32)
    v = np.array([[1, 1, 1], [1, 1, 0]], np.float32)  # valid values 1 2 2 2 5; the 9 is not valid
    assert float(valid_quantile(x, v, 0.5)) == 2.0  # ties
    np.testing.assert_allclose(float(valid_quantile(x, v, 0.9)), 2.0 + 0.6 * 3.0, rtol=RTOL)  # pos 3.6
    assert float(valid_quantile(x, v, 1.0)) == 5.0  # the 9 is never read
    assert float(valid_quantile(x, v, 0.0)) == 1.0
    assert float(valid_quantile(x, v, 0.9, interpolation="lower")) == 2.0
    # the lower median of an even count is the lower middle value, not their mean
    even = np.array([3.0, 1.0, 4.0, 2.0], np.float32)
    assert float(valid_quantile(even, np.ones(4), 0.5, interpolation="lower")) == 2.0
    assert float(valid_quantile(even, np.ones(4), 0.5)) == 2.5


def test_quantile_n_zero_and_n_one():
    x = np.array([[np.nan, np.inf, -np.inf, 7.0]], np.float32)
    none = np.zeros_like(x)
    assert float(valid_quantile(x, none, 0.8)) == 0.0
    assert float(valid_quantile(x, none, 0.8, empty=np.inf)) == np.inf
    assert float(valid_quantile(x, none, 0.5, interpolation="lower", empty=-1.0)) == -1.0
    one = np.array([[0, 0, 0, 1]], bool)  # NaN and infinities at invalid positions are ignored
    for q in (0.0, 0.3, 0.5, 0.9, 1.0):
        for interpolation in ("linear", "lower"):
            assert float(valid_quantile(x, one, q, interpolation=interpolation)) == 7.0


def test_quantile_position_is_exact():
    """(n-1) q = 108 * 7/12 = 63 exactly, but 108 * float32(7/12) = 62.999996: a float position would read
    s[62] (lower) or interpolate 62 + 0.999996 (1e6 - 62) ~ 999996.2; the exact one reads s[63] = 1e6."""
    s = np.concatenate([np.arange(63), 1e6 + np.arange(46)]).astype(np.float32)  # n = 109
    rng = np.random.default_rng(0)
    x = np.full(110, np.nan, np.float32)
    order = rng.permutation(110)
    x[order[:109]] = s
    v = ~np.isnan(x)
    x = x.reshape(11, 10)
    v = v.reshape(11, 10)
    for q in ((7, 12), 7 / 12):
        assert float(valid_quantile(x, v, q)) == 1e6
        assert float(valid_quantile(x, v, q, interpolation="lower")) == 1e6
    assert quantile_fraction(7 / 12) == (7, 12) and quantile_fraction(0.8) == (4, 5)
    assert quantile_fraction((9, 10)) == (9, 10)


@pytest.mark.parametrize("interpolation", ["linear", "lower"])
def test_quantile_against_numpy(interpolation):
    rng = np.random.default_rng(3)
    fn = jax.jit(valid_quantile, static_argnames=("q", "interpolation", "empty"))
    for shape, q in [((5, 6), 0.8), ((7, 3), 0.25), ((1, 1), 0.9), ((4, 9), 0.3333), ((6, 6), 0.5), ((3, 8), 1.0)]:
        x = rng.normal(size=shape).astype(np.float32)
        x[rng.random(shape) < 0.2] = 0.5  # ties
        v = rng.random(shape) < 0.7
        x[~v] = rng.choice([np.nan, np.inf, -np.inf, 1e30], size=(~v).sum())
        want = ref_quantile(x, v, Fraction(q).limit_denominator(10_000), interpolation)
        got = float(fn(x, v, q, interpolation=interpolation))
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL, err_msg=f"{shape} {q}")
        if v.sum() > 0:  # and NumPy's own method of that name
            np.testing.assert_allclose(got, np.quantile(x[v].astype(np.float64), q, method=interpolation),
                                       rtol=RTOL, atol=ATOL)


def test_quantile_rejects_a_fraction_outside_zero_one():
    with pytest.raises(ValueError, match="quantile"):
        valid_quantile(np.zeros(3), np.ones(3), 1.5)
    with pytest.raises(ValueError, match="quantile"):
        valid_quantile(np.zeros(3), np.ones(3), (3, 2))
    with pytest.raises(ValueError, match="interpolation"):
        valid_quantile(np.zeros(3), np.ones(3), 0.5, interpolation="nearest")


# ------------------------------------------------------------------------------------------------
# docs/method.md §5 metrics that read a quantile
# ------------------------------------------------------------------------------------------------
def _batch(B, T, valid):
    return RolloutBatch(
        tokens=jnp.zeros((B, T + 2), jnp.int32), attention_mask=jnp.ones((B, T + 2), jnp.int32),
        response_valid=jnp.asarray(valid, jnp.float32), rewards=jnp.asarray([1.0, 0.0, 1.0, 1.0][:B]),
        advantages=jnp.zeros(B), sampler_logp=jnp.zeros((B, T)), truncated=jnp.zeros(B), row_valid=jnp.ones(B),
        correct=jnp.asarray([1.0, 0.0, 1.0, 1.0][:B]))


def test_step_metrics_median_ratio_and_js_p90():
    rng = np.random.default_rng(5)
    B, T = 4, 5
    valid = (np.arange(T)[None] < np.array([5, 3, 4, 0])[:, None]).astype(np.float32)  # n = 12
    H1 = rng.random((B, T)).astype(np.float32)
    H1[0, :2] = H1[2, 1]  # ties
    js = (rng.random((B, T)) * 0.5).astype(np.float32)
    mask = (rng.random((B, T)) < 0.5).astype(np.float32)
    stats = TokenStats(jnp.log(jnp.full((B, T), 0.5)), jnp.asarray(H1), jnp.asarray(H1 * 2), jnp.asarray(js))
    m = step_metrics(_batch(B, T, valid), jnp.asarray(valid), jnp.asarray(mask), stats, jnp.zeros((B, T)), 2)

    v = valid > 0
    med = np.sort(H1[v].astype(np.float64))[(v.sum() - 1) // 2]  # lower median over valid tokens
    sel = (mask > 0) & v
    want_ratio = (sel & (H1 > med)).sum() / max(1, (sel & (H1 <= med)).sum())
    np.testing.assert_allclose(float(m["mask/high_low_entropy_ratio"]), want_ratio, rtol=RTOL)
    np.testing.assert_allclose(float(m["stats/js_p90"]), np.quantile(js[v].astype(np.float64), 0.9),
                               rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(float(m["mask/selected_frac"]), sel.sum() / v.sum(), rtol=RTOL)

    # nothing valid: the p90 is 0 and the ratio 0 (no selected token)
    none = np.zeros_like(valid)
    m0 = step_metrics(_batch(B, T, none), jnp.asarray(none), jnp.asarray(mask), stats, jnp.zeros((B, T)), 2)
    assert float(m0["stats/js_p90"]) == 0.0
    assert float(m0["mask/high_low_entropy_ratio"]) == 0.0
