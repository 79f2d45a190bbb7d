"""docs/method.md §1 statistics against float64 NumPy; the chunked path against the dense one (values and
gradients); no NaN on -inf logits, all-padding groups, G = 1; the chunked path's memory claim."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ict_jax.rl.token_stats import (
    ALL_STATS,
    U_FORMS,
    TokenStats,
    _js,
    stats_and_surrogate,
    stats_from_hidden,
    stats_from_logits,
)

ATOL, RTOL = 1e-5, 1e-6
LN2 = np.log(2.0)
jit_logits = jax.jit(stats_from_logits, static_argnames=("group_size", "temperature", "compute", "u_form"))


# ------------------------------------------------------------------------------------------------
# float64 NumPy reference (docs/method.md §1, written independently of the JAX code)
# ------------------------------------------------------------------------------------------------
def _xlogy(x, y):
    out = np.zeros(np.broadcast(x, y).shape)
    x, y = np.broadcast_arrays(x, y)
    nz = x != 0
    out[nz] = x[nz] * np.log(y[nz])
    return out


def ref_stats(logits, tokens, valid, G, temp):
    z = logits.astype(np.float64) / temp
    B, T, V = z.shape
    valid = valid > 0
    z = np.where(valid[..., None], z, 0.0)
    zmax = z.max(-1, keepdims=True)
    logZ = np.log(np.exp(z - zmax).sum(-1)) + zmax[..., 0]
    p = np.exp(z - logZ[..., None])
    logp = np.take_along_axis(z, tokens[..., None], -1)[..., 0] - logZ
    H1 = -_xlogy(p, p).sum(-1)
    H2 = -np.log((p * p).sum(-1))
    P = B // G
    w = valid.reshape(P, G, T).astype(np.float64)
    pg = p.reshape(P, G, T, V)
    cnt = w.sum(1)
    pbar = np.zeros((P, T, V))
    for g in range(P):
        for t in range(T):
            if cnt[g, t] > 0:
                pbar[g, t] = (w[g, :, t, None] * pg[g, :, t]).sum(0) / cnt[g, t]
    js = np.zeros((P, G, T))
    for g in range(P):
        for j in range(G):
            for t in range(T):
                a, b = pg[g, j, t], pbar[g, t]
                m = (a + b) / 2
                js[g, j, t] = 0.5 * (_xlogy(a, a) - _xlogy(a, m)).sum() + 0.5 * (_xlogy(b, b) - _xlogy(b, m)).sum()
    js = np.clip(js.reshape(B, T), 0, LN2)
    out = dict(logp=logp, H1=H1, H2=H2, js=js)
    return {k: np.where(valid, v, 0.0) for k, v in out.items()}, p


def ref_readings(logits, tokens, valid, G, temp, u_form):
    """float64 u, Q(o_t) and max_v p of every reading of docs/method.md §1 (loops, written from the
    definitions in token_stats' module docstring, independently of the JAX code)."""
    z = logits.astype(np.float64) / temp
    B, T, V = z.shape
    valid = valid > 0
    z = np.where(valid[..., None], z, 0.0)
    zmax = z.max(-1, keepdims=True)
    p = np.exp(z - zmax)
    p /= p.sum(-1, keepdims=True)
    P = B // G
    w = valid.reshape(P, G, T).astype(np.float64)
    pg = p.reshape(P, G, T, V)
    u = np.zeros((P, G, T))
    qtok = np.zeros((P, G, T))
    for g in range(P):
        pool = sum(w[g, j, t] * pg[g, j, t] for j in range(G) for t in range(T))
        n_pool = w[g].sum()
        for i in range(G):
            for t in range(T):
                if not w[g, i, t]:
                    continue
                n = w[g, :, t].sum()
                if u_form == "aligned":
                    q = sum(w[g, j, t] * pg[g, j, t] for j in range(G)) / n
                elif u_form == "loo":
                    if n - 1 == 0:
                        continue  # no other rollout active: u = 0, Q = 0
                    q = sum(w[g, j, t] * pg[g, j, t] for j in range(G) if j != i) / (n - 1)
                elif u_form == "literal":
                    q = sum(w[g, j, t] * pg[g, j, t] for j in range(G)) / G
                else:  # pooled
                    q = pool / n_pool
                a = pg[g, i, t]
                m = (a + q) / 2
                u[g, i, t] = 0.5 * (_xlogy(a, a) - _xlogy(a, m)).sum() + 0.5 * (_xlogy(q, q) - _xlogy(q, m)).sum()
                qtok[g, i, t] = q[tokens.reshape(P, G, T)[g, i, t]]
    u = np.clip(u.reshape(B, T), 0, LN2)
    pmax = np.where(valid, p.max(-1), 0.0)
    return {"js": u, "pbar_tok": qtok.reshape(B, T), "pmax": pmax}


def make_case(rng, P, G, T, V, kind, valid_kind="ragged"):
    B = P * G
    logits = rng.standard_normal((B, T, V)).astype(np.float32)
    if kind == "peaked":
        logits *= 30.0
    elif kind == "neginf":
        logits[rng.random((B, T, V)) < 0.4] = -np.inf
    # rollouts of a group share a prefix: identical logits at t < 2 (u = 0 there)
    lg = logits.reshape(P, G, T, V)
    lg[:, :, :2] = lg[:, :1, :2]
    tokens = rng.integers(0, V, (B, T))
    if kind == "neginf":  # the sampler never emits a -inf token; keep one finite entry per row
        fin = np.take_along_axis(logits, tokens[..., None], -1)[..., 0]
        logits[..., 0] = np.where(np.isfinite(logits[..., 0]), logits[..., 0], 0.5)
        tokens = np.where(np.isfinite(fin), tokens, 0)
    lengths = rng.integers(0, T + 1, B) if valid_kind == "ragged" else np.full(B, T)
    valid = (np.arange(T)[None] < lengths[:, None]).astype(np.float32)
    if valid_kind == "ragged":
        valid[:G] = 0.0  # an all-padding group
        valid[G] = 1.0  # and a full row
    return logits, tokens.astype(np.int32), valid


def assert_close(name, got, want):
    got = np.asarray(got, np.float64)
    assert np.all(np.isfinite(got)), f"{name}: non-finite values"
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=RTOL, err_msg=name)


@pytest.mark.parametrize(
    "P,G,T,V,kind,temp",
    [
        (3, 4, 6, 7, "gaussian", 1.0),
        (3, 4, 6, 7, "peaked", 0.7),
        (3, 4, 6, 7, "neginf", 1.0),
        (2, 3, 5, 1000, "gaussian", 1.3),
        (2, 3, 5, 1000, "peaked", 1.0),
        (2, 3, 5, 1000, "neginf", 0.6),
        (2, 2, 3, 50_000, "gaussian", 1.0),
        (2, 2, 3, 50_000, "peaked", 1.0),
        (2, 2, 3, 50_000, "neginf", 1.0),
        (4, 1, 5, 64, "gaussian", 1.0),  # G = 1
    ],
)
def test_logits_path_matches_float64(P, G, T, V, kind, temp):
    rng = np.random.default_rng(V + T + G)
    logits, tokens, valid = make_case(rng, P, G, T, V, kind)
    want, _ = ref_stats(logits, tokens, valid, G, temp)
    got = jit_logits(jnp.asarray(logits), tokens, valid, group_size=G, temperature=temp)
    assert isinstance(got, TokenStats)
    for name in ("logp", "H1", "H2", "js"):
        assert getattr(got, name).shape == (P * G, T) and getattr(got, name).dtype == jnp.float32
        assert_close(name, getattr(got, name), want[name])
    js = np.asarray(got.js)
    assert js.min() >= 0.0 and js.max() <= np.float32(LN2)
    # identical prefixes (t < 2) and rows alone at t: u = 0
    assert np.all(js[:, :2] <= 1e-6)
    if G == 1:
        assert np.all(js == 0.0)
    # invalid positions are exactly 0
    for name in ("logp", "H1", "H2", "js"):
        assert np.all(np.asarray(getattr(got, name))[valid == 0] == 0.0)


READING_CASES = [(3, 4, 6, 7, "gaussian", 1.0), (3, 4, 6, 7, "peaked", 0.7), (3, 4, 6, 7, "neginf", 1.0),
                 (2, 3, 5, 1000, "gaussian", 1.3), (2, 3, 5, 1000, "peaked", 1.0), (4, 1, 5, 64, "gaussian", 1.0)]


@pytest.mark.parametrize("u_form", U_FORMS)
@pytest.mark.parametrize("P,G,T,V,kind,temp", READING_CASES)
def test_readings_of_u_match_float64(u_form, P, G, T, V, kind, temp):
    """Every reading of u (docs/method.md §1, stats.u_form), Q(o_t) and max_v p against float64 loops."""
    rng = np.random.default_rng(V + T + G + 7)
    logits, tokens, valid = make_case(rng, P, G, T, V, kind)
    want = ref_readings(logits, tokens, valid, G, temp, u_form)
    got = jit_logits(jnp.asarray(logits), tokens, valid, group_size=G, temperature=temp, compute=ALL_STATS,
                     u_form=u_form)
    for name in ("js", "pbar_tok", "pmax"):
        assert_close(f"{u_form}:{name}", getattr(got, name), want[name])
        assert np.all(np.asarray(getattr(got, name))[valid == 0] == 0.0)
    # logp, H1, H2 do not depend on the reading
    base, _ = ref_stats(logits, tokens, valid, G, temp)
    for name in ("logp", "H1", "H2"):
        assert_close(name, getattr(got, name), base[name])
    js = np.asarray(got.js)
    assert js.min() >= 0.0 and js.max() <= np.float32(LN2)
    if u_form in ("aligned", "loo") and G > 1:
        assert np.all(js[:, :2] <= 1e-6)  # identical prefixes: u = 0 (literal and pooled need not be 0)
    if G > 1 and u_form != "aligned":  # the readings differ from the default where rollouts diverge
        aligned = ref_readings(logits, tokens, valid, G, temp, "aligned")["js"]
        assert np.abs(want["js"] - aligned).max() > 1e-3


def test_readings_hand_computed():
    """A hand-worked group: V = 2, G = 3, one position; rollout 2 has ended (valid 0);
    p0 = (1, 0), p1 = (0, 1), both sampled token 0."""
    big = 60.0  # softmax([big, 0]) = (1, 0) to float32 rounding
    logits = np.array([[[big, 0.0]], [[0.0, big]], [[0.0, big]]], np.float32)  # [3, 1, 2]
    tokens = np.array([[0], [0], [1]], np.int32)
    valid = np.array([[1.0], [1.0], [0.0]], np.float32)
    # JS((1,0) || (1/2,1/2)): m = (3/4, 1/4); 1/2 ln(1/(3/4)) + 1/2 [1/2 ln(2/3) + 1/2 ln 2]
    js_half = 0.5 * np.log(4 / 3) + 0.5 * (0.5 * np.log(2 / 3) + 0.5 * np.log(2.0))
    want = {
        "aligned": ([js_half, js_half], [0.5, 0.5]),  # Q = (1/2, 1/2); Q(o) = 1/2 for both tokens 0
        "loo": ([np.log(2.0), np.log(2.0)], [0.0, 1.0]),  # Q_0 = p1 (disjoint: ln 2), Q_1 = p0
        # literal: Q = (1/3, 1/3); m = (2/3, 1/6) for row 0: 1/2 ln(3/2) + 1/2 [1/3 ln(1/2) + 1/3 ln 2]
        "literal": ([0.5 * np.log(1.5), 0.5 * np.log(1.5)], [1 / 3, 1 / 3]),
        "pooled": ([js_half, js_half], [0.5, 0.5]),  # one position: the pool is the aligned mean
    }
    for form, (u, q) in want.items():
        st = stats_from_logits(jnp.asarray(logits), tokens, valid, group_size=3, compute=ALL_STATS, u_form=form)
        np.testing.assert_allclose(np.asarray(st.js)[:2, 0], u, atol=1e-6, err_msg=form)
        np.testing.assert_allclose(np.asarray(st.pbar_tok)[:2, 0], q, atol=1e-6, err_msg=form)
        assert np.asarray(st.js)[2, 0] == 0.0
    with pytest.raises(ValueError, match="u_form"):
        stats_from_logits(jnp.asarray(logits), tokens, valid, group_size=3, u_form="index")


def test_js_symmetric_bounded_zero_on_equal():
    rng = np.random.default_rng(0)
    for V in (7, 300):
        a = jax.nn.softmax(jnp.asarray(rng.standard_normal((20, V)) * 3, jnp.float32))
        b = jax.nn.softmax(jnp.asarray(rng.standard_normal((20, V)) * 3, jnp.float32))
        ab, ba = np.asarray(_js(a, b)), np.asarray(_js(b, a))
        np.testing.assert_allclose(ab, ba, atol=ATOL, rtol=RTOL)
        assert ab.min() > 1e-3 and ab.max() <= np.float32(LN2)
        assert np.all(np.asarray(_js(a, a)) == 0.0)
    # disjoint supports: exactly ln 2 (after the clip)
    a = jnp.array([[1.0, 0.0, 0.0]])
    b = jnp.array([[0.0, 0.5, 0.5]])
    np.testing.assert_allclose(np.asarray(_js(a, b)), [LN2], atol=ATOL, rtol=RTOL)


def test_no_nan_all_padding_all_neginf_rows():
    P, G, T, V = 2, 3, 4, 9
    logits = np.full((P * G, T, V), -np.inf, np.float32)  # padding positions may be all -inf
    valid = np.zeros((P * G, T), np.float32)
    logits[G, :2] = np.arange(V)  # one active rollout in the second group
    valid[G, :2] = 1
    tokens = np.zeros((P * G, T), np.int32)
    def f(lg):
        return jnp.sum(stats_from_logits(lg, tokens, valid, group_size=G).logp)

    got = stats_from_logits(jnp.asarray(logits), tokens, valid, group_size=G, compute=ALL_STATS)
    for x in got:
        assert np.all(np.isfinite(np.asarray(x)))
    assert np.all(np.asarray(got.js) == 0.0)  # alone at t
    for form in U_FORMS:  # every reading: finite and 0 at padding, also on all -inf padding rows
        st = stats_from_logits(jnp.asarray(logits), tokens, valid, group_size=G, compute=ALL_STATS, u_form=form)
        for x in st:
            assert np.all(np.isfinite(np.asarray(x))) and np.all(np.asarray(x)[valid == 0] == 0.0)
    g = jax.jit(jax.grad(f))(jnp.asarray(logits))
    assert np.all(np.isfinite(np.asarray(g)))
    # chunked path: an all-padding group, and G = 1
    h = np.random.default_rng(0).standard_normal((P * G, T, 5)).astype(np.float32)
    W = np.random.default_rng(1).standard_normal((5, V)).astype(np.float32)
    for gs, form in ((G, "aligned"), (1, "aligned"), (G, "loo"), (G, "literal"), (G, "pooled")):
        # compiled, as the train step runs it (op by op, the chunked path took most of this test's time)
        st = jax.jit(lambda x, gs=gs, form=form: stats_from_hidden(x, W, tokens, valid, group_size=gs, chunk=3,
                                                                   compute=ALL_STATS, u_form=form))(h)
        for x in st:
            assert np.all(np.isfinite(np.asarray(x))) and np.all(np.asarray(x)[valid == 0] == 0.0)
        if form in ("aligned", "loo"):  # alone at t: u = 0 (literal and pooled compare with other mass)
            assert np.all(np.asarray(st.js) == 0.0)
        gh = jax.jit(jax.grad(lambda x, gs=gs: jnp.sum(stats_from_hidden(x, W, tokens, valid, group_size=gs,
                                                                         chunk=3).logp)))(h)
        assert np.all(np.isfinite(np.asarray(gh))) and np.all(np.asarray(gh)[valid == 0] == 0.0)


def test_logits_path_gradient_matches_float64():
    rng = np.random.default_rng(1)
    P, G, T, V, temp = 2, 2, 4, 11, 0.8
    logits, tokens, valid = make_case(rng, P, G, T, V, "neginf")
    wts = rng.standard_normal((P * G, T)).astype(np.float32)
    def f(lg):
        return jnp.sum(stats_from_logits(lg, tokens, valid, group_size=G, temperature=temp).logp * wts)

    g = np.asarray(jax.jit(jax.grad(f))(jnp.asarray(logits)))
    _, p = ref_stats(logits, tokens, valid, G, temp)
    onehot = np.eye(V)[tokens]
    want = (wts * valid)[..., None] * (onehot - p) / temp
    want = np.where(valid[..., None] > 0, want, 0.0)
    assert np.all(np.isfinite(g))
    np.testing.assert_allclose(g, want, atol=ATOL, rtol=RTOL)


# ------------------------------------------------------------------------------------------------
# chunked path
# ------------------------------------------------------------------------------------------------
def _hidden_case(rng, P=2, G=3, T=7, D=16, V=97):
    hidden = rng.standard_normal((P * G, T, D)).astype(np.float32)
    h = hidden.reshape(P, G, T, D)
    h[:, :, :2] = h[:, :1, :2]
    W = (rng.standard_normal((D, V)) / np.sqrt(D) * 3).astype(np.float32)
    tokens = rng.integers(0, V, (P * G, T)).astype(np.int32)
    lengths = rng.integers(T // 2, T + 1, P * G)
    valid = (np.arange(T)[None] < lengths[:, None]).astype(np.float32)
    valid[0] = 1.0
    valid[-1] = 0.0  # an empty row
    return hidden, W, tokens, valid


@pytest.fixture(scope="module")
def dense_case():
    """One case, its dense statistics and the dense gradient of sum(logp * w) (computed once)."""
    rng = np.random.default_rng(123)
    hidden, W, tokens, valid = _hidden_case(rng)
    G, temp = 3, 0.9
    wts = rng.standard_normal(tokens.shape).astype(np.float32)

    def dense(h, w):
        lg = jnp.einsum("btd,dv->btv", h, w, precision="highest")
        return stats_from_logits(lg, tokens, valid, group_size=G, temperature=temp)

    a = jax.jit(dense)(hidden, W)
    ga = jax.jit(jax.grad(lambda h, w: jnp.sum(dense(h, w).logp * wts), argnums=(0, 1)))(hidden, W)
    return (hidden, W, tokens, valid, G, temp, wts), a, ga


@pytest.mark.parametrize("chunk", [1, 3, 4, 7, 32])
def test_hidden_equals_logits_values_and_gradient(chunk, dense_case):
    (hidden, W, tokens, valid, G, temp, wts), a, ga = dense_case

    def chunked(h, w):
        return stats_from_hidden(h, w, tokens, valid, group_size=G, temperature=temp, chunk=chunk)

    b = jax.jit(chunked)(hidden, W)
    for name in ("logp", "H1", "H2", "js"):
        assert_close(name, getattr(b, name), np.asarray(getattr(a, name), np.float64))
    assert np.asarray(a.js).max() > 0.05  # the groups do diverge
    gb = jax.jit(jax.grad(lambda h, w: jnp.sum(chunked(h, w).logp * wts), argnums=(0, 1)))(hidden, W)
    for x, y in zip(ga, gb):
        assert y.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), atol=ATOL, rtol=1e-5)


@pytest.mark.parametrize("chunk", [1, 3, 7, 32])
def test_one_pass_surrogate_equals_dense_values_and_gradient(chunk, dense_case):
    """stats_and_surrogate: the statistics of the dense path and grad(s) = grad(sum(wts * logp)),
    computed during the forward pass."""
    (hidden, W, tokens, valid, G, temp, wts), a, ga = dense_case

    def one_pass(h, w):
        return stats_and_surrogate(h, w, tokens, valid, wts, group_size=G, temperature=temp, chunk=chunk)

    swapped = lambda h, w: one_pass(h, w)[::-1]  # noqa: E731  (s, stats) for has_aux
    (s, b), gb = jax.jit(jax.value_and_grad(swapped, argnums=(0, 1), has_aux=True))(hidden, W)
    for name in ("logp", "H1", "H2", "js"):
        assert_close(name, getattr(b, name), np.asarray(getattr(a, name), np.float64))
    want_s = np.sum(np.asarray(a.logp, np.float64) * wts * valid)
    np.testing.assert_allclose(float(s), want_s, rtol=1e-5)
    for x, y in zip(ga, gb):
        assert y.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), atol=ATOL, rtol=1e-5)
    # the statistics are stop-gradient; a differentiated statistic gives zero, not a wrong gradient
    gz = jax.grad(lambda h: jnp.sum(one_pass(h, W)[0].H1))(hidden)
    assert np.all(np.asarray(gz) == 0.0)
    with pytest.raises(ValueError, match="g_logp"):
        stats_and_surrogate(hidden, W, tokens, valid, wts[:, :-1], group_size=G)


@pytest.mark.parametrize("u_form", ["loo", "literal", "pooled"])
def test_hidden_and_one_pass_readings_equal_logits(u_form, dense_case):
    """The chunked path and the one-pass head give the logits path's value of every reading (blocks
    of 3 positions: pooled's Q sums over blocks; loo and literal are per position)."""
    (hidden, W, tokens, valid, G, temp, wts), _, _ = dense_case
    lg = jnp.einsum("btd,dv->btv", hidden, W, precision="highest")
    a = stats_from_logits(lg, tokens, valid, group_size=G, temperature=temp, compute=ALL_STATS, u_form=u_form)
    b = stats_from_hidden(hidden, W, tokens, valid, group_size=G, temperature=temp, chunk=3, compute=ALL_STATS,
                          u_form=u_form)
    c, _ = stats_and_surrogate(hidden, W, tokens, valid, wts, group_size=G, temperature=temp, chunk=3,
                               compute=ALL_STATS, u_form=u_form)
    for name in ALL_STATS:
        want = np.asarray(getattr(a, name), np.float64)
        assert_close(f"hidden {name}", getattr(b, name), want)
        assert_close(f"one-pass {name}", getattr(c, name), want)


def test_block_size_evens_out_blocks():
    from ict_jax.rl.token_stats import block_size

    assert [block_size(96, c) for c in (16, 32, 64, 128, 1)] == [16, 32, 48, 96, 1]
    assert block_size(100, 64) == 50 and block_size(7, 3) == 3 and block_size(1024, 64) == 64


def test_statics_travel_as_one_hashable_plan(monkeypatch):
    """The block functions and custom VJPs get their statics as ONE frozen StatsPlan: equal settings give
    equal (hashable) plans, so a second call with the same settings reuses the traced functions."""
    import dataclasses

    from ict_jax.rl import token_stats as ts

    a = ts.StatsPlan(4, 0.7, 16, frozenset({"logp", "js"}), "loo")
    assert a == ts.StatsPlan(4, 0.7, 16, frozenset({"js", "logp"}), "loo") and hash(a) == hash(a.wanting({"logp", "js"}))
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.chunk = 8  # noqa
    seen = []
    real = ts._scan_stats
    monkeypatch.setattr(ts, "_scan_stats", lambda *args: seen.append(args[4:]) or real(*args))
    rng = np.random.default_rng(0)
    h, W = rng.normal(size=(4, 5, 3)).astype(np.float32), rng.normal(size=(3, 7)).astype(np.float32)
    stats_from_hidden(h, W, rng.integers(0, 7, (4, 5)), np.ones((4, 5)), group_size=2, temperature=0.5, chunk=3,
                      u_form="literal")
    assert seen == [(ts.StatsPlan(2, 0.5, 3, frozenset(ts.DEFAULT_COMPUTE), "literal"),)]


def test_hidden_compute_subset_and_stop_gradient():
    rng = np.random.default_rng(5)
    hidden, W, tokens, valid = _hidden_case(rng)
    full = stats_from_hidden(hidden, W, tokens, valid, group_size=3, chunk=4)
    only = stats_from_hidden(hidden, W, tokens, valid, group_size=3, chunk=4, compute=("logp",))
    assert only.H1 is None and only.H2 is None and only.js is None
    np.testing.assert_array_equal(np.asarray(only.logp), np.asarray(full.logp))
    nologp = stats_from_hidden(hidden, W, tokens, valid, group_size=3, chunk=4, compute=("js",))
    assert nologp.logp is None
    np.testing.assert_array_equal(np.asarray(nologp.js), np.asarray(full.js))
    # H1, H2, js carry no gradient
    g = jax.grad(lambda h: jnp.sum(stats_from_hidden(h, W, tokens, valid, group_size=3, chunk=4).H1))(hidden)
    assert np.all(np.asarray(g) == 0.0)
    with pytest.raises(ValueError, match="group_size"):
        stats_from_hidden(hidden, W, tokens, valid, group_size=4, chunk=4)
    with pytest.raises(ValueError, match="compute"):
        stats_from_hidden(hidden, W, tokens, valid, group_size=3, chunk=4, compute=("H3",))


def test_hidden_bfloat16_inputs():
    rng = np.random.default_rng(6)
    hidden, W, tokens, valid = _hidden_case(rng)
    hb, Wb = jnp.asarray(hidden, jnp.bfloat16), jnp.asarray(W, jnp.bfloat16)
    got = stats_from_hidden(hb, Wb, tokens, valid, group_size=3, chunk=3)
    lg = jnp.einsum("btd,dv->btv", hb.astype(jnp.float32), Wb.astype(jnp.float32), precision="highest")
    want = stats_from_logits(lg, tokens, valid, group_size=3)
    for name in ("logp", "H1", "H2", "js"):
        assert getattr(got, name).dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)),
                                   atol=ATOL, rtol=1e-5, err_msg=name)
    gh, gw = jax.grad(lambda h, w: jnp.sum(stats_from_hidden(h, w, tokens, valid, group_size=3, chunk=3).logp),
                      argnums=(0, 1))(hb, Wb)
    assert gh.dtype == jnp.bfloat16 and gw.dtype == jnp.bfloat16
    assert np.all(np.isfinite(np.asarray(gh, np.float32)))


def test_chunked_never_holds_BTV():
    """XLA's temp memory for value_and_grad stays well below one float32 [B, T, V] array."""
    B, T, D, V, G, chunk = 4, 256, 16, 4096, 2, 8
    btv = B * T * V * 4
    args = (jax.ShapeDtypeStruct((B, T, D), jnp.float32), jax.ShapeDtypeStruct((D, V), jnp.float32),
            jax.ShapeDtypeStruct((B, T), jnp.int32), jax.ShapeDtypeStruct((B, T), jnp.float32))

    def loss(h, w, tok, val, dense):
        if dense:
            s = stats_from_logits(jnp.einsum("btd,dv->btv", h, w), tok, val, group_size=G)
        else:
            s = stats_from_hidden(h, w, tok, val, group_size=G, chunk=chunk)
        return jnp.sum(jnp.where(s.js > 0.1, s.logp, 0.0))

    def temp(dense):
        f = jax.jit(jax.value_and_grad(lambda *a: loss(*a, dense), argnums=(0, 1)))
        return f.lower(*args).compile().memory_analysis().temp_size_in_bytes

    t_dense, t_chunk = temp(True), temp(False)
    assert t_dense >= btv  # the comparison is meaningful
    assert t_chunk < btv / 4, (t_chunk, t_dense, btv)
