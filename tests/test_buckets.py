"""Pay for the tokens generated, not for max_new_tokens.

The train step cuts the response axis to the longest response of the batch rounded up to a bucket and
must give the uncut step's gradients and metrics (every method, micro-batches, the 8-device mesh); one
program per bucket, compiled on first use. The sampler decodes in phases of a growing KV cache and must
give the one-phase sampler's tokens and log-probs.

The pure pieces (the ladder, the extent and the cut, the loss's T) run in the default suite; every test
that compiles a step or a sampler costs seconds and is ``e2e``. The slow method x loss_agg x micro-batches
matrix runs a pairwise covering design (tests/covering.py): every level of each factor and every pair of
levels of two factors, 15 cases where the full product's 30 would take about 7 minutes of CI's slow stage."""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import ict_jax
from ict_jax.buckets import bucket_for, make_buckets, response_buckets
from ict_jax.config import LossSection
from ict_jax.rl.batch import RolloutBatch, response_extent, trim_response
from ict_jax.rl.losses import policy_loss
from ict_jax.rl.state import init_train_state
from ict_jax.rl.train_step import bucket_of, make_train_step

from covering import covering  # tests/ is on sys.path under pytest
from rl.test_train_step import (  # tests/ is on sys.path (tests/rl: a namespace package)
    LP,
    LR,
    MODEL,
    _batch,
    _config,
    _grad_recorder,
)

W = 16  # the uncut response width (max_new_tokens) of the wide batch; its responses are 2..LR = 6 long
MIN_BUCKET = 4  # buckets (4, 8, 16): the wide batch runs at 8


# ------------------------------------------------------------------------------------------------
# The ladder, the extent, the cut
# ------------------------------------------------------------------------------------------------
def test_response_buckets_are_the_prompt_ladder_up_to_max_new_tokens():
    assert response_buckets(1024, 16) == (16, 32, 64, 128, 256, 512, 1024) == make_buckets(1024, 16)
    assert response_buckets(100, 16) == (16, 32, 64, 100)
    assert response_buckets(6, 16) == (6,)  # the demo: max_new_tokens below the smallest bucket
    assert response_buckets(128, None) == (128,)  # off: one length
    assert bucket_for(17, response_buckets(128, 16)) == 32 and bucket_for(1, (16, 32)) == 16
    with pytest.raises(ValueError, match="rollout.min_response_bucket: 0 must be at least 1"):
        response_buckets(128, 0)


def _wide(batch: RolloutBatch, width: int = W) -> RolloutBatch:
    """``batch`` with ``width - Lr`` more response columns of padding (pad id 0, masks 0): the batch
    the trainer builds at max_new_tokens = ``width`` from the same responses."""
    extra = width - batch.response_len

    def pad(x: jax.Array) -> jax.Array:
        return jnp.asarray(np.pad(np.asarray(x), ((0, 0), (0, extra))))

    return batch.replace(tokens=pad(batch.tokens), attention_mask=pad(batch.attention_mask),
                         response_valid=pad(batch.response_valid), sampler_logp=pad(batch.sampler_logp))


@functools.cache
def _wide_batch() -> RolloutBatch:
    return _wide(_batch())


def test_extent_and_trim_keep_every_token_that_counts(devices8):
    b = _wide_batch()
    host = jax.tree.map(np.asarray, b)
    lengths = host.response_valid.sum(1)
    assert response_extent(host) == int(lengths.max()) == LR
    # filler rows of dynamic sampling (row_valid 0) count nowhere: their responses do not set the extent
    longest = lengths == lengths.max()
    filler = host.replace(row_valid=np.where(longest, 0.0, host.row_valid))
    assert response_extent(filler) == int(lengths[~longest].max()) < LR
    # device arrays, here sharded over 8 devices: reduced on the devices, one replicated scalar back (one
    # compile for both batches: same shapes and shardings)
    mesh = ict_jax.make_mesh(2, 2, 2)
    assert response_extent(ict_jax.sharding.shard_batch(host, mesh)) == LR
    assert response_extent(ict_jax.sharding.shard_batch(filler, mesh)) == int(lengths[~longest].max())

    b = host  # the cut is static slicing, the same on host and device arrays and under jit (the step's)
    t = trim_response(b, 8)
    assert t.tokens.shape == (b.tokens.shape[0], LP + 8) and t.response_valid.shape == (b.tokens.shape[0], 8)
    np.testing.assert_array_equal(np.asarray(t.tokens), np.asarray(b.tokens)[:, :LP + 8])
    np.testing.assert_array_equal(np.asarray(t.attention_mask), np.asarray(b.attention_mask)[:, :LP + 8])
    assert float(t.response_valid.sum()) == float(b.response_valid.sum())  # only padding went
    np.testing.assert_array_equal(np.asarray(t.rewards), np.asarray(b.rewards))
    assert trim_response(b, W) is b
    with pytest.raises(ValueError, match="response length 17: a batch of 16 response positions keeps 1..16"):
        trim_response(b, 17)


@pytest.mark.parametrize("loss_agg", ["seq-mean-token-sum-norm"] + [pytest.param(a, marks=pytest.mark.e2e) for a in
                                                                     ("seq-mean-token-mean", "token-mean")])
def test_loss_of_the_cut_batch_is_the_uncut_loss(loss_agg):
    """Dr.GRPO's T is max_new_tokens: the step passes the uncut width, not the cut axis's length."""
    rng = np.random.default_rng(1)
    B, T, cut = 6, 12, 5
    valid = np.zeros((B, T), bool)
    for i, n in enumerate(rng.integers(1, cut + 1, B)):
        valid[i, :n] = True
    mask = valid & (rng.random((B, T)) < 0.6)
    lp, lp_old, lp_ref = (jnp.asarray(np.where(valid, -rng.random((B, T)), 0.0), jnp.float32) for _ in range(3))
    adv = jnp.asarray(rng.normal(size=B), jnp.float32)
    cfg = LossSection(loss_agg=loss_agg, kl_coef=0.1)

    @functools.partial(jax.jit, static_argnames="max_new_tokens")
    def loss(lp, lp_old, lp_ref, valid, mask, max_new_tokens=None):
        return policy_loss(lp, lp_old, lp_ref, adv, valid, mask, config=cfg, max_new_tokens=max_new_tokens)

    full, mf = loss(lp, lp_old, lp_ref, valid, mask)
    c = slice(0, cut)
    short, ms = loss(lp[:, c], lp_old[:, c], lp_ref[:, c], valid[:, c], mask[:, c], max_new_tokens=T)
    np.testing.assert_allclose(float(short), float(full), rtol=1e-6, atol=0)
    for k in mf:
        np.testing.assert_allclose(float(ms[k]), float(mf[k]), rtol=1e-6, atol=0, err_msg=k)
    if loss_agg == "seq-mean-token-sum-norm":  # without the uncut width it would divide by the cut length
        wrong, _ = loss(lp[:, c], lp_old[:, c], lp_ref[:, c], valid[:, c], mask[:, c])
        np.testing.assert_allclose(float(wrong), float(full) * T / cut, rtol=1e-6)


# ------------------------------------------------------------------------------------------------
# The step: bucketed equals uncut
# ------------------------------------------------------------------------------------------------
def _cfg(method: str, agg: str, micro: int, *extra: str):
    return _config(method, agg, micro, f"rollout.max_new_tokens={W}", f"rollout.min_response_bucket={MIN_BUCKET}",
                   *extra)


EMBED_SCALE = 5.0  # sharpens the tiny model's next-token distributions (see _sharp_model)


def _sharp_model(mesh=None):
    """The tiny model with its tied embedding scaled by EMBED_SCALE. At the 0.02 init its next-token
    distributions are near uniform: the wide batch's 67 valid H1 lie in 5.520..5.532, neighbours one
    float32 ulp (4.8e-7) apart, so a one-ulp difference between the cut and the uncut program makes or
    breaks a tie at the cut and ``mask/tie_selected_frac`` (a count of exact ties) tests rounding, not the
    cut. Scaled by 5, H1 spans 1.08..4.30 with neighbours at least 1.3e-4 (about 270 ulps) apart."""
    model = ict_jax.init_model(MODEL, seed=1, mesh=mesh)
    assert MODEL.tie_word_embeddings
    model.embed.value = model.embed.value * EMBED_SCALE
    return model


def _run(cfg, response_len, mesh=None):
    """(exact gradient, metrics) of one step on the wide batch at ``response_len`` (None: the bucket
    the step picks), with :func:`_sharp_model`."""
    tx = _grad_recorder()
    state = init_train_state(cfg, _sharp_model(mesh), tx=tx)
    ref = jax.tree.map(lambda a: a * 1.01, jax.tree.map(jnp.copy, state.params)) if cfg.rl.loss.kl_coef > 0 else None
    step = make_train_step(cfg, mesh, tx=tx)
    batch = _wide_batch() if mesh is None else ict_jax.sharding.shard_batch(_wide_batch(), mesh)
    new, metrics = step(state, batch, ref, response_len=response_len)
    return jax.tree.map(np.asarray, new.opt_state), {k: float(v) for k, v in metrics.items()}


def _assert_same_step(cut, full, bucket):
    (g_cut, m_cut), (g_full, m_full) = cut, full
    assert m_cut.pop("train/response_len") == bucket and m_full.pop("train/response_len") == W
    assert max(np.abs(x).max() for x in jax.tree.leaves(g_full)) > 1e-4  # a real gradient
    chex.assert_trees_all_close(g_cut, g_full, rtol=2e-5, atol=1e-7)
    assert set(m_cut) == set(m_full)
    assert m_cut["mask/selected_frac"] == m_full["mask/selected_frac"]  # the same mask, token for token
    for k, v in m_full.items():
        np.testing.assert_allclose(m_cut[k], v, rtol=1e-5, atol=1e-7, err_msg=k)


# every method, one aggregation each (Dr.GRPO's sum-norm with entropy), micro-batches (4 of 4 rows, and
# 2 mini-batches for random's per-mini-batch draw); the slow covering design below crosses them pairwise
CASES = [("ict", "seq-mean-token-mean", 1, ()), ("entropy", "seq-mean-token-sum-norm", 4, ()),
         ("stapo", "token-mean", 4, ()), ("dense", "token-mean", 1, ("rl.loss.kl_coef=0",)),
         ("random", "seq-mean-token-mean", 2, ("train.mini_batches=2",)), ("frequent", "token-mean", 1, ())]


@pytest.mark.e2e
@pytest.mark.parametrize("method, agg, micro, extra", CASES)
def test_bucketed_step_equals_the_uncut_step(method, agg, micro, extra):
    cfg = _cfg(method, agg, micro, *extra)
    assert bucket_of(make_train_step(cfg).plan, _wide_batch()) == 8
    _assert_same_step(_run(cfg, None), _run(cfg, W), bucket=8)


# every (method, agg), (method, micro) and (agg, micro) pair at least once (covering: 15 cases, not the
# product's 30, for CI time)
@pytest.mark.slow
@pytest.mark.parametrize("method, agg, micro", covering(["dense", "ict", "entropy", "stapo", "random"],
                                                        ["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"],
                                                        [1, 4]))
def test_bucketed_step_covering(method, agg, micro):
    cfg = _cfg(method, agg, micro)
    _assert_same_step(_run(cfg, None), _run(cfg, W), bucket=8)


@pytest.mark.e2e
def test_bucketed_step_on_eight_devices_equals_one_uncut(devices8):
    cfg = _cfg("ict", "seq-mean-token-mean", 2)
    _assert_same_step(_run(cfg, None, ict_jax.make_mesh(2, 2, 2)), _run(cfg, W), bucket=8)


@pytest.mark.e2e
def test_one_program_per_bucket_compiled_on_first_use():
    """Batches whose longest responses are 3, 6, 10 and 16 long run at buckets 4, 8, 16, 16: three
    programs, each compiled once; the same lengths again compile nothing."""
    cfg = _cfg("ict", "seq-mean-token-mean", 1, "rl.loss.kl_coef=0")
    step = make_train_step(cfg)
    state = init_train_state(cfg, ict_jax.init_model(MODEL, seed=1))
    wide = _wide_batch()

    def longest(n):  # row 0 answers n tokens, every other row at most 3
        v = np.zeros(wide.response_valid.shape, np.float32)
        v[:, :3] = 1.0
        v[0, :n] = 1.0
        return wide.replace(response_valid=jnp.asarray(v))

    seen = []
    for _ in range(2):
        for n in (3, 6, 10, 16):
            state, m = step(state, longest(n))
            seen.append(float(m["train/response_len"]))
    assert seen == [4, 8, 16, 16] * 2
    assert sorted(k[-1] for k in step.jitted) == [4, 8, 16]
    assert [fn._cache_size() for fn in step.jitted.values()] == [1, 1, 1]
    # off: every batch at its full width, one program
    off = make_train_step(_cfg("ict", "seq-mean-token-mean", 1, "rl.loss.kl_coef=0", "rollout.min_response_bucket=null"))
    assert bucket_of(off.plan, longest(3)) == W


# ------------------------------------------------------------------------------------------------
# The sampler: phases of a growing cache give the one-phase tokens and log-probs
# ------------------------------------------------------------------------------------------------
N, G = 12, 2


@pytest.fixture(scope="module")
def sampler_model():
    from sampling.test_sampler import _sharpen  # the sampler tests' peaked random model (tests/sampling)

    return _sharpen(ict_jax.init_model(ict_jax.ModelConfig.tiny(compute_dtype="float32"), seed=0))


@pytest.fixture(scope="module")
def sampler_prompts():
    ids = np.asarray(jax.random.randint(jax.random.key(7), (4, 6), 1, 256), np.int32)
    mask = np.zeros((4, 6), np.int32)
    for p, n in enumerate([6, 3, 5, 1]):
        mask[p, 6 - n:] = 1
    return np.where(mask > 0, ids, 0).astype(np.int32), mask


def _gen(model, prompts, min_bucket, **kw):
    kw = {"num_samples": G, "max_new_tokens": N, "temperature": 0.9, "eos_ids": tuple(range(0, 256, 16)), **kw}
    return jax.tree.map(np.asarray, ict_jax.generate(model, *prompts, jax.random.key(3),
                                                     min_response_bucket=min_bucket, **kw))


@pytest.mark.e2e
@pytest.mark.parametrize("kw", [{}, {"greedy": True, "eos_ids": ()}, {"unroll_layers": False}])
def test_decode_phases_give_the_one_phase_rollout(sampler_model, sampler_prompts, kw):
    """Phases of 2, 4, 8 and 12 decode steps (cache windows Lp + 1, 3, 7, 11; the unrolled decode's
    chunks, the scan decode's windows of one cache) vs one phase over the whole cache: the same tokens,
    validity and truncation, log-probs to float rounding. The greedy case has no EOS: every phase runs;
    the sampled ones stop early in some rows."""
    one = _gen(sampler_model, sampler_prompts, None, **kw)
    phased = _gen(sampler_model, sampler_prompts, 2, **kw)
    assert response_buckets(N, 2) == (2, 4, 8, 12)
    np.testing.assert_array_equal(phased.tokens, one.tokens)
    np.testing.assert_array_equal(phased.valid, one.valid)
    np.testing.assert_array_equal(phased.truncated, one.truncated)
    # the chunked attention sums the weighted values chunk by chunk: float32 rounding (measured <= 2e-6),
    # within the sampler tests' tolerance for another summation order (the scan path, 8 devices)
    np.testing.assert_allclose(phased.logp, one.logp, atol=1e-5, rtol=0)
    if kw.get("greedy"):
        assert one.valid.all()  # ran through the last phase
    else:
        assert 0 < one.valid.sum(1).min() < N and one.truncated.any()  # early stops and the limit


@pytest.mark.e2e
def test_decode_phases_on_eight_devices(sampler_model, sampler_prompts, devices8):
    from ict_jax.sharding import state_shardings

    mesh = ict_jax.make_mesh(2, 2, 2)
    graphdef, state = nnx.split(sampler_model)
    with jax.set_mesh(mesh):
        model8 = nnx.merge(graphdef, jax.device_put(state, state_shardings(state, mesh)))
    one = _gen(sampler_model, sampler_prompts, None)
    r8 = _gen(model8, sampler_prompts, 2)
    np.testing.assert_array_equal(r8.tokens, one.tokens)
    np.testing.assert_allclose(r8.logp, one.logp, atol=1e-5, rtol=0)
