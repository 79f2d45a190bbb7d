"""The per-token draw (ict_jax/sampling/draw.py) on controlled distributions against float64 NumPy: the
inverse CDF, temperature, top-k and top-p (among the largest logits and over the whole sorted vocabulary),
and the log-probability before truncation."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ict_jax.sampling.draw import _inverse_cdf, sample_token


def test_inverse_cdf_is_exact():
    w = jnp.array([[0.0, 1.0, 0.0, 2.0, 1.0, 0.0]], jnp.float32)
    us = np.linspace(0.0, 1.0, 401, endpoint=False, dtype=np.float32)
    got = np.array([int(_inverse_cdf(jnp.log(w), jnp.array([u]))[0][0]) for u in us])
    cdf = np.cumsum(np.asarray(w[0], np.float64)) / 4.0
    want = np.searchsorted(cdf, 1.0 - us.astype(np.float64), side="left")
    np.testing.assert_array_equal(got, want)
    assert set(got) == {1, 3, 4}  # zero-weight ids never, even at u = 0


CASES = [  # (temperature, top_p, top_k) -> the kept set and renormalised probabilities in float64
    (1.0, 1.0, 0), (0.5, 1.0, 0), (2.0, 1.0, 0), (1.0, 1.0, 3), (1.0, 0.7, 0), (1.5, 0.6, 4),
]


def _expected(logits, temperature, top_p, top_k):
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    keep = np.zeros_like(p, bool)
    keep[order[:top_k] if top_k else order] = True
    q = np.where(keep, p, 0.0)
    q /= q.sum()
    qs = q[order]
    before = np.cumsum(qs) - qs
    keep2 = np.zeros_like(p, bool)
    keep2[order[(before < top_p) & (qs > 0)]] = True
    out = np.where(keep2, q, 0.0)
    return out / out.sum(), np.log(p)


@pytest.mark.parametrize("temperature,top_p,top_k,candidates",
                         [(*c, 256) for c in CASES] + [(1.0, 0.7, 0, 3), (1.0, 0.9, 0, 3)])
def test_sample_token_distribution(temperature, top_p, top_k, candidates):
    """Candidates 3: top-p 0.7 is decided among the 3 largest (they hold 0.75), top-p 0.9 is not (the whole
    vocabulary sorted)."""
    logits = np.log(np.array([0.30, 0.05, 0.20, 0.01, 0.25, 0.15, 0.04], np.float32)) + 3.0
    n = 40_000
    want, logp_ref = _expected(logits, temperature, top_p, top_k)
    u = jax.random.uniform(jax.random.key(0), (n,))
    tok, logp = sample_token(jnp.broadcast_to(jnp.asarray(logits), (n, len(logits))), u, temperature=temperature,
                             top_p=top_p, top_k=top_k, top_p_candidates=candidates)
    tok, logp = np.asarray(tok), np.asarray(logp)
    assert set(np.unique(tok)) <= set(np.flatnonzero(want > 0))  # never outside the kept set
    freq = np.bincount(tok, minlength=len(logits)) / n
    sd = np.sqrt(want * (1 - want) / n)
    assert (np.abs(freq - want) <= 5 * sd + 1e-12).all(), (freq, want)
    np.testing.assert_allclose(logp, logp_ref[tok], atol=1e-6, rtol=0)  # before truncation


def _top_p_reference(logits, u, temperature, top_p):
    """Each row's token in float64 (the full vocabulary sorted, ties to the lower id; kept while the preceding
    cumulative probability is < top_p; inverse CDF at 1 - u) and how close 1 - u lies to a step of the CDF."""
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    toks, margins = [], []
    for row, ur in zip(p, u.astype(np.float64)):
        order = np.argsort(-row, kind="stable")
        q = row[order]
        kept = q[(np.cumsum(q) - q) < top_p]
        cdf = np.cumsum(kept) / kept.sum()
        i = int(np.searchsorted(cdf, 1.0 - ur, side="left"))
        toks.append(order[i])
        margins.append(np.min(np.abs(cdf - (1.0 - ur))))
    return np.array(toks), np.array(margins)


def test_top_p_among_the_largest_logits_draws_the_tokens_of_the_whole_sorted_vocabulary():
    """Peaked rows (a language model's next token at T 0.6): top-p 0.95 is decided among the 64 largest of
    3,000 logits, and each row's token is the float64 reference's for the same uniform, as it is with the
    whole vocabulary sorted. Flat rows, where the 64 largest hold too little: the whole vocabulary is
    sorted, the same tokens as without candidates, the reference's wherever rounding cannot decide."""
    rng = np.random.default_rng(0)
    B, V = 512, 3000
    peaked = rng.normal(size=(B, V)).astype(np.float32)
    peaked[np.arange(B)[:, None], rng.integers(0, V, (B, 4))] += 9.0
    flat = rng.normal(size=(B, V)).astype(np.float32) * 0.3
    u = rng.uniform(size=B).astype(np.float32)
    for logits, fast, tol in ((peaked, True, 1e-5), (flat, False, 1e-4)):
        z = logits.astype(np.float64) / 0.6
        p = np.exp(z - z.max(-1, keepdims=True))
        held = np.sort(p / p.sum(-1, keepdims=True), -1)[:, -64:].sum(-1)
        assert (held >= 0.95).all() == fast and (held >= 0.95).any() == fast  # the path this case takes
        want, margin = _top_p_reference(logits, u, 0.6, 0.95)
        clear = margin > tol  # float32 rounding may move a uniform across a step closer than this
        assert clear.mean() > (0.99 if fast else 0.3)
        toks = [np.asarray(sample_token(jnp.asarray(logits), jnp.asarray(u), temperature=0.6, top_p=0.95,
                                        top_p_candidates=cand)[0]) for cand in (64, V)]
        for tok in toks:
            np.testing.assert_array_equal(tok[clear], want[clear])
        if not fast:
            np.testing.assert_array_equal(toks[0], toks[1])


def test_top_p_among_the_largest_logits_sorts_the_vocabulary_only_when_they_hold_too_little():
    """The compiled draw holds one sort of the whole vocabulary, in the branch taken when the candidates
    hold less than top_p: XLA turned a top_k whose values were sliced again into a second, unconditional
    one (3 s a decoded token for 64 rows x 152k on a CPU)."""
    B, V = 8, 5000
    f = jax.jit(lambda z, u: sample_token(z, u, temperature=0.6, top_p=0.95, top_p_candidates=64))
    text = f.lower(jnp.zeros((B, V)), jnp.zeros((B,))).compile().as_text()
    assert len(re.findall(rf"= \(f32\[{B},{V}\][^=]*\) sort\(", text)) == 1, text


def test_temperature_flattens_and_sharpens():
    logits = jnp.array([[2.0, 1.0, 0.0]], jnp.float32)
    u = jax.random.uniform(jax.random.key(1), (30_000,))
    freqs = {}
    for t in (0.25, 1.0, 4.0):
        tok, _ = sample_token(jnp.broadcast_to(logits, (30_000, 3)), u, temperature=t)
        freqs[t] = np.bincount(np.asarray(tok), minlength=3) / 30_000
        want = np.exp(np.array([2.0, 1.0, 0.0]) / t)
        want /= want.sum()
        np.testing.assert_allclose(freqs[t], want, atol=5 * np.sqrt(0.25 / 30_000))
    assert freqs[0.25][0] > freqs[1.0][0] > freqs[4.0][0]
