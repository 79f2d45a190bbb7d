"""One decoding step's draw: a token per row from the next-token logits (docs/sampler.md "Sampling").

:func:`sample_token` is an exact inverse-CDF draw with ONE uniform per row: with ``top_p == 1`` and
``top_k == 0`` it is sort-free (softmax, cumulative sum, one comparison pass), which costs a few ms a step
at V = 152k where ``jax.random.categorical`` (one Gumbel per vocabulary entry) costs ~166 ms
(docs/architecture.md). Truncation uses ``lax.top_k``; top-p without top-k looks among the
:data:`TOP_P_CANDIDATES` largest logits first and sorts the whole vocabulary only for a batch where they
hold less than ``top_p`` of some row's probability (a full sort of 64 rows x 152k costs seconds a decoded
token on a CPU; docs/benchmarks.md).

``logp`` convention: the log-probability of the drawn token under ``softmax(logits / temperature)`` over
the FULL vocabulary, i.e. BEFORE top-k/top-p truncation (the distribution docs/method.md §1 recomputes with
``stats.temperature`` = the rollout temperature). Greedy rows use the same convention.

Pure and shape-polymorphic in the batch: the generation program (:mod:`ict_jax.sampling.sampler`) calls it
once per decoded token with the uniforms it drew for the whole batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from ict_jax.config import RolloutSection

_ROLLOUT = RolloutSection()  # the config tree's defaults (one source per default)
_BLOCK = 1024  # vocabulary block of the two-level inverse CDF
#: top-p without top-k: the largest logits looked at first. When they hold ``top_p`` of every row's
#: probability the kept tokens are among them, so the draw is the same as over the whole sorted vocabulary;
#: otherwise that step sorts the whole vocabulary.
TOP_P_CANDIDATES = 256


def _pick(cdf: Float[Array, "B K"], t: Float[Array, " B"]) -> Int[Array, " B"]:
    """First index with ``cdf >= t`` (clamped to the last index)."""
    return jnp.minimum(jnp.sum(cdf < t[:, None], axis=-1, dtype=jnp.int32), cdf.shape[-1] - 1)


def _inverse_cdf(logw: Float[Array, "B K"], u: Float[Array, " B"]
                 ) -> tuple[Int[Array, " B"], Float[Array, " B"], Float[Array, " B"]]:
    """Exact inverse-CDF draw from the unnormalised weights ``exp(logw)`` (``-inf``: weight 0; keep
    ``max(logw)`` near 0) with one uniform per row:
    index i with ``cdf[i-1] < (1 - u) * total <= cdf[i]``. ``1 - u`` lies in (0, 1], so a zero-weight
    entry is never picked (its cdf step is empty). Returns ``(index, total, weight of index)``.

    Over more than ``_BLOCK`` entries the cumulative sum is two-level (sums of 1024-entry blocks, then
    the chosen block): a full-length ``cumsum`` over V = 152k costs ~10x more on CPU (docs/architecture.md)."""
    B, K = logw.shape
    if K <= _BLOCK:
        weights = jnp.exp(logw)
        cdf = jnp.cumsum(weights, axis=-1)
        total = cdf[:, -1]
        idx = _pick(cdf, (1.0 - u) * total)
        # float rounding could in principle land on a zero-weight entry: fall back to the mode there
        idx = jnp.where(jnp.take_along_axis(weights, idx[:, None], axis=-1)[:, 0] > 0, idx,
                        jnp.argmax(weights, axis=-1).astype(jnp.int32))
        return idx, total, jnp.take_along_axis(weights, idx[:, None], axis=-1)[:, 0]
    nb = -(-K // _BLOCK)
    # pad the log-weights (not the weights): the pad fuses into the exp instead of copying [B, V]
    w = jnp.exp(jnp.pad(logw, ((0, 0), (0, nb * _BLOCK - K)), constant_values=-jnp.inf)).reshape(B, nb, _BLOCK)
    bsum = jnp.sum(w, axis=-1)  # [B, nb]
    bcdf = jnp.cumsum(bsum, axis=-1)
    total = bcdf[:, -1]
    t = (1.0 - u) * total
    b = _pick(bcdf, t)
    start = jnp.take_along_axis(bcdf, b[:, None], -1)[:, 0] - jnp.take_along_axis(bsum, b[:, None], -1)[:, 0]
    blk = jnp.take_along_axis(w, b[:, None, None], axis=1)[:, 0]  # [B, _BLOCK]
    j = _pick(jnp.cumsum(blk, axis=-1), t - start)
    ok = jnp.take_along_axis(blk, j[:, None], axis=-1)[:, 0] > 0
    j = jnp.where(ok, j, jnp.argmax(blk, axis=-1).astype(jnp.int32))
    return b * _BLOCK + j, total, jnp.take_along_axis(blk, j[:, None], axis=-1)[:, 0]


def _draw_sorted(vals: Float[Array, "B K"], ids: Int[Array, "B K"], u: Float[Array, " B"], top_p: float,
                 denominator: Float[Array, " B"] | None = None) -> Int[Array, " B"]:
    """One token per row from the ``K`` largest logits ``vals`` (descending) and their ``ids``: with
    ``top_p < 1`` only those whose preceding cumulative probability is ``< top_p`` (probabilities
    ``exp(vals - max) / denominator``; None: normalised over these K), by inverse CDF."""
    # the max, not vals[:, :1] (the same number): XLA turns a top_k whose values are sliced again into a sort
    # of the whole vocabulary
    logw = vals - jnp.max(vals, axis=-1, keepdims=True)
    if top_p < 1.0:
        p = jax.nn.softmax(logw, axis=-1) if denominator is None else jnp.exp(logw) / denominator[:, None]
        before = jnp.cumsum(p, axis=-1) - p
        logw = jnp.where(before < jnp.float32(top_p), logw, -jnp.inf)
    j = _inverse_cdf(logw, u)[0]
    return jnp.take_along_axis(ids, j[:, None], axis=-1)[:, 0].astype(jnp.int32)


def _top_p_token(z: Float[Array, "B V"], u: Float[Array, " B"], top_p: float, candidates: int,
                 total: Float[Array, " B"]) -> Int[Array, " B"]:
    """Top-p without top-k (``total``: each row's ``sum(exp(z - max))``): among the ``candidates`` largest
    logits when they hold ``top_p`` of every row's probability, else over the whole sorted vocabulary."""
    V = z.shape[-1]
    if candidates >= V:
        return _draw_sorted(*jax.lax.top_k(z, V), u, top_p)
    vals, ids = jax.lax.top_k(z, candidates)
    held = jnp.sum(jnp.exp(vals - jnp.max(vals, axis=-1, keepdims=True)), axis=-1) / total
    return jax.lax.cond(jnp.all(held >= jnp.float32(top_p)),
                        lambda: _draw_sorted(vals, ids, u, top_p, total),
                        lambda: _draw_sorted(*jax.lax.top_k(z, V), u, top_p))


def sample_token(logits: Float[Array, "B V"], u: Float[Array, " B"], *, temperature: float = _ROLLOUT.temperature,
                 top_p: float = _ROLLOUT.top_p, top_k: int = _ROLLOUT.top_k, greedy: bool = False,
                 top_p_candidates: int = TOP_P_CANDIDATES) -> tuple[Int[Array, " B"], Float[Array, " B"]]:
    """Draw one token per row from ``softmax(logits / temperature)`` truncated by top-k then top-p.

    - top-k (``top_k > 0``): keep the k largest logits (ties: lower id first).
    - top-p (``top_p < 1``): over the (top-k-kept) distribution renormalised, keep the tokens of the
      descending order whose preceding cumulative probability is ``< top_p`` (the first always stays).
    - draw by inverse CDF with the row's uniform ``u`` in [0, 1) over the kept, renormalised
      probabilities. ``greedy`` takes the argmax and ignores ``u``.

    Returns ``(token [B] int32, logp [B] float32)`` with ``logp = log softmax(logits / T)[token]`` over the
    full vocabulary (before truncation). ``temperature`` must be > 0. ``top_p_candidates``: how many of the
    largest logits top-p without top-k looks among first (:data:`TOP_P_CANDIDATES`); the distribution is
    the same whatever it is, only the cost and the float rounding of the probabilities change.
    """
    z = logits.astype(jnp.float32)
    if temperature != 1.0:
        z = z / jnp.float32(temperature)
    m = jnp.max(z, axis=-1)
    if not greedy and top_k == 0 and top_p >= 1.0:  # sort-free
        tok, total, w = _inverse_cdf(z - m[:, None], u)
        # log of the chosen exp(z - m) (error ~1 ulp): on CPU, gathering z[tok] from the [B, V] logits
        # here costs more than the whole draw
        return tok, jnp.log(w) - jnp.log(total)
    total = jnp.sum(jnp.exp(z - m[:, None]), axis=-1)
    if greedy:
        tok = jnp.argmax(z, axis=-1).astype(jnp.int32)
    elif top_k == 0:  # top-p alone: among the largest logits first (no sort of the whole vocabulary)
        tok = _top_p_token(z, u, top_p, top_p_candidates, total)
    else:
        tok = _draw_sorted(*jax.lax.top_k(z, min(top_k, z.shape[-1])), u, top_p)
    logp = jnp.take_along_axis(z, tok[:, None], axis=-1)[:, 0] - m - jnp.log(total)
    return tok, logp
