"""docs/method.md §2 masks: exact integer counts, ranking and ties, scopes, warm-up, STAPO's conditions, the
random control, the registry, global scopes on an 8-device mesh, and hypothesis invariants."""

import functools
import math
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import ict_jax
from ict_jax.config import SelectorSection
from ict_jax.rl.selectors import (
    SELECTABLE_U_MIN,
    check_selector,
    dense_mask,
    entropy_mask,
    frequent_mask,
    ict_mask,
    random_key,
    random_mask,
    register_selector,
    registered_selectors,
    resolved_rho,
    resolved_scope,
    select,
    selectable_mask,
    selector_info,
    stapo_mask,
    stapo_quantile,
)
from ict_jax.rl.token_stats import TokenStats, stats_from_hidden
from ict_jax.rng import RANDOM_MASK_STREAM


# ------------------------------------------------------------------------------------------------
# NumPy reference (docs/method.md §2, written independently)
# ------------------------------------------------------------------------------------------------
def ref_k(n, rho):
    return 0 if n == 0 else max(1, math.ceil(Fraction(str(rho)) * n))


def ref_sets(B, T, scope, G):
    flat = np.arange(B * T).reshape(B, T)
    if scope == "sequence":
        return [flat[i] for i in range(B)]
    if scope == "group":
        return [flat[g * G:(g + 1) * G].reshape(-1) for g in range(B // G)]
    return [flat.reshape(-1)]


def ref_topk(score, valid, rho, scope, G):
    B, T = score.shape
    s, v = np.asarray(score, np.float64).reshape(-1), np.asarray(valid).reshape(-1) > 0
    m = np.zeros(B * T)
    for members in ref_sets(B, T, scope, G):
        order = sorted(members, key=lambda i: (not v[i], -s[i], i))
        k = ref_k(int(v[members].sum()), rho)
        m[order[:k]] = 1.0
    return m.reshape(B, T)


def ragged_valid(rng, B, T, empty_row=True):
    lengths = rng.integers(0, T + 1, B)
    valid = (np.arange(T)[None] < lengths[:, None]).astype(np.float32)
    if empty_row:
        valid[1] = 0.0
    return valid


jit_ict = jax.jit(ict_mask, static_argnames=("group_size", "rho", "scope"))


# ------------------------------------------------------------------------------------------------
# counts, ties, n = 0, scopes
# ------------------------------------------------------------------------------------------------
def test_counts_exact_integer_rho_0p3_n50():
    assert np.ceil(np.float32(0.3) * np.float32(50)) == 16  # float32 ceil would keep 16
    score = np.random.default_rng(0).random((3, 60)).astype(np.float32)
    valid = np.zeros((3, 60), np.float32)
    valid[0, :50] = 1
    valid[1, :1] = 1
    valid[2, 10:21] = 1  # n = 11
    m = np.asarray(ict_mask(score, valid, group_size=1, rho=0.3))
    assert m.dtype == np.float32
    assert m.sum(1).tolist() == [15.0, 1.0, 4.0]  # ceil(15) = 15; max(1, .3) = 1; ceil(3.3) = 4
    m = np.asarray(ict_mask(score, valid, group_size=1, rho=0.1))
    assert m.sum(1).tolist() == [5.0, 1.0, 2.0]
    # a large batch scope: k = ceil(0.0001 * n) exact where a * n would overflow int32? (a=1 here)
    m = np.asarray(ict_mask(score, valid, group_size=3, rho=0.3, scope="batch"))
    assert m.sum() == math.ceil(Fraction(3, 10) * 62)


def test_ties_go_to_lower_flat_index():
    score = np.zeros((4, 5), np.float32)
    score[3, 4] = -0.0
    valid = np.ones((4, 5), np.float32)
    valid[0, 0] = 0
    m = np.asarray(ict_mask(score, valid, group_size=2, rho=0.4))  # k = 2 per row (n=4 -> 2, n=5 -> 2)
    np.testing.assert_array_equal(m[0], [0, 1, 1, 0, 0])
    np.testing.assert_array_equal(m[1:], np.tile([1, 1, 0, 0, 0], (3, 1)))
    m = np.asarray(ict_mask(score, valid, group_size=2, rho=0.2, scope="batch"))  # n = 19 -> k = 4
    np.testing.assert_array_equal(m.reshape(-1)[:6], [0, 1, 1, 1, 1, 0])
    assert m.sum() == 4
    m = np.asarray(ict_mask(score, valid, group_size=2, rho=0.2, scope="group"))  # n = 9, 10 -> 2, 2
    np.testing.assert_array_equal(m.reshape(2, 10)[:, :4], [[0, 1, 1, 0], [1, 1, 0, 0]])
    assert m.sum() == 4
    # a higher score wins over a lower index; -inf scores stay ahead of invalid positions
    score[2] = [-np.inf, -np.inf, 3.0, -np.inf, 7.0]
    m = np.asarray(ict_mask(score, valid, group_size=2, rho=0.6))  # n = 5 -> k = 3
    np.testing.assert_array_equal(m[2], [1, 0, 1, 0, 1])


def test_rows_with_n0_and_all_invalid():
    rng = np.random.default_rng(1)
    score = rng.random((4, 7)).astype(np.float32)
    valid = ragged_valid(rng, 4, 7)
    for scope in ("sequence", "group", "batch"):
        m = np.asarray(ict_mask(score, valid, group_size=2, rho=0.5, scope=scope))
        assert np.all(m[1] == 0)
        np.testing.assert_array_equal(m, ref_topk(score, valid, 0.5, scope, 2))
        m = np.asarray(ict_mask(score, np.zeros_like(valid), group_size=2, rho=0.5, scope=scope))
        assert np.all(m == 0)


@pytest.mark.parametrize("scope", ["sequence", "group", "batch"])
@pytest.mark.parametrize("rho", [0.1, 0.2, 0.3, 0.9999, 1.0])
def test_scopes_against_reference(scope, rho):
    rng = np.random.default_rng(int(rho * 1e4))
    score = np.round(rng.random((6, 9)), 1).astype(np.float32)  # many ties
    valid = ragged_valid(rng, 6, 9)
    m = np.asarray(jit_ict(score, valid, group_size=3, rho=rho, scope=scope))
    np.testing.assert_array_equal(m, ref_topk(score, valid, rho, scope, 3))
    e = np.asarray(entropy_mask(score, valid, group_size=3, rho=rho, scope=scope))
    np.testing.assert_array_equal(e, m)


def test_scope_errors():
    with pytest.raises(ValueError, match="scope"):
        ict_mask(np.zeros((2, 3)), np.ones((2, 3)), group_size=1, scope="token")
    with pytest.raises(ValueError, match="group_size"):
        ict_mask(np.zeros((3, 3)), np.ones((3, 3)), group_size=2, scope="group")


# ------------------------------------------------------------------------------------------------
# STAPO
# ------------------------------------------------------------------------------------------------
def test_stapo_quantile_linear_interpolation():
    rng = np.random.default_rng(2)
    for n_rows, tau in [(5, 0.8), (7, 0.25), (3, 1.0), (4, 0.0), (6, 0.3333)]:
        H = rng.random((n_rows, 6)).astype(np.float32)
        valid = ragged_valid(rng, n_rows, 6, empty_row=False)
        valid[0, 0] = 1
        want = np.quantile(H[valid > 0].astype(np.float64), tau, method="linear")
        np.testing.assert_allclose(float(stapo_quantile(H, valid, tau)), want, rtol=1e-6, atol=1e-7)
    assert float(stapo_quantile(H, np.zeros_like(valid), 0.8)) == np.inf


def test_stapo_conditions_one_at_a_time():
    # valid H1 values 0..5 (n = 6): q = value at position 5 * 0.8 = 4 -> q = 4.0
    H1 = np.array([[0, 1, 2, 3, 4, 5, 9]], np.float32)
    valid = np.array([[1, 1, 1, 1, 1, 1, 0]], np.float32)
    assert float(stapo_quantile(H1, valid, 0.8)) == 4.0
    lo, hi = np.log(0.001), np.log(0.003)
    adv = np.array([1.0], np.float32)

    def m(logp, h, a):
        H = H1.copy()
        H[0, 3] = h
        lp = np.zeros((1, 7), np.float32)
        lp[0, 3] = logp
        return np.asarray(stapo_mask(lp, H, np.array([a], np.float32), valid, quantile_over="valid", tau_h=0.8))[0]

    assert m(lo, 3.0, 1.0)[3] == 0.0  # all three hold: silenced
    assert m(lo, 3.0, 1.0).sum() == 5.0  # only that one
    assert m(lo, 3.0, 0.0)[3] == 1.0  # A = 0
    assert m(lo, 3.0, -1.0)[3] == 1.0  # A < 0
    assert m(hi, 3.0, 1.0)[3] == 1.0  # p >= tau_p
    assert m(lo, 4.0, 1.0)[3] == 1.0  # H1 = q: strict '<'
    # per-token advantages [B, T] work too, and invalid tokens stay 0
    out = np.asarray(stapo_mask(np.full((1, 7), lo, np.float32), H1, np.ones((1, 7), np.float32), valid,
                                quantile_over="valid", tau_h=0.8))
    np.testing.assert_array_equal(out, [[0, 0, 0, 0, 1, 1, 0]])
    # n = 0 silences nothing (and M <= valid)
    out = np.asarray(stapo_mask(np.full((1, 7), lo, np.float32), H1, adv, np.zeros_like(valid)))
    assert np.all(out == 0)
    # thresholds
    out = np.asarray(stapo_mask(np.full((1, 7), hi, np.float32), H1, adv, valid, tau_p=0.005, tau_h=0.5,
                                quantile_over="valid"))
    np.testing.assert_array_equal(out, [[0, 0, 0, 1, 1, 1, 0]])  # q = 2.5


def test_stapo_low_prob_positive_reading_hand_computed():
    """docs/method.md §2, STAPO v1 (the default): q is the 0.75 quantile of H1 over the tokens with A > 0
    and p < tau_p only. Row 0 (A > 0) has low-probability tokens at t = 0..4 with H1 0, 1, 2, 3, 8:
    q = position 4 * 0.75 = 3 -> 3.0, so t = 0, 1, 2 are silenced (H1 < 3); t = 3 (H1 = q) is not.
    The `valid` reading (tau_h 0.8 over all 12 valid H1: position 8.8 of the sorted values, 11 + 0.8 *
    (12 - 11) = 11.8) silences t = 4 too."""
    H1 = np.array([[0, 1, 2, 3, 8, 0.5], [9, 10, 11, 12, 13, 14]], np.float32)
    lo, hi = np.log(0.001), np.log(0.5)
    logp = np.array([[lo, lo, lo, lo, lo, hi], [lo] * 6], np.float32)
    adv = np.array([1.0, -1.0], np.float32)
    valid = np.ones((2, 6), np.float32)
    m = np.asarray(stapo_mask(logp, H1, adv, valid))  # the defaults: low_prob_positive, tau_h 0.75
    np.testing.assert_array_equal(m, [[0, 0, 0, 1, 1, 1], [1] * 6])
    assert SelectorSection().stapo_quantile_over == "low_prob_positive" and SelectorSection().resolved_tau_h == 0.75
    assert SelectorSection(stapo_quantile_over="valid").resolved_tau_h == 0.8
    assert abs(float(stapo_quantile(H1, valid, 0.8)) - 11.8) < 1e-6
    m = np.asarray(stapo_mask(logp, H1, adv, valid, quantile_over="valid"))
    np.testing.assert_array_equal(m, [[0, 0, 0, 0, 0, 1], [1] * 6])
    # select reads the reading and tau_h from the config
    stats = TokenStats(logp, H1, H1, None)
    for over, want in (("low_prob_positive", [0, 0, 0, 1, 1, 1]), ("valid", [0, 0, 0, 0, 0, 1])):
        cfg = SelectorSection(method="stapo", stapo_quantile_over=over)
        got = np.asarray(select("stapo", stats, adv, valid, key=jax.random.key(0), step=0, config=cfg))
        np.testing.assert_array_equal(got[0], want)
    # no low-probability positive token: the candidate set is empty, nothing is silenced
    m = np.asarray(stapo_mask(logp, H1, -adv * 0 - 1.0, valid))
    assert np.all(m == 1.0)
    with pytest.raises(ValueError, match="stapo_quantile_over"):
        stapo_mask(logp, H1, adv, valid, quantile_over="all")


# ------------------------------------------------------------------------------------------------
# random, warm-up, select and the registry
# ------------------------------------------------------------------------------------------------
def test_random_keeps_ict_counts_and_stream():
    rng = np.random.default_rng(3)
    valid = ragged_valid(rng, 6, 40)
    js = rng.random((6, 40)).astype(np.float32)
    key = jax.random.key(7)
    for scope in ("sequence", "group", "batch"):
        mi = np.asarray(ict_mask(js, valid, group_size=3, rho=0.1, scope=scope))
        mr = np.asarray(random_mask(key, valid, group_size=3, rho=0.1, scope=scope))
        if scope == "sequence":
            np.testing.assert_array_equal(mr.sum(1), mi.sum(1))
        assert mr.sum() == mi.sum() and np.all(mr <= valid)
        assert not np.array_equal(mr, mi)
    cfg = SelectorSection(method="random", warmup_steps=0)
    stats = TokenStats(None, None, None, None)
    a = select("random", stats, None, valid, key=key, step=5, config=cfg)
    derived = jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(key, RANDOM_MASK_STREAM), 5), 0)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(random_mask(derived, valid, rho=0.1)))
    b = select("random", stats, None, valid, key=key, step=6, config=cfg)
    assert not np.array_equal(np.asarray(a), np.asarray(b))
    # docs/method.md §2: every mini-batch of a rollout step draws afresh, with the same counts
    c = select("random", stats, None, valid, key=key, step=5, config=cfg, minibatch=1)
    assert not np.array_equal(np.asarray(a), np.asarray(c))
    np.testing.assert_array_equal(np.asarray(a).sum(1), np.asarray(c).sum(1))
    np.testing.assert_array_equal(np.asarray(c), np.asarray(random_mask(random_key(key, 5, 1), valid, rho=0.1)))


def test_frequent_and_selectable_controls_hand_computed():
    """frequent = valid and not ICT's mask (the paper's bottom 90 %); selectable = valid and u > 0."""
    js = np.array([[0.0, 0.3, 0.1, 0.5, 0.0, 0.2, 0.0, 0.4, 0.05, 0.25, 0.35, 9.0],
                   [0.0, 0.0, 0.2, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]], np.float32)
    valid = np.ones((2, 12), np.float32)
    valid[0, 11] = 0.0  # 11 valid: ICT keeps ceil(1.1) = 2 (0.5 at t=3 and 0.4 at t=7)
    valid[1, 1:] = 0.0  # 1 valid token: ICT keeps it, the complement is empty
    f = np.asarray(frequent_mask(js, valid))
    want0 = np.ones(12)
    want0[[3, 7, 11]] = 0
    np.testing.assert_array_equal(f[0], want0)
    np.testing.assert_array_equal(f[1], np.zeros(12))
    np.testing.assert_array_equal(f + np.asarray(ict_mask(js, valid)), valid)  # a partition of valid
    sel = np.asarray(selectable_mask(js, valid))
    np.testing.assert_array_equal(sel[0], [0, 1, 1, 1, 0, 1, 0, 1, 1, 1, 1, 0])
    np.testing.assert_array_equal(sel[1], np.zeros(12))  # u = 0 at its one token
    assert float(np.asarray(selectable_mask(np.full((1, 2), SELECTABLE_U_MIN, np.float32), np.ones((1, 2)))).sum()) == 0
    # through select, with the warm-up rule and ICT's (rho, scope)
    stats = TokenStats(None, None, None, js)
    key = jax.random.key(0)
    for method, want in (("frequent", f), ("selectable", sel)):
        cfg = SelectorSection(method=method, warmup_steps=2)
        after = select(method, stats, None, valid, key=key, step=2, config=cfg)
        during = select(method, stats, None, valid, key=key, step=1, config=cfg)
        np.testing.assert_array_equal(np.asarray(after), want)
        np.testing.assert_array_equal(np.asarray(during), valid)
    with pytest.raises(ValueError, match="needs stats.js"):
        select("frequent", TokenStats(None, None, None, None), None, valid, key=key, step=5, config=cfg)


def test_selectable_threshold_is_above_float32_noise_of_identical_groups():
    """u of rollouts whose distributions are equal in exact arithmetic (a group before it diverges) stays
    below SELECTABLE_U_MIN in float32, at SmolLM2's vocabulary size, G = 16, peaked and flat logits."""
    from ict_jax.rl.token_stats import U_FORMS, stats_from_logits

    rng = np.random.default_rng(9)
    for scale in (1.0, 8.0, 30.0):
        row = (rng.standard_normal((1, 3, 49_152)) * scale).astype(np.float32)
        logits = np.repeat(row, 16, axis=0)
        tokens = rng.integers(0, 49_152, (16, 3)).astype(np.int32)
        for form in ("aligned", "loo"):
            st = stats_from_logits(jnp.asarray(logits), tokens, np.ones((16, 3), np.float32), group_size=16,
                                   u_form=form)
            assert float(np.asarray(st.js).max()) < SELECTABLE_U_MIN / 10, (scale, form)
    assert "aligned" in U_FORMS


def test_warmup_is_traced_data():
    rng = np.random.default_rng(4)
    valid = ragged_valid(rng, 4, 30)
    js = rng.random((4, 30)).astype(np.float32)
    stats = TokenStats(None, js, None, js)
    cfg = SelectorSection(method="ict", warmup_steps=20)
    key = jax.random.key(0)
    traces = []

    @jax.jit
    def f(step, method_random):
        traces.append(1)
        return (select("ict", stats, None, valid, key=key, step=step, config=cfg),
                select("random", stats, None, valid, key=key, step=step, config=cfg))

    for step, warm in [(0, True), (19, True), (20, False), (57, False)]:
        mi, mr = f(jnp.int32(step), 0)
        if warm:
            np.testing.assert_array_equal(np.asarray(mi), valid)
            np.testing.assert_array_equal(np.asarray(mr), valid)
        else:
            np.testing.assert_array_equal(np.asarray(mi), ref_topk(js, valid, 0.1, "sequence", 1))
            assert np.asarray(mr).sum() == np.asarray(mi).sum()
    assert len(traces) == 1
    # entropy has no warm-up
    ent = select("entropy", stats, None, valid, key=key, step=0, config=SelectorSection(method="entropy"))
    np.testing.assert_array_equal(np.asarray(ent), ref_topk(js, valid, 0.2, "batch", 1))


def test_select_dense_grpo_stapo_and_registry():
    rng = np.random.default_rng(5)
    valid = ragged_valid(rng, 4, 8)
    logp = np.log(rng.random((4, 8)) * 0.004).astype(np.float32)
    H1 = rng.random((4, 8)).astype(np.float32)
    stats = TokenStats(logp, H1, H1, H1)
    adv = np.array([1.0, -1.0, 1.0, 0.5], np.float32)
    key = jax.random.key(0)
    for method in ("dense", "grpo"):
        m = select(method, stats, adv, valid, key=key, step=0, config=SelectorSection(method=method))
        np.testing.assert_array_equal(np.asarray(m), valid)
    np.testing.assert_array_equal(np.asarray(dense_mask(valid > 0)), valid)
    m = select("stapo", stats, adv, valid, key=key, step=0, config=SelectorSection(method="stapo"))
    np.testing.assert_array_equal(np.asarray(m), np.asarray(stapo_mask(logp, H1, adv, valid)))
    assert np.asarray(m).sum() < valid.sum()  # something was silenced
    # group scope through select needs group_size
    cfg = SelectorSection(method="ict", scope="group", rho=0.25, warmup_steps=0)
    m = select("ict", stats, adv, valid, key=key, step=0, config=cfg, group_size=2)
    np.testing.assert_array_equal(np.asarray(m), ref_topk(H1, valid, 0.25, "group", 2))
    with pytest.raises(ValueError, match="needs stats.js"):
        select("ict", TokenStats(logp, H1, H1, None), adv, valid, key=key, step=0, config=cfg)

    # a new selector: the bottom-rho "frequent" tokens, with warm-up; M <= valid is enforced
    def frequent(stats, adv, valid, *, key, step, config, group_size):
        return ict_mask(-stats.js, valid, group_size=group_size, rho=resolved_rho(config) or 0.1)

    register_selector("frequent_test", frequent, warmup=True)
    with pytest.raises(ValueError, match="already registered"):
        register_selector("frequent_test", frequent)
    cfg = SelectorSection(method="ict", warmup_steps=3)
    m = select("frequent_test", stats, adv, valid, key=key, step=3, config=cfg)
    np.testing.assert_array_equal(np.asarray(m), ref_topk(-H1, valid, 0.1, "sequence", 1))
    m = select("frequent_test", stats, adv, valid, key=key, step=2, config=cfg)
    np.testing.assert_array_equal(np.asarray(m), valid)
    with pytest.raises(ValueError, match="not registered"):
        select("nope", stats, adv, valid, key=key, step=0, config=cfg)
    assert ict_jax.select is select
    for name in ("TokenStats", "stats_from_logits", "stats_from_hidden", "dense_mask", "ict_mask",
                 "entropy_mask", "stapo_mask", "random_mask", "register_selector"):
        assert callable(getattr(ict_jax, name)) and name in dir(ict_jax)


def test_registry_records_what_each_selector_reads():
    """`needs`: the statistics a selector reads, declared at registration; the step computes them, and
    select refuses statistics that lack one (docs/architecture.md, the selector registry)."""
    from ict_jax.rl.selectors import selector_needs
    from ict_jax.rl.token_stats import DEFAULT_COMPUTE

    assert {m: selector_needs(m) for m in ("dense", "grpo", "random", "ict", "frequent", "selectable", "entropy",
                                          "stapo")} == {
        "dense": (), "grpo": (), "random": (), "ict": ("js",), "frequent": ("js",), "selectable": ("js",),
        "entropy": ("H1",), "stapo": ("logp", "H1")}

    def by_pmax(stats, adv, valid, *, key, step, config, group_size):
        return ict_mask(stats.pmax, valid, rho=0.5)

    register_selector("needs_test_pmax", by_pmax, needs=("pmax", "pmax"), overwrite=True)
    register_selector("needs_test_undeclared", by_pmax, overwrite=True)
    assert selector_needs("needs_test_pmax") == ("pmax",)
    assert selector_needs("needs_test_undeclared") == DEFAULT_COMPUTE  # not declared: the step's default set
    with pytest.raises(TypeError, match="a sequence of statistic names"):
        register_selector("needs_test_bad", by_pmax, needs="js", overwrite=True)
    with pytest.raises(ValueError, match=r"needs \['H3'\] are not statistics"):
        register_selector("needs_test_bad", by_pmax, needs=("H3",), overwrite=True)
    valid = np.ones((2, 4), np.float32)
    x = jnp.asarray(np.arange(8, dtype=np.float32).reshape(2, 4))
    cfg = SelectorSection(method="ict", warmup_steps=0)
    with pytest.raises(ValueError, match="selector 'needs_test_pmax' needs stats.pmax"):
        select("needs_test_pmax", TokenStats(x, x, x, x), None, valid, key=jax.random.key(0), step=0, config=cfg)
    m = select("needs_test_pmax", TokenStats(None, None, None, None, pmax=x), None, valid, key=jax.random.key(0),
               step=0, config=cfg)
    np.testing.assert_array_equal(np.asarray(m), [[0, 0, 1, 1], [0, 0, 1, 1]])
    with pytest.raises(ValueError, match="rl.selector.method: selector 'nope' is not registered"):
        selector_needs("nope")
    # the method is a plain string, checked against the registry when the run is built (one line, the names)
    from ict_jax.config import ConfigError
    from ict_jax.config_load import load_config
    from ict_jax.rl.selectors import check_selector

    check_selector(load_config(None, ["rl.selector.method=needs_test_pmax"]).rl.selector)
    never = load_config(None, ["rl.selector.method=needs_test_never"]).rl.selector
    with pytest.raises(ConfigError, match="rl.selector.method: 'needs_test_never' is not a registered selector; "
                                          "registered: .*dense.*grpo.*ict") as err:
        check_selector(never)
    assert "\n" not in str(err.value)


# ------------------------------------------------------------------------------------------------
# 8 devices give the 1-device masks
# ------------------------------------------------------------------------------------------------
SCOPES_BY_METHOD = [("ict", "sequence"), ("ict", "group"), ("ict", "batch"), ("entropy", "batch"),
                    ("entropy", "group"), ("random", "batch"), ("stapo", None)]


def _pipeline(hidden, W, tokens, valid, adv, key, step, G):
    stats = stats_from_hidden(hidden, W, tokens, valid, group_size=G, temperature=1.0, chunk=5)
    masks = [select(m, stats, adv, valid, key=key, step=step, group_size=G,
                    config=SelectorSection(method=m, scope=s, rho=0.25 if s else None, warmup_steps=0))
             for m, s in SCOPES_BY_METHOD]
    return stats, masks


def _boundary_gap(score, valid, rho, scope, G):
    """Smallest |score gap| between the k-th and (k+1)-th valid candidate over the sets."""
    gaps = []
    flat_s, flat_v = score.reshape(-1), valid.reshape(-1) > 0
    for members in ref_sets(*score.shape, scope, G):
        s = np.sort(flat_s[members][flat_v[members]])[::-1]
        k = ref_k(len(s), rho)
        if 0 < k < len(s):
            gaps.append(s[k - 1] - s[k])
    return min(gaps)


def test_mesh_8_devices_equals_1_device(devices8):
    rng = np.random.default_rng(11)
    Pn, G, T, D, V = 4, 2, 12, 8, 33
    B = Pn * G
    hidden = rng.standard_normal((B, T, D)).astype(np.float32)
    W = (rng.standard_normal((D, V)) * 0.8).astype(np.float32)
    tokens = rng.integers(0, V, (B, T)).astype(np.int32)
    valid = ragged_valid(rng, B, T, empty_row=False)
    adv = rng.standard_normal(B).astype(np.float32)
    key = jax.random.key(3)
    f = jax.jit(functools.partial(_pipeline, G=G))
    one = jax.device_put((hidden, W, tokens, valid, adv), devices8[0])
    s1, m1 = f(*one, key, jnp.int32(30))

    mesh = Mesh(np.array(devices8).reshape(2, 2, 2), ("data", "fsdp", "tensor"))
    row = NamedSharding(mesh, P(("data", "fsdp")))
    rep = NamedSharding(mesh, P())
    args = (jax.device_put(hidden, row), jax.device_put(W, rep), jax.device_put(tokens, row),
            jax.device_put(valid, row), jax.device_put(adv, row))
    s8, m8 = f(*args, key, jnp.int32(30))
    assert len(s8.js.sharding.device_set) == 8
    tol = 1e-5
    for a, b in zip(s1, s8):
        if a is None:
            continue
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=tol, rtol=0)
    js, H1 = np.asarray(s1.js), np.asarray(s1.H1)
    for (method, scope), a, b in zip(SCOPES_BY_METHOD, m1, m8):
        if method in ("ict", "entropy"):
            score = js if method == "ict" else H1
            assert _boundary_gap(score, valid, 0.25, scope, G) > 10 * tol, (method, scope)
            np.testing.assert_array_equal(np.asarray(a), ref_topk(score, valid, 0.25, scope, G))
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a), err_msg=f"{method} {scope}")
    # STAPO's global quantile is meaningful: it silenced something
    assert np.asarray(m1[-1]).sum() <= valid.sum()


# ------------------------------------------------------------------------------------------------
# property tests (values drawn at fixed shapes)
# ------------------------------------------------------------------------------------------------
SHAPE = (4, 6)
N = SHAPE[0] * SHAPE[1]


@settings(max_examples=60, deadline=None)
@given(
    scores=st.lists(st.sampled_from([-np.inf, -1.0, 0.0, 0.25, 0.5, 1.0, 3.0]), min_size=N, max_size=N),
    valid=st.lists(st.booleans(), min_size=N, max_size=N),
    rho=st.sampled_from([0.1, 0.3, 0.5]),
    scope=st.sampled_from(["sequence", "group", "batch"]),
)
def test_mask_invariants(scores, valid, rho, scope):
    score = np.array(scores, np.float32).reshape(SHAPE)
    v = np.array(valid, np.float32).reshape(SHAPE)
    m = np.asarray(jit_ict(score, v, group_size=2, rho=rho, scope=scope))
    assert set(np.unique(m)) <= {0.0, 1.0} and np.all(m <= v)
    for members in ref_sets(*SHAPE, scope, 2):
        mm, vv, ss = m.reshape(-1)[members], v.reshape(-1)[members] > 0, score.reshape(-1)[members]
        assert mm.sum() == ref_k(int(vv.sum()), rho)
        kept, dropped = ss[mm > 0], ss[(mm == 0) & vv]
        if len(kept) and len(dropped):
            assert kept.min() >= dropped.max()
            # ties at the boundary go to the lower index
            b = kept.min()
            if b in dropped:
                assert np.max(np.flatnonzero((mm > 0) & (ss == b))) < np.min(np.flatnonzero((mm == 0) & vv & (ss == b)))
    np.testing.assert_array_equal(m, ref_topk(score, v, rho, scope, 2))


@settings(max_examples=30, deadline=None)
@given(
    H=st.lists(st.floats(0.0, 5.0, width=32), min_size=N, max_size=N),
    logp=st.lists(st.sampled_from([np.log(0.0005), np.log(0.0019), np.log(0.0021), -0.1]), min_size=N, max_size=N),
    adv=st.lists(st.sampled_from([-1.0, 0.0, 0.7]), min_size=SHAPE[0], max_size=SHAPE[0]),
    valid=st.lists(st.booleans(), min_size=N, max_size=N),
)
def test_stapo_invariants(H, logp, adv, valid):
    H1 = np.array(H, np.float32).reshape(SHAPE)
    lp = np.array(logp, np.float32).reshape(SHAPE)
    a = np.array(adv, np.float32)
    v = np.array(valid, np.float32).reshape(SHAPE)
    low = (v > 0) & (a[:, None] > 0) & (np.exp(lp.astype(np.float64)) < 0.002)
    for over, tau_h, cand in (("valid", 0.8, v > 0), ("low_prob_positive", 0.75, low)):
        m = np.asarray(stapo_mask(lp, H1, a, v, quantile_over=over))
        if cand.sum() == 0:  # no candidate: nothing silenced
            np.testing.assert_array_equal(m, (v > 0).astype(np.float32))
            continue
        q = np.quantile(H1[cand].astype(np.float64), tau_h, method="linear")
        silenced = low & (H1 < q)
        np.testing.assert_array_equal(m, ((v > 0) & ~silenced).astype(np.float32), err_msg=over)


# ------------------------------------------------------------------------------------------------
# rl.selector.ties: all (every token tied at the cut kept) and the micro_batch scope (docs/method.md §2)
# ------------------------------------------------------------------------------------------------
def ref_topk_all(score, valid, rho, scope, G):
    """NumPy: per candidate set, every valid position whose score is >= the k-th largest valid score."""
    B, T = score.shape
    s, v = np.asarray(score, np.float64).reshape(-1), np.asarray(valid).reshape(-1) > 0
    m = np.zeros(B * T)
    for members in ref_sets(B, T, scope, G):
        members = np.asarray(members)
        vs = np.sort(s[members][v[members]])[::-1]
        k = ref_k(vs.size, rho)
        if k:
            m[members[v[members] & (s[members] >= vs[k - 1])]] = 1.0
    return m.reshape(B, T)


jit_topk = jax.jit(ict_mask, static_argnames=("group_size", "rho", "scope", "ties"))


def test_ties_all_hand_computed():
    valid = np.ones((1, 6), np.float32)
    score = np.array([[0.5, 0.9, 0.5, 0.5, 0.1, 0.9]], np.float32)
    # an exact tie at the cut: k = ceil(0.5 * 6) = 3 falls inside the three 0.5s
    np.testing.assert_array_equal(jit_topk(score, valid, rho=0.5, scope="sequence"), [[1, 1, 0, 0, 0, 1]])
    np.testing.assert_array_equal(jit_topk(score, valid, rho=0.5, scope="sequence", ties="all"), [[1, 1, 1, 1, 0, 1]])
    # ties not at the cut: k = ceil(0.3 * 6) = 2 takes both 0.9s: the same mask under both rules
    for ties in ("position", "all"):
        np.testing.assert_array_equal(jit_topk(score, valid, rho=0.3, scope="sequence", ties=ties),
                                      [[0, 1, 0, 0, 0, 1]])
    # every score equal: position keeps k = ceil(0.2 * 4) = 1 (the lowest valid index), all keeps every valid one
    flat = np.full((2, 5), 0.25, np.float32)
    v = np.array([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]], np.float32)
    np.testing.assert_array_equal(jit_topk(flat, v, rho=0.2, scope="sequence"), [[0, 1, 0, 0, 0], [1, 0, 0, 0, 0]])
    np.testing.assert_array_equal(jit_topk(flat, v, rho=0.2, scope="sequence", ties="all"), v)
    # group and batch scopes: the cut inside the tie of zeros keeps all of it; -0.0 ties with 0.0
    zeros = np.zeros((4, 5), np.float32)
    zeros[3, 4] = -0.0
    zeros[2, 1] = 1.0
    valid = np.ones((4, 5), np.float32)
    valid[0, 0] = 0
    m = np.asarray(jit_topk(zeros, valid, group_size=2, rho=0.2, scope="batch", ties="all"))  # n = 19, k = 4
    np.testing.assert_array_equal(m, valid)
    m = np.asarray(jit_topk(zeros, valid, group_size=2, rho=0.1, scope="group", ties="all"))  # k = 1, 1
    np.testing.assert_array_equal(m[:2], valid[:2])  # group 0: all zeros tied at the cut
    np.testing.assert_array_equal(m[2:], [[0, 1, 0, 0, 0], [0, 0, 0, 0, 0]])  # group 1: the one 1.0, no tie
    # -inf scores: a valid -inf tied at the cut is kept; invalid positions never; n = 0 keeps nothing
    s = np.array([[-np.inf, -np.inf, 3.0, -np.inf, 7.0], [1.0, 1.0, 1.0, 1.0, 1.0]], np.float32)
    v = np.array([[1, 1, 1, 0, 1], [0, 0, 0, 0, 0]], np.float32)
    np.testing.assert_array_equal(jit_topk(s, v, rho=0.6, scope="sequence", ties="all"), [[1, 1, 1, 0, 1], [0] * 5])
    with pytest.raises(ValueError, match="ties: 'some'"):
        ict_mask(score, valid[:1, :6], ties="some")


@pytest.mark.parametrize("scope", ["sequence", "group", "batch"])
@pytest.mark.parametrize("rho", [0.1, 0.3, 1.0])
def test_ties_all_against_reference(scope, rho):
    rng = np.random.default_rng(int(rho * 100) + len(scope))
    score = np.round(rng.random((6, 9)), 1).astype(np.float32)  # many ties
    valid = ragged_valid(rng, 6, 9)
    pos = np.asarray(jit_topk(score, valid, group_size=3, rho=rho, scope=scope))
    every = np.asarray(jit_topk(score, valid, group_size=3, rho=rho, scope=scope, ties="all"))
    np.testing.assert_array_equal(every, ref_topk_all(score, valid, rho, scope, 3))
    assert np.all(every >= pos)  # position's k tokens are among them
    for fn, kw in ((entropy_mask, {}), (frequent_mask, {})):
        got = np.asarray(fn(score, valid, group_size=3, rho=rho, scope=scope, ties="all", **kw))
        want = every if fn is entropy_mask else valid * (1 - every)
        np.testing.assert_array_equal(got, want, err_msg=fn.__name__)


@settings(max_examples=60, deadline=None)
@given(
    scores=st.lists(st.sampled_from([-np.inf, -1.0, 0.0, 0.25, 0.5, 1.0, 3.0]), min_size=N, max_size=N),
    valid=st.lists(st.booleans(), min_size=N, max_size=N),
    rho=st.sampled_from([0.1, 0.3, 0.5]),
    scope=st.sampled_from(["sequence", "group", "batch"]),
)
def test_ties_all_invariants(scores, valid, rho, scope):
    """Per set: at least k kept, every kept score >= every dropped one, and the same mask as ``position``
    exactly when the cut is not inside a tie (the k-th and (k+1)-th valid scores differ, or k = n)."""
    score = np.array(scores, np.float32).reshape(SHAPE)
    v = np.array(valid, np.float32).reshape(SHAPE)
    pos = np.asarray(jit_topk(score, v, group_size=2, rho=rho, scope=scope))
    every = np.asarray(jit_topk(score, v, group_size=2, rho=rho, scope=scope, ties="all"))
    assert set(np.unique(every)) <= {0.0, 1.0} and np.all(every <= v) and np.all(every >= pos)
    for members in ref_sets(*SHAPE, scope, 2):
        mm, pm = every.reshape(-1)[members], pos.reshape(-1)[members]
        vv, ss = v.reshape(-1)[members] > 0, score.reshape(-1)[members]
        k = ref_k(int(vv.sum()), rho)
        assert mm.sum() >= k
        kept, dropped = ss[mm > 0], ss[(mm == 0) & vv]
        if len(kept) and len(dropped):
            assert kept.min() > dropped.max()  # strictly: nothing tied with a kept token is left out
        desc = np.sort(ss[vv])[::-1]
        cut_in_tie = 0 < k < desc.size and desc[k - 1] == desc[k]
        assert np.array_equal(mm, pm) == (not cut_in_tie)


def test_select_passes_ties_to_the_topk_selectors_only():
    score = np.array([[0.5, 0.9, 0.5, 0.5, 0.1, 0.9], [0.2, 0.2, 0.2, 0.2, 0.2, 0.2]], np.float32)
    valid = np.ones((2, 6), np.float32)
    stats = TokenStats(jnp.log(jnp.full((2, 6), 0.5)), jnp.asarray(score), None, jnp.asarray(score))
    adv = jnp.ones(2)
    key = jax.random.key(0)
    for method in ("ict", "entropy", "frequent"):
        for ties in ("position", "all"):
            cfg = SelectorSection(method=method, rho=0.5, scope="sequence", ties=ties, warmup_steps=0)
            got = np.asarray(select(method, stats, adv, valid, key=key, step=0, config=cfg))
            cut = np.asarray(ict_mask(score, valid, rho=0.5, ties=ties))
            np.testing.assert_array_equal(got, valid - cut if method == "frequent" else cut, err_msg=(method, ties))
    # the all-rule mask of row 0 keeps the whole tie of 0.5s, row 1 (all equal) every token
    np.testing.assert_array_equal(np.asarray(ict_mask(score, valid, rho=0.5, ties="all")),
                                  [[1, 1, 1, 1, 0, 1], [1, 1, 1, 1, 1, 1]])
    # random: Uniform[0, 1) draws do not tie here, so both rules give the same mask
    a, b = (np.asarray(select("random", stats, adv, valid, key=key, step=0,
                              config=SelectorSection(method="random", rho=0.5, ties=t, warmup_steps=0)))
            for t in ("position", "all"))
    np.testing.assert_array_equal(a, b)
    # selectors without a cut ignore the rule
    for method in ("dense", "stapo", "selectable"):
        a, b = (np.asarray(select(method, stats, adv, valid, key=key, step=0,
                                  config=SelectorSection(method=method, ties=t, warmup_steps=0)))
                for t in ("position", "all"))
        np.testing.assert_array_equal(a, b, err_msg=method)
    # the warm-up still gives M = valid under ties: all
    cfg = SelectorSection(method="ict", rho=0.5, ties="all", warmup_steps=3)
    np.testing.assert_array_equal(np.asarray(select("ict", stats, adv, valid, key=key, step=2, config=cfg)), valid)


def test_micro_batch_scope_hand_computed():
    """20-Entropy as its official code runs it: the top max(1, ceil(0.2 n)) by H1 within each micro-batch.
    Two micro-batches of two rows: n = 5 (k = 1) and n = 6 (k = 2); over the mini-batch n = 11 (k = 3)."""
    H1 = jnp.array([[0.9, 0.8, 0.1], [0.7, 0.2, 0.0], [0.5, 0.4, 0.3], [0.6, 0.05, 0.01]], jnp.float32)
    valid = jnp.array([[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 1, 1]], jnp.float32)
    stats = TokenStats(None, H1, None, None)
    adv = jnp.zeros(4)
    key = jax.random.key(0)
    micro = SelectorSection(method="entropy", scope="micro_batch")
    got = select("entropy", stats, adv, valid, key=key, step=0, config=micro, micro_batches=2)
    np.testing.assert_array_equal(got, [[1, 0, 0], [0, 0, 0], [1, 0, 0], [1, 0, 0]])
    mini = select("entropy", stats, adv, valid, key=key, step=0, config=SelectorSection(method="entropy"),
                  micro_batches=2)  # the default scope, batch: the mini-batch's top 3, all in the first micro-batch
    np.testing.assert_array_equal(mini, [[1, 1, 0], [1, 0, 0], [0, 0, 0], [0, 0, 0]])
    # one micro-batch is the mini-batch: scope batch, bit for bit
    one = select("entropy", stats, adv, valid, key=key, step=0, config=micro, micro_batches=1)
    np.testing.assert_array_equal(one, mini)
    # each micro-batch on its own, as entropy_mask with scope batch on its arrays
    for sl in (slice(0, 2), slice(2, 4)):
        np.testing.assert_array_equal(got[sl], entropy_mask(H1[sl], valid[sl], rho=0.2, scope="batch"))
    # ties: all inside micro-batches: the second micro-batch's 0.5 ties with a new 0.5 at the cut
    tied = H1.at[3, 1].set(0.5)
    got = select("entropy", stats._replace(H1=tied), adv, valid, key=key, step=0, micro_batches=2,
                 config=SelectorSection(method="entropy", scope="micro_batch", ties="all"))
    np.testing.assert_array_equal(got, [[1, 0, 0], [0, 0, 0], [1, 0, 0], [1, 1, 0]])
    with pytest.raises(ValueError, match="micro_batches=3"):
        select("entropy", stats, adv, valid, key=key, step=0, config=micro, micro_batches=3)
    with pytest.raises(ValueError, match="micro_batches=n"):
        entropy_mask(H1, valid, scope="micro_batch")


def test_micro_batch_scope_is_for_entropy_only():
    from ict_jax.config import ConfigError
    from ict_jax.config_load import load_config

    cfg = load_config(None, ["rl.selector.method=entropy", "rl.selector.scope=micro_batch", "rl.selector.ties=all"])
    assert resolved_scope(cfg.rl.selector) == "micro_batch" and cfg.rl.selector.ties == "all"
    assert load_config(None, []).rl.selector.ties == "position"
    check_selector(cfg.rl.selector)
    for method in ("ict", "random", "frequent"):  # loads; refused when the run is built (the registry's flag)
        sel = load_config(None, [f"rl.selector.method={method}", "rl.selector.scope=micro_batch"]).rl.selector
        with pytest.raises(ConfigError, match="rl.selector.scope: 'micro_batch' .* for method entropy only"):
            check_selector(sel)
    assert [n for n in registered_selectors() if selector_info(n).micro_batch] == ["entropy"]
    with pytest.raises(ConfigError, match="rl.selector.ties: 'some' is not allowed"):
        load_config(None, ["rl.selector.ties=some"])


def test_mesh_8_devices_ties_all_and_micro_batch_scope(devices8):
    """ties: all and the micro_batch scope on a (2, 2, 2) mesh give the masks of one device, with cuts
    inside exact ties under every scope."""
    rng = np.random.default_rng(5)
    B, T = 8, 12
    score = np.round(rng.random((B, T)), 1).astype(np.float32)  # ties at most cuts
    valid = ragged_valid(rng, B, T, empty_row=False)
    stats = lambda s: TokenStats(None, s, None, s)  # noqa: E731
    cases = [("ict", "sequence", 1), ("ict", "group", 1), ("ict", "batch", 1), ("entropy", "batch", 1),
             ("entropy", "micro_batch", 2), ("entropy", "micro_batch", 4)]

    def masks(s, v):
        return [select(m, stats(s), jnp.zeros(B), v, key=jax.random.key(0), step=0, group_size=2, micro_batches=n,
                       config=SelectorSection(method=m, scope=sc, rho=0.25, ties=t, warmup_steps=0))
                for m, sc, n in cases for t in ("position", "all")]

    f = jax.jit(masks)
    one = f(*jax.device_put((score, valid), devices8[0]))
    mesh = Mesh(np.array(devices8).reshape(2, 2, 2), ("data", "fsdp", "tensor"))
    row = NamedSharding(mesh, P(("data", "fsdp")))
    eight = f(jax.device_put(score, row), jax.device_put(valid, row))
    differ = 0
    for i, (a, b) in enumerate(zip(one, eight)):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a), err_msg=str(cases[i // 2]))
    for (_, sc, n), pos, every in zip(cases, one[::2], one[1::2]):
        pos, every = np.asarray(pos), np.asarray(every)
        if sc != "micro_batch":
            np.testing.assert_array_equal(every, ref_topk_all(score, valid, 0.25, sc, 2))
        else:
            for r in range(0, B, B // n):
                np.testing.assert_array_equal(every[r:r + B // n],
                                              ref_topk_all(score[r:r + B // n], valid[r:r + B // n], 0.25, "batch", 2))
        differ += int(not np.array_equal(pos, every))
    assert differ >= 4  # the draw puts cuts inside ties: the rules differ there


def test_every_built_in_selector_is_in_the_config_docs_method_row():
    """docs/config.md's ``rl.selector.method`` row is where the built-in selectors are listed (docs/method.md
    §2, the spec, tabulates the paper's): every selector ``rl.selectors`` registers, and its aliases, are named
    there, and it names no other."""
    import pathlib
    import re

    from ict_jax.rl.selectors import ALIASES, BUILTIN_SELECTORS

    doc = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "config.md").read_text()
    section = doc[doc.index("### `rl.selector`"):]
    row = next(line for line in section.splitlines() if line.startswith("| `method` |"))
    allowed = row.split("|")[2]
    named = set(re.findall(r"`([a-z_]+)`", allowed))
    assert named == set(BUILTIN_SELECTORS) | set(ALIASES), (sorted(named), BUILTIN_SELECTORS)
    assert BUILTIN_SELECTORS[:5] == ("dense", "ict", "entropy", "stapo", "random")  # docs/method.md §2's order
