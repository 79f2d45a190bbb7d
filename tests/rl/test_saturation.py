"""u's ceiling and the tie share (ict_jax.rl.saturation) against hand-computed values, u itself (the
float64 reference of every reading, tests/rl/test_token_stats.py, which the JAX statistics match: the ceiling
is attained by disjoint point masses and never exceeded), and a float64 NumPy reference of the tie rule."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ict_jax.config import SelectorSection
from ict_jax.rl.batch import RolloutBatch
from ict_jax.rl.metrics import step_metrics
from ict_jax.rl.saturation import tie_decided, tie_selected_frac, u_at_ceiling, u_ceiling
from ict_jax.rl.selectors import topk_mask
from ict_jax.rl.token_stats import U_FORMS, TokenStats

from test_token_stats import ref_readings  # the same folder (pytest puts a test file's folder on sys.path)

LN2 = math.log(2.0)
# jitted once per reading: one compile instead of every primitive's eager compile (the default suite's budget)
ceiling = jax.jit(u_ceiling, static_argnames=("group_size", "u_form"))
at_ceiling = jax.jit(u_at_ceiling, static_argnames=("group_size", "u_form", "fraction"))


def f1(alpha):
    """1/2 [ln(2/(1+a)) + a ln(2a/(1+a))]: a point mass against alpha times itself (float64)."""
    return 0.5 * (math.log(2 / (1 + alpha)) + (alpha * math.log(2 * alpha / (1 + alpha)) if alpha else 0.0))


def test_ceiling_hand_values():
    G = 4
    # one group of 4 rows, T = 3: all active at t = 0, rows 0-1 at t = 1, row 0 alone at t = 2
    valid = np.array([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 0, 0]], np.float32)
    c = {f: np.asarray(ceiling(valid, G, f), np.float64) for f in U_FORMS}
    aligned = lambda n: f1(1 / n) + 0.5 * (n - 1) / n * LN2  # noqa: E731
    np.testing.assert_allclose(c["aligned"][:, 0], aligned(4), rtol=1e-6)
    assert abs(aligned(4) - 0.380) < 5e-4 and abs(aligned(8) - 0.497) < 5e-4  # docs/statistics.md's numbers
    np.testing.assert_allclose(np.asarray(ceiling(np.ones((8, 1)), 8, "aligned")), aligned(8), rtol=1e-6)
    np.testing.assert_allclose(c["aligned"][:2, 1], aligned(2), rtol=1e-6)
    assert c["aligned"][0, 2] == 0.0  # alone: u = 0
    np.testing.assert_allclose(c["loo"][:, 0], LN2, rtol=1e-6)
    assert c["loo"][0, 2] == 0.0
    np.testing.assert_allclose(c["literal"][:, 0], f1(1 / G) + 0.5 * 3 / G * LN2, rtol=1e-6)
    np.testing.assert_allclose(c["literal"][:2, 1], f1(1 / G) + 0.5 * 1 / G * LN2, rtol=1e-6)
    np.testing.assert_allclose(c["literal"][0, 2], f1(1 / G), rtol=1e-6)  # alone, yet u = this exactly
    N = valid.sum()  # pooled: the group's 7 valid tokens
    np.testing.assert_allclose(c["pooled"][valid > 0], f1(1 / N) + 0.5 * (N - 1) / N * LN2, rtol=1e-6)
    for f in U_FORMS:
        assert (c[f][valid == 0] == 0).all() and (c[f] <= LN2 + 1e-7).all()
    with pytest.raises(ValueError, match="u_form"):
        u_ceiling(valid, G, "nope")


def _design(rng, G=3, P=2, T=4, V=32):
    valid = np.zeros((P * G, T), np.float32)
    for i in range(P * G):
        valid[i, : rng.integers(1, T + 1)] = 1.0
    return valid, P, G, T, V


@pytest.mark.parametrize("form", U_FORMS)
def test_ceiling_is_attained_by_disjoint_point_masses(form):
    """Every (row, t) of a group puts (almost) all mass on its own token: every reading's u equals its
    ceiling at every valid position, and u_at_ceiling counts exactly the positions with ceiling > 0."""
    valid, P, G, T, V = _design(np.random.default_rng(1))
    logits = np.zeros((P * G, T, V), np.float32)
    for g in range(P):
        for k, (j, t) in enumerate((j, t) for j in range(G) for t in range(T)):
            logits[g * G + j, t, k] = 60.0  # p ~ 1 - V e^-60
    tokens = np.zeros((P * G, T), np.int32)
    u = ref_readings(logits, tokens, valid, G, 1.0, form)["js"]
    c = ceiling(valid, G, form)
    np.testing.assert_allclose(u, np.asarray(c), atol=2e-6)
    want = ((valid > 0) & (np.asarray(c) > 0)).sum() / valid.sum()
    assert float(at_ceiling(u, valid, G, form)) == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("form", U_FORMS)
def test_ceiling_bounds_u(form):
    rng = np.random.default_rng(2)
    valid, P, G, T, V = _design(rng, V=6)
    logits = (rng.normal(0, 4, (P * G, T, V))).astype(np.float32)
    logits[rng.random((P * G, T, V)) < 0.3] = -np.inf  # some exact zeros of p
    logits[..., 0] = 0.0  # never all -inf
    tokens = rng.integers(0, V, (P * G, T)).astype(np.int32)
    u = ref_readings(logits, tokens, valid, G, 1.0, form)["js"]
    c = np.asarray(ceiling(valid, G, form))
    assert (u <= c + 1e-6).all() and (u > 0.5 * c).any()
    assert 0.0 <= float(at_ceiling(u, valid, G, form)) < 1.0
    assert float(at_ceiling(u, np.zeros_like(valid), G, form)) == 0.0


def ref_ties(score, mask, valid, rows):
    """float64 NumPy: per candidate set of ``rows`` rows, the selected tokens with the k-th score when a
    valid token left out shares it."""
    B, T = score.shape
    out = np.zeros((B, T), bool)
    for s0 in range(0, B, rows):
        s = np.asarray(score[s0:s0 + rows], np.float64).ravel()
        v = valid[s0:s0 + rows].ravel() > 0
        m = (mask[s0:s0 + rows].ravel() > 0) & v
        if not m.any():
            continue
        kth = s[m].min()
        if (v & ~m & (s == kth)).any():
            out[s0:s0 + rows] = (m & (s == kth)).reshape(rows, T)
    return out


def ref_topk(score, valid, rho, rows):
    """float64 NumPy top-k of docs/method.md §2 per candidate set of ``rows`` rows: k = max(1, ceil(rho n)),
    stable descending sort, ties to the lower flat index."""
    B, T = score.shape
    out = np.zeros((B, T), bool)
    for s0 in range(0, B, rows):
        s, v = score[s0:s0 + rows].ravel().astype(np.float64), valid[s0:s0 + rows].ravel() > 0
        n = int(v.sum())
        if n == 0:
            continue
        k = max(1, math.ceil(rho * n - 1e-12))
        order = [i for i in np.argsort(-s, kind="stable") if v[i]][:k]
        keep = np.zeros(s.size, bool)
        keep[order] = True
        out[s0:s0 + rows] = keep.reshape(-1, T)
    return out


def test_tie_decided_matches_reference():
    rng = np.random.default_rng(3)
    B, T, G = 8, 9, 4
    valid = (rng.random((B, T)) < 0.8).astype(np.float32)
    score = rng.integers(0, 4, (B, T)).astype(np.float32)  # few values: ties everywhere
    ties = jax.jit(tie_decided, static_argnames=("scope", "group_size", "set_rows"))
    for scope, rows in (("sequence", 1), ("group", G), ("batch", 4)):
        mask = ref_topk(score, valid, 0.3, rows).astype(np.float32)
        got = np.asarray(ties(score, mask, valid, scope=scope, group_size=G, set_rows=rows))
        want = ref_ties(score, mask, valid, rows)
        np.testing.assert_array_equal(got, want, err_msg=scope)
        assert want.any() and not want.all()  # the draw has ties at some cuts and not at others
    frac = float(tie_selected_frac(score, mask, valid, scope="batch", set_rows=4))
    assert frac == pytest.approx(want.sum() / mask.sum(), rel=1e-6)


def test_tie_hand_case():
    valid = np.ones((1, 6), np.float32)
    score = np.array([[0.5, 0.9, 0.5, 0.5, 0.1, 0.9]], np.float32)
    topk = jax.jit(topk_mask, static_argnames=("rho", "scope", "group_size"))
    ties = jax.jit(tie_decided, static_argnames=("scope", "group_size", "set_rows"))
    mask = np.asarray(topk(score, valid, rho=0.5, scope="sequence"))  # k = 3: 0.9, 0.9, then a 0.5
    np.testing.assert_array_equal(mask, [[1, 1, 0, 0, 0, 1]])  # the lower index wins the tie (method.md §2)
    np.testing.assert_array_equal(ties(score, mask, valid, scope="sequence"), [[1, 0, 0, 0, 0, 0]])
    mask2 = np.asarray(topk(score, valid, rho=0.3, scope="sequence"))  # k = 2: the two 0.9: no tie at the cut
    assert not np.asarray(ties(score, mask2, valid, scope="sequence")).any()
    assert not np.asarray(ties(score, np.zeros_like(mask), valid, scope="sequence")).any()


def test_step_metrics_report_both():
    B, T, G = 4, 5, 2
    valid = np.ones((B, T), np.float32)
    js = np.full((B, T), 0.33, np.float32)  # aligned ceiling at n = 2 is 0.2158: every token at it
    js[0, 0] = 0.1
    stats = TokenStats(jnp.zeros((B, T)), jnp.ones((B, T)), jnp.ones((B, T)), jnp.asarray(np.minimum(js, 0.2158)))
    mask = np.asarray(topk_mask(stats.js, valid, rho=0.1, scope="sequence"))
    batch = RolloutBatch(tokens=jnp.zeros((B, T + 1), jnp.int32), attention_mask=jnp.ones((B, T + 1), jnp.int32),
                         response_valid=jnp.asarray(valid), rewards=jnp.zeros(B), advantages=jnp.zeros(B),
                         sampler_logp=jnp.zeros((B, T)), truncated=jnp.zeros(B), row_valid=jnp.ones(B),
                         correct=jnp.zeros(B))
    metrics = jax.jit(step_metrics, static_argnames=("group_size", "u_form", "selector", "mini_batches"))
    m = metrics(batch, jnp.asarray(valid), jnp.asarray(mask), stats, jnp.zeros((B, T)), group_size=G,
                u_form="aligned", selector=SelectorSection(method="ict"))
    assert float(m["stats/u_at_ceiling"]) == pytest.approx(19 / 20)
    assert float(m["mask/tie_selected_frac"]) == 1.0  # each row keeps 1 of its 5 (4-5 tied) tokens
    m = jax.eval_shape(lambda: step_metrics(batch, jnp.asarray(valid), jnp.asarray(mask), stats, jnp.zeros((B, T)),
                                            G, selector=SelectorSection(method="dense")))
    assert "stats/u_at_ceiling" not in m and "mask/tie_selected_frac" not in m


def test_tie_decided_under_ties_all_hand_case():
    """ties: all keeps every token tied at the cut; the tie decided those at s_k when more than k valid
    tokens score >= s_k, and nothing where the cut is not inside a tie or the mask is not the cut."""
    valid = np.ones((1, 6), np.float32)
    score = np.array([[0.5, 0.9, 0.5, 0.5, 0.1, 0.9]], np.float32)
    topk = jax.jit(topk_mask, static_argnames=("rho", "scope", "group_size", "ties"))
    ties = jax.jit(tie_decided, static_argnames=("scope", "group_size", "set_rows", "ties", "rho"))
    mask = np.asarray(topk(score, valid, rho=0.5, scope="sequence", ties="all"))  # k = 3: both 0.9 and all three 0.5
    np.testing.assert_array_equal(mask, [[1, 1, 1, 1, 0, 1]])
    np.testing.assert_array_equal(ties(score, mask, valid, scope="sequence", ties="all", rho=0.5), [[1, 0, 1, 1, 0, 0]])
    assert float(tie_selected_frac(score, mask, valid, scope="sequence", ties="all", rho=0.5)) == pytest.approx(3 / 5)
    # k = 2 takes both 0.9: no tie at the cut
    mask2 = np.asarray(topk(score, valid, rho=0.3, scope="sequence", ties="all"))
    assert not np.asarray(ties(score, mask2, valid, scope="sequence", ties="all", rho=0.3)).any()
    # all scores equal: the tie decided every token; a warm-up's M = valid is not the cut: nothing
    flat = np.full((1, 6), 0.2, np.float32)
    np.testing.assert_array_equal(ties(flat, valid, valid, scope="sequence", ties="all", rho=0.5), valid > 0)
    assert not np.asarray(ties(score, valid, valid, scope="sequence", ties="all", rho=0.5)).any()
    with pytest.raises(ValueError, match="needs rho"):
        tie_decided(score, mask, valid, scope="sequence", ties="all")


def test_tie_decided_under_ties_all_matches_reference():
    rng = np.random.default_rng(4)
    B, T, G = 8, 9, 4
    valid = (rng.random((B, T)) < 0.8).astype(np.float32)
    score = rng.integers(0, 4, (B, T)).astype(np.float32)
    topk = jax.jit(topk_mask, static_argnames=("rho", "scope", "group_size", "ties"))
    ties = jax.jit(tie_decided, static_argnames=("scope", "group_size", "set_rows", "ties", "rho"))
    for scope, rows in (("sequence", 1), ("group", G), ("micro_batch", 4)):
        select_scope = "batch" if scope == "micro_batch" else scope
        mask = np.concatenate([np.asarray(topk(score[r:r + rows] if scope == "micro_batch" else score,
                                               valid[r:r + rows] if scope == "micro_batch" else valid,
                                               rho=0.3, scope=select_scope, group_size=G, ties="all"))
                               for r in (range(0, B, rows) if scope == "micro_batch" else [0])])
        got = np.asarray(ties(score, mask, valid, scope=scope, group_size=G, set_rows=rows, ties="all", rho=0.3))
        want = np.zeros((B, T), bool)  # float64 loops: s_k per set, the tie at the cut when #(s >= s_k) > k
        for s0 in range(0, B, rows):
            s, v, m = score[s0:s0 + rows].ravel(), valid[s0:s0 + rows].ravel() > 0, mask[s0:s0 + rows].ravel() > 0
            k = max(1, math.ceil(0.3 * v.sum() - 1e-12)) if v.any() else 0
            if k and (v & (s >= np.sort(s[v])[::-1][k - 1])).sum() > k:
                want[s0:s0 + rows] = (m & (s == np.sort(s[v])[::-1][k - 1])).reshape(rows, T)
        np.testing.assert_array_equal(got, want, err_msg=scope)
        assert want.any() and not want.all()
        # the same mask under position: its tie share counts the tokens kept by position only
        pos = ref_topk(score, valid, 0.3, rows).astype(np.float32)
        assert np.asarray(ties(score, pos, valid, scope=scope, group_size=G, set_rows=rows)).sum() <= got.sum()


def test_step_metrics_tie_share_under_both_rules():
    B, T, G = 4, 5, 2
    valid = np.ones((B, T), np.float32)
    js = np.full((B, T), 0.2, np.float32)
    js[:, 0] = 0.3  # each row: one 0.3, then four 0.2 tied; rho 0.4 -> k = 2 cuts inside the tie
    stats = TokenStats(jnp.zeros((B, T)), jnp.ones((B, T)), jnp.ones((B, T)), jnp.asarray(js))
    batch = RolloutBatch(tokens=jnp.zeros((B, T + 1), jnp.int32), attention_mask=jnp.ones((B, T + 1), jnp.int32),
                         response_valid=jnp.asarray(valid), rewards=jnp.zeros(B), advantages=jnp.zeros(B),
                         sampler_logp=jnp.zeros((B, T)), truncated=jnp.zeros(B), row_valid=jnp.ones(B),
                         correct=jnp.zeros(B))
    metrics = jax.jit(step_metrics, static_argnames=("group_size", "u_form", "selector", "mini_batches",
                                                     "micro_batches"))
    for ties, sel, share in (("position", 2, 1 / 2), ("all", 5, 4 / 5)):
        cfg = SelectorSection(method="ict", rho=0.4, ties=ties)
        mask = np.asarray(topk_mask(stats.js, valid, rho=0.4, scope="sequence", ties=ties))
        assert mask.sum() == B * sel
        m = metrics(batch, jnp.asarray(valid), jnp.asarray(mask), stats, jnp.zeros((B, T)), group_size=G,
                    selector=cfg)
        assert float(m["mask/tie_selected_frac"]) == pytest.approx(share), ties
