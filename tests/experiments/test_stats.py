"""ict_jax.experiments.stats: the paired t test, the minimum detectable effect, an sd's interval and the seeds
a next design needs, against closed forms and printed tables; without SciPy, one line naming the stats
extra."""

from __future__ import annotations

import math
import sys

import pytest

from ict_jax.data.extras import MissingExtra
from ict_jax.experiments.stats import (
    chi2_quantile,
    mean_sd,
    minimum_detectable_effect,
    paired_differences,
    sd_interval,
    seeds_needed,
    t_cdf,
    t_quantile,
)
from ict_jax.install import install_line


def test_t_distribution_against_closed_forms_and_tables():
    for t in (0.0, 0.3, 1.0, 2.5, 12.7):
        assert t_cdf(t, 1) == pytest.approx(0.5 + math.atan(t) / math.pi, abs=1e-12)  # Cauchy
        assert t_cdf(t, 2) == pytest.approx(0.5 + t / (2 * math.sqrt(2 + t * t)), abs=1e-12)
        assert t_cdf(-t, 3) == pytest.approx(1 - t_cdf(t, 3), abs=1e-12)
    for q in (0.6, 0.8, 0.975, 0.999):  # the quantiles of df 1 and 2 in closed form
        assert t_quantile(q, 1) == pytest.approx(math.tan(math.pi * (q - 0.5)), rel=1e-12)
        assert t_quantile(q, 2) == pytest.approx((2 * q - 1) / math.sqrt(2 * q * (1 - q)), rel=1e-12)
    # printed t tables: t_{0.975} for df 1, 2, 5, 10, 30; t_{0.8} for df 1
    for q, df, want in ((0.975, 1, 12.7062), (0.975, 2, 4.3027), (0.975, 5, 2.5706), (0.975, 10, 2.2281),
                        (0.975, 30, 2.0423), (0.8, 1, 1.3764)):
        assert t_quantile(q, df) == pytest.approx(want, abs=1e-4)
    assert t_quantile(0.025, 4) == pytest.approx(-t_quantile(0.975, 4))
    with pytest.raises(ValueError, match="must be in"):
        t_quantile(1.0, 3)


def test_paired_differences_by_hand():
    # arm - reference by seed: 0.1, 0.3, -0.1 -> mean 0.1, sd 0.2, se 0.2 / sqrt 3, t = sqrt(3) / 2, df 2
    d = paired_differences({0: 0.5, 1: 0.7, 2: 0.2, 5: 0.9}, {0: 0.4, 1: 0.4, 2: 0.3, 3: 0.1})
    assert d["seeds"] == [0, 1, 2] and d["n"] == 3 and d["df"] == 2
    assert d["diffs"] == pytest.approx([0.1, 0.3, -0.1])
    assert d["mean"] == pytest.approx(0.1) and d["sd"] == pytest.approx(0.2)
    assert d["t"] == pytest.approx(math.sqrt(3) / 2)
    t = math.sqrt(3) / 2
    assert d["p"] == pytest.approx(1 - t / math.sqrt(2 + t * t))  # df 2: p = 1 - |t| / sqrt(2 + t^2)
    # two seeds: df 1, p from the Cauchy CDF
    d = paired_differences({0: 0.6, 1: 0.5}, {0: 0.4, 1: 0.4})
    assert d["t"] == pytest.approx(3.0) and d["df"] == 1
    assert d["p"] == pytest.approx(1 - 2 * math.atan(3.0) / math.pi)
    # one pair, no spread, missing values: no test
    assert paired_differences({0: 1.0}, {0: 0.5})["t"] is None
    assert paired_differences({0: 1.0, 1: 2.0}, {0: 0.0, 1: 1.0})["t"] is None  # sd 0
    assert paired_differences({0: None, 1: float("nan")}, {0: 1.0, 1: 1.0})["n"] == 0
    assert mean_sd([0.4, None, float("nan"), 0.6]) == {"mean": pytest.approx(0.5), "sd": pytest.approx(0.1414213562),
                                                      "n": 2}


def test_minimum_detectable_effect_by_hand():
    # (t_{0.975, 1} + t_{0.8, 1}) * sd / sqrt(2) with the table values above
    assert minimum_detectable_effect(0.05, 2) == pytest.approx((12.7062 + 1.3764) * 0.05 / math.sqrt(2), abs=1e-4)
    assert minimum_detectable_effect(1.0, 11) == pytest.approx((2.2281 + 0.8791) / math.sqrt(11), abs=1e-4)
    assert minimum_detectable_effect(0.1, 1) is None


def test_chi_squared_and_the_interval_of_an_sd_against_closed_forms_and_tables():
    for q in (0.001, 0.025, 0.5, 0.975, 0.999):  # df 2 is the exponential with mean 2
        assert chi2_quantile(q, 2) == pytest.approx(-2 * math.log1p(-q), rel=1e-12)
    # printed chi-squared tables
    for q, df, want in ((0.025, 1, 0.000982), (0.975, 1, 5.0239), (0.025, 4, 0.4844), (0.975, 4, 11.1433),
                        (0.5, 10, 9.3418), (0.975, 100, 129.5612)):
        assert chi2_quantile(q, df) == pytest.approx(want, abs=1e-4 if want > 0.01 else 1e-6)
    # sigma's 95 % interval from a sample sd s: s sqrt(df / chi2_{0.975}), s sqrt(df / chi2_{0.025})
    lo, hi = sd_interval(0.04, 1)
    assert lo == pytest.approx(0.04 / math.sqrt(5.0239), rel=1e-4) and hi == pytest.approx(0.04 / math.sqrt(0.000982),
                                                                                           rel=1e-3)
    assert sd_interval(1.0, 10) == (pytest.approx(0.6987, abs=1e-4), pytest.approx(1.7549, abs=1e-4))
    with pytest.raises(ValueError, match="must be an int >= 1"):
        sd_interval(0.1, 0)


def test_seeds_needed_is_the_fewest_whose_mde_reaches_the_effect():
    n = seeds_needed(0.04, 0.05)
    assert minimum_detectable_effect(0.04, n) <= 0.05 < minimum_detectable_effect(0.04, n - 1)
    assert n == 8  # (t_{0.975,7} + t_{0.8,7}) 0.04 / sqrt 8 = (2.3646 + 0.8960) 0.04 / 2.8284 = 0.0461; n 7: 0.0507
    assert seeds_needed(0.04, 1.0) == 2  # the smallest design with a test
    with pytest.raises(ValueError, match="more than 10 seeds"):
        seeds_needed(0.04, 0.001, max_seeds=10)


def test_without_scipy_a_distribution_names_the_stats_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "scipy", None)  # `from scipy import stats` raises ImportError
    monkeypatch.setitem(sys.modules, "scipy.stats", None)
    for call in (lambda: t_quantile(0.975, 5), lambda: t_cdf(1.0, 5), lambda: chi2_quantile(0.5, 3),
                 lambda: minimum_detectable_effect(0.1, 4), lambda: paired_differences({0: 1.0, 1: 2.5},
                                                                                      {0: 0.5, 1: 0.5})):
        with pytest.raises(MissingExtra) as err:
            call()
        assert str(err.value).endswith(install_line("stats")) and "\n" not in str(err.value)
    # what needs no distribution works without SciPy
    assert mean_sd([0.4, 0.6])["mean"] == pytest.approx(0.5)
    assert paired_differences({0: 1.0}, {0: 0.5})["t"] is None and minimum_detectable_effect(0.1, 1) is None
