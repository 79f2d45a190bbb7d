"""The single compiled train step. Micro-batching and device count do not change gradients,
ict with rho = 1 equals dense, 20 steps compile once, and a tiny model learns a toy reward.

The slow method x loss_agg matrices run a covering design (tests/covering.py), not the product: each of
micro-batches and eight devices runs every method and every aggregation at least once (5 cases of the
15 pairs each, rotated apart so that the two cover 10 of the pairs together): the two full products (30
cases) would take over 7 minutes of CI's slow stage. On eight devices the default suite runs the step of ict
(fused, micro-batched, part of a group per shard); each other feature's eight-device check (ties, the
entropy convention, the reach shares, the one-pass head) is in the slow stage beside its one-device test."""

from __future__ import annotations

import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import ict_jax
from ict_jax.config_load import load_config
from ict_jax.rl.batch import RolloutBatch, build_rollout_batch
from ict_jax.rl.state import init_train_state
from ict_jax.rl.train_step import make_train_step

from covering import each_level_once  # tests/ is on sys.path under pytest

P, G, LP, LR = 4, 4, 3, 6
MODEL = ict_jax.ModelConfig.tiny(num_layers=1, remat="none")
METHOD_AGG = {  # each method with one aggregation in the default suite; the slow covering designs cross more
    "dense": "token-mean",
    "ict": "seq-mean-token-mean",
    "entropy": "seq-mean-token-sum-norm",
    "stapo": "token-mean",
    "random": "seq-mean-token-mean",
}


def _config(method: str, loss_agg: str, micro: int = 1, *extra: str):
    return load_config(None, [
        f"rl.selector.method={method}", f"rl.loss.loss_agg={loss_agg}", f"train.micro_batches={micro}",
        f"rollout.num_samples={G}", f"train.prompts_per_step={P}", f"rollout.max_new_tokens={LR}",
        "rl.selector.warmup_steps=0", "rl.selector.tau_p=0.005", "stats.chunk=4", "rl.loss.kl_coef=0.05",
        "rl.selector.rho=0.3", *extra])


@functools.lru_cache(maxsize=None)
def _batch() -> RolloutBatch:
    rng = np.random.default_rng(0)
    B = P * G
    tokens = rng.integers(3, MODEL.vocab_size, (B, LP + LR))
    am = np.ones((B, LP + LR), np.int32)
    am[:G, 0] = 0  # the first prompt is left-padded
    rv = np.ones((B, LR), np.float32)
    for i, n in enumerate(rng.integers(2, LR + 1, B)):  # right-padded responses of varied length
        rv[i, n:] = 0
        am[i, LP + n:] = 0
    rewards = rng.integers(0, 2, B).astype(np.float32)
    rewards[G:2 * G] = 1.0  # an all-equal group
    from ict_jax.rl.losses import group_advantages

    return RolloutBatch(
        tokens=jnp.asarray(tokens, jnp.int32), attention_mask=jnp.asarray(am), response_valid=jnp.asarray(rv),
        rewards=jnp.asarray(rewards), advantages=group_advantages(jnp.asarray(rewards), G),
        sampler_logp=jnp.asarray(-rng.random((B, LR)).astype(np.float32)), truncated=jnp.zeros(B),
        row_valid=jnp.ones(B), correct=jnp.asarray(rewards))


def _grad_recorder() -> optax.GradientTransformation:
    """An 'optimizer' that leaves the parameters alone and keeps the exact gradient as its state."""
    return optax.GradientTransformation(
        lambda params: jax.tree.map(jnp.zeros_like, params),
        lambda grads, state, params=None: (jax.tree.map(jnp.zeros_like, grads), grads))


def _param_delta(cfg, mesh=None, batch=None):
    """The exact gradient of one step (recorded by the optimizer: no clipping, no Adam) on ``batch``
    (default: :func:`_batch`)."""
    tx = _grad_recorder()
    model = ict_jax.init_model(MODEL, seed=1, mesh=mesh)
    state = init_train_state(cfg, model, tx=tx)
    step = make_train_step(cfg, mesh, tx=tx)
    ref = None
    if cfg.rl.loss.kl_coef > 0:
        ref = jax.tree.map(lambda a: a * 1.01, jax.tree.map(jnp.copy, state.params))  # a reference != policy
    batch = _batch() if batch is None else batch
    if mesh is not None:
        batch = ict_jax.sharding.shard_batch(batch, mesh)
    new, metrics = step(state, batch, ref)
    grads = jax.tree.map(np.asarray, new.opt_state)
    return grads, {k: float(v) for k, v in metrics.items()}


@functools.lru_cache(maxsize=None)
def _cached_delta(method, loss_agg, micro, *extra):
    return _param_delta(_config(method, loss_agg, micro, *extra))


def _assert_close_trees(a, b, rtol=2e-5, atol=1e-7):
    chex.assert_trees_all_close(a, b, rtol=rtol, atol=atol)  # same structure, shapes, and values within tol


# random shares ict's aggregation and per-response counts; its cases are in the slow covering design below
# the default suite: ict and dense; the other methods in the e2e stage (7-8 s each)
@pytest.mark.parametrize("method", [m if m in ("ict", "dense") else pytest.param(m, marks=pytest.mark.e2e)
                                    for m in METHOD_AGG if m != "random"])
def test_micro_batches_give_the_same_gradients(method):
    agg = METHOD_AGG[method]
    d1, m1 = _cached_delta(method, agg, 1)
    d4, m4 = _cached_delta(method, agg, 4)
    assert 0 < m1["mask/selected_frac"] <= 1
    if method != "dense":
        assert m1["mask/selected_frac"] < 1, "the mask must be non-trivial for the comparison to mean anything"
    assert max(np.abs(x).max() for x in jax.tree.leaves(d1)) > 1e-4  # a real gradient
    _assert_close_trees(d4, d1)
    np.testing.assert_allclose(m4["loss/total"], m1["loss/total"], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(m4["mask/selected_frac"], m1["mask/selected_frac"], rtol=0, atol=0)


AGGS = ["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"]


# every method and every aggregation at least once (each_level_once: 5 of the 15 pairs, for CI time)
@pytest.mark.slow
@pytest.mark.parametrize("method, agg", each_level_once(list(METHOD_AGG), AGGS))
def test_micro_batches_covering(method, agg):
    d1, _ = _cached_delta(method, agg, 1)
    for micro in (2, 4):
        _assert_close_trees(_cached_delta(method, agg, micro)[0], d1)


@pytest.mark.parametrize("method", ["ict", pytest.param("entropy", marks=pytest.mark.slow)])
def test_eight_devices_give_the_gradients_of_one(method, devices8):
    cfg = _config(method, METHOD_AGG[method], 1)
    d1, m1 = _cached_delta(method, METHOD_AGG[method], 1)
    mesh = ict_jax.make_mesh(data=2, fsdp=2, tensor=2)
    d8, m8 = _param_delta(cfg, mesh)
    _assert_close_trees(d8, d1)
    assert m8["mask/selected_frac"] == m1["mask/selected_frac"]  # entropy's batch scope is global


# every method and every aggregation at least once, rotated by one from test_micro_batches_covering: 5 other
# pairs (each_level_once, for CI time)
@pytest.mark.slow
@pytest.mark.parametrize("method, agg", each_level_once(list(METHOD_AGG), AGGS, offset=1))
def test_eight_devices_covering(method, agg, devices8):
    """Each method and each loss_agg (a covering design, not the product): a (2, 2, 2) mesh gives the
    gradients, loss and mask of one device."""
    d1, m1 = _cached_delta(method, agg, 1)
    d8, m8 = _param_delta(_config(method, agg, 1), ict_jax.make_mesh(data=2, fsdp=2, tensor=2))
    _assert_close_trees(d8, d1)
    np.testing.assert_allclose(m8["loss/total"], m1["loss/total"], rtol=1e-5, atol=1e-7)
    assert m8["mask/selected_frac"] == m1["mask/selected_frac"]


# Micro-batches smaller than a group: the no-grad statistics pass fixes the mask and every
# denominator over the mini-batch first, so any split of its rows gives the mini-batch's gradient. The
# old code refused these (whole groups per micro-batch and per shard).
@pytest.mark.parametrize("method", ["ict", pytest.param("frequent", marks=pytest.mark.e2e)]
                         + [pytest.param(m, marks=pytest.mark.slow)
                                                          for m in ("entropy", "stapo", "dense", "selectable")])
def test_micro_batches_smaller_than_a_group_give_the_same_gradients(method):
    agg = METHOD_AGG.get(method, "seq-mean-token-mean")  # the controls read u like ict
    d1, m1 = _cached_delta(method, agg, 1)
    for micro in (8, 16):  # 2 rows (half a group of G = 4), then 1 row per micro-batch
        d, m = _cached_delta(method, agg, micro)
        _assert_close_trees(d, d1)
        np.testing.assert_allclose(m["loss/total"], m1["loss/total"], rtol=1e-5, atol=1e-7)
        assert m["mask/selected_frac"] == m1["mask/selected_frac"]
        for k in ("stats/js_mean", "stats/H1_mean"):  # u still compares each rollout with its whole group
            np.testing.assert_allclose(m[k], m1[k], rtol=1e-5, atol=1e-7, err_msg=k)


@pytest.mark.parametrize("method, micro", [("ict", 4), pytest.param("ict", 2, marks=pytest.mark.slow),
                                           pytest.param("entropy", 4, marks=pytest.mark.slow)])
def test_part_of_a_group_per_shard_on_eight_devices(method, micro, devices8):
    """(data 2, fsdp 2, tensor 2): 4 batch shards; 4 micro-batches of 4 rows = one group of 4 spread
    over the 4 shards (a quarter of a group a shard); 2 micro-batches = half a group a shard."""
    agg = METHOD_AGG[method]
    d1, m1 = _cached_delta(method, agg, 1)
    d8, m8 = _param_delta(_config(method, agg, micro), ict_jax.make_mesh(data=2, fsdp=2, tensor=2))
    _assert_close_trees(d8, d1)
    np.testing.assert_allclose(m8["loss/total"], m1["loss/total"], rtol=1e-5, atol=1e-7)
    assert m8["mask/selected_frac"] == m1["mask/selected_frac"]


def test_old_pass_chunks_keep_whole_groups_per_shard():
    from ict_jax.rl.train_step import StepPlan, old_pass_chunks

    def plan(mini, micro, shards):
        return StepPlan.from_config(_config("ict", "token-mean", micro, f"train.mini_batches={mini}",
                                            f"train.prompts_per_step={4 * mini}"), optax.sgd(0.1), batch_shards=shards)

    # (prompts, mini, micro, shards) -> chunks of the old-policy pass: mini x the largest k <= micro
    # with whole groups per chunk and per shard
    assert old_pass_chunks(plan(1, 4, 1), 4) == 4  # micro-batches of one group: as before
    assert old_pass_chunks(plan(1, 16, 1), 4) == 4  # quarter groups: chunks of one group
    assert old_pass_chunks(plan(1, 4, 4), 4) == 1  # a group over 4 shards: one chunk of 4 groups
    assert old_pass_chunks(plan(2, 2, 2), 8) == 4  # 4 groups a mini-batch over 2 shards: 2 chunks each
    assert old_pass_chunks(plan(4, 8, 8), 128) == 16  # 32 prompts a mini-batch on 8 shards: k = 4, not 8


def test_batch_geometry_errors_name_the_setting(devices8):
    from ict_jax.rl.train_step import check_batch_geometry

    mesh = ict_jax.make_mesh(data=2, fsdp=2, tensor=2)  # 4 batch shards
    check_batch_geometry(16, 4, 1, 4, mesh)  # 4 rows a micro-batch: one a shard
    with pytest.raises(ValueError, match="train.micro_batches=3 equal micro-batches"):
        check_batch_geometry(16, 4, 1, 3, None)
    with pytest.raises(ValueError, match="a micro-batch of 2 rows cannot be split over .* 4 batch shards"):
        check_batch_geometry(16, 4, 1, 8, mesh)
    with pytest.raises(ValueError, match="groups never straddle a shard"):  # the old-policy pass needs whole groups
        check_batch_geometry(24, 4, 1, 2, mesh)  # 6 prompts over 4 shards
    with pytest.raises(ValueError, match="train.mini_batches=3 mini-batches of whole groups"):
        check_batch_geometry(16, 4, 3, 1, None)


@pytest.mark.parametrize("method", ["dense", pytest.param("random", marks=pytest.mark.slow)])
def test_one_pass_head_gives_the_two_pass_gradients(method, monkeypatch):
    """kl_coef = 0, one micro-batch: d loss / d logp is known before the forward pass and the step
    takes the one-pass head (stats_and_surrogate); two micro-batches take the two-pass custom VJP."""
    import ict_jax.rl.train_step as ts

    calls = []
    real = ts.stats_and_surrogate
    monkeypatch.setattr(ts, "stats_and_surrogate", lambda *a, **k: calls.append(1) or real(*a, **k))
    agg = METHOD_AGG[method]
    one, m1 = _param_delta(_config(method, agg, 1, "rl.loss.kl_coef=0"))
    assert calls, "the one-pass head was not used"
    calls.clear()
    two, m2 = _cached_delta(method, agg, 2, "rl.loss.kl_coef=0")
    assert not calls
    assert max(np.abs(x).max() for x in jax.tree.leaves(one)) > 1e-4  # a real gradient
    _assert_close_trees(one, two)
    for k in ("loss/total", "stats/H1_mean", "stats/H2_mean", "stats/js_mean", "mask/selected_frac"):
        np.testing.assert_allclose(m1[k], m2[k], rtol=1e-5, atol=1e-7, err_msg=k)
    # with a KL term the gradient depends on logp: the two-pass form is kept
    _param_delta(_config(method, agg, 1))
    assert not calls


@pytest.mark.parametrize("method", ["ict", pytest.param("stapo", marks=pytest.mark.e2e)])
def test_one_no_grad_pass_gives_the_two_pass_schedule(method, monkeypatch):
    """One mini-batch of micro-batches: the old-policy pass is also the statistics pass (one no-grad
    forward of the policy; the KL reference's is the other), and the step's gradients and every metric
    equal the schedule that runs the two passes."""
    import ict_jax.rl.train_step as ts

    calls = []
    real = ts.nograd_stats
    monkeypatch.setattr(ts, "nograd_stats", lambda *a, **k: calls.append(a[5]) or real(*a, **k))
    cfg = _config(method, METHOD_AGG[method], 2)
    one, m1 = _param_delta(cfg)
    assert len(calls) == 2 and calls[0] == ("logp",)  # the reference's pass, then the one policy pass
    assert set(calls[1]) >= {"logp", "H1", "H2", "js"}
    calls.clear()
    monkeypatch.setattr(ts.StepPlan, "shared_nograd", property(lambda self: False))
    two, m2 = _param_delta(cfg)
    assert len(calls) == 3  # reference, old policy, statistics
    assert max(np.abs(x).max() for x in jax.tree.leaves(one)) > 1e-4  # a real gradient
    assert 0 < m1["mask/selected_frac"] < 1
    _assert_close_trees(one, two)
    assert m1.keys() == m2.keys()
    for k in m1:
        np.testing.assert_allclose(m1[k], m2[k], rtol=1e-5, atol=1e-7, err_msg=k)


@pytest.mark.slow  # the default suite: the one-pass head on one device, and the 8-device step
def test_one_pass_head_on_eight_devices(devices8):
    cfg = _config("dense", "token-mean", 1, "rl.loss.kl_coef=0")
    d1, m1 = _param_delta(cfg)
    d8, m8 = _param_delta(cfg, ict_jax.make_mesh(data=2, fsdp=2, tensor=2))
    _assert_close_trees(d8, d1)
    np.testing.assert_allclose(m8["loss/total"], m1["loss/total"], rtol=1e-5, atol=1e-7)


def test_step_lower_sizes_an_abstract_step_without_running_it():
    cfg = _config("ict", "token-mean", 1)
    model = ict_jax.init_model(MODEL, seed=1)
    state = init_train_state(cfg, model)
    step = make_train_step(cfg)
    abstract = lambda tree: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)  # noqa: E731
    ref = abstract(state.params)
    compiled = step.lower(abstract(state), abstract(_batch()), ref).compile()
    assert compiled.memory_analysis().temp_size_in_bytes > 0
    assert int(state.step) == 0  # nothing ran, nothing was donated
    with pytest.raises(ValueError, match="ref_params"):
        step.lower(abstract(state), abstract(_batch()))


def test_ict_with_rho_one_equals_dense():
    agg = "seq-mean-token-mean"
    dense, _ = _cached_delta("dense", agg, 1)
    ict, m = _cached_delta("ict", agg, 1, "rl.selector.rho=1.0")
    assert m["mask/selected_frac"] == 1.0
    # the same tokens and the same loss, but two programs (ict's ranks by u first): XLA may order their float32
    # sums differently (it does with the tests' compile flags, tests/conftest.py), so the gradients agree to
    # float32 rounding, this file's gradient tolerance, not bit for bit
    _assert_close_trees(ict, dense)


def test_metrics_hold_every_method_section5_key():
    _, m = _cached_delta("ict", "seq-mean-token-mean", 1)
    expected = {"reward/mean", "reward/accuracy", "adv/zero_std_group_frac", "response/length_mean",
                "response/truncated_frac", "mask/selected_frac", "mask/selected_prob_mean",
                "mask/high_low_entropy_ratio", "stats/H1_mean", "stats/H2_mean", "stats/H1_selected_mean",
                "stats/H2_selected_mean", "stats/js_mean", "stats/js_p90", "stats/js_selected_mean",
                "loss/policy", "loss/kl", "kl/valid_mean", "clip/frac_selected", "clip/frac_unselected",
                "grad/norm", "rollout/logp_abs_diff_mean", "mask/selected_eos_frac",
                "mask/selected_after_shortest_frac", "mask/selected_truncated_frac", "mask/selected_neg_adv_frac",
                "optim/update_norm",
                "stats/u_at_ceiling", "mask/tie_selected_frac"}  # docs/statistics.md, beside the §5 keys
    assert expected <= set(m)
    assert 0.0 <= m["stats/u_at_ceiling"] <= 1.0 and 0.0 <= m["mask/tie_selected_frac"] <= 1.0
    assert m["adv/zero_std_group_frac"] >= 0.25  # the all-equal group
    assert all(np.isfinite(v) for v in m.values())


REAL_UPDATE = ("dense", "token-mean", 1, "rl.loss.kl_coef=0", "optim.lr=1e-3", "optim.lr_warmup_steps=0")


def _real_update(mesh=None):
    """One AdamW step of dense on :func:`_batch` with its full-length responses marked truncated:
    (batch, truncated, advantages, (parameters before, after, metrics)), the parameters as float64 leaves."""
    cfg = _config(*REAL_UPDATE)
    b = _batch()
    trunc = (np.asarray(b.response_valid).sum(1) == LR).astype(np.float32)  # the full-length responses hit the limit
    assert 0 < trunc.sum() < len(trunc)
    b = b.replace(truncated=jnp.asarray(trunc))
    adv = np.asarray(b.advantages)
    assert (adv < 0).any() and (adv >= 0).any()
    state = init_train_state(cfg, ict_jax.init_model(MODEL, seed=1, mesh=mesh))
    before = [np.asarray(a, np.float64) for a in jax.tree.leaves(state.params)]
    new, m = make_train_step(cfg, mesh)(state, b if mesh is None else ict_jax.sharding.shard_batch(b, mesh))
    after = [np.asarray(a, np.float64) for a in jax.tree.leaves(new.params)]
    return b, trunc, adv, (before, after, {k: float(v) for k, v in m.items()})


@pytest.mark.slow  # the default suite: the shares of a real update on one device, and the 8-device step
def test_reach_shares_and_update_norm_on_eight_devices(devices8):
    """Rows split over 8 devices (groups whole per shard): the same shares, and the norm of the update
    the step applied there."""
    _, _, _, (_, _, m1) = _real_update()
    _, _, _, (before, after, m8) = _real_update(ict_jax.make_mesh(data=2, fsdp=2, tensor=2))
    for k in ("mask/selected_eos_frac", "mask/selected_after_shortest_frac", "mask/selected_truncated_frac",
              "mask/selected_neg_adv_frac"):
        assert m8[k] == m1[k], k
    norm = math.sqrt(sum(float(np.sum((a - o) ** 2)) for a, o in zip(after, before)))
    np.testing.assert_allclose(m8["optim/update_norm"], norm, rtol=1e-6, atol=0)
    np.testing.assert_allclose(m8["optim/update_norm"], m1["optim/update_norm"], rtol=1e-5, atol=0)


def test_reach_shares_and_update_norm_of_a_real_update():
    """dense selects every valid token, so what it reaches is a count of the batch's tokens (closed forms,
    float64); ``optim/update_norm`` is the norm of the parameters' change under AdamW, in float64 from the
    parameters before and after (the step donates its state: copied first)."""
    b, trunc, adv, (before, after, m) = _real_update()
    L = np.asarray(b.response_valid).sum(1)
    total = L.sum()
    shortest = np.repeat(L.reshape(P, G).min(1), G)
    want = {"mask/selected_eos_frac": (trunc == 0).sum() / total,
            "mask/selected_after_shortest_frac": (L - shortest).sum() / total,
            "mask/selected_truncated_frac": (L * trunc).sum() / total,
            "mask/selected_neg_adv_frac": (L * (adv < 0)).sum() / total}
    for k, v in want.items():
        assert 0 < v < 1, k
        np.testing.assert_allclose(float(m[k]), v, rtol=1e-6, atol=0, err_msg=k)
    norm = math.sqrt(sum(float(np.sum((a - o) ** 2)) for a, o in zip(after, before)))
    assert norm > 1e-3  # a real update (lr 1e-3 on every parameter a gradient reaches)
    np.testing.assert_allclose(float(m["optim/update_norm"]), norm, rtol=1e-6, atol=0)
    assert abs(float(m["optim/update_norm"]) - float(m["grad/norm"])) > 0.1 * norm  # not the gradient's norm


# ------------------------------------------------------------------------------------------------
# Rollout -> reward -> step on a tiny model: learning sanity and compile counts
# ------------------------------------------------------------------------------------------------
LEARN_MODEL = ict_jax.ModelConfig.tiny(vocab_size=16, hidden_size=32, intermediate_size=64, num_layers=1,
                                       remat="none")


def _learn_config(method: str, seed: int, *extra: str):
    return load_config(None, [
        "rollout.num_samples=8", "train.prompts_per_step=4", "rollout.max_new_tokens=8",
        f"rl.selector.method={method}", "rl.loss.kl_coef=0", "stats.chunk=8", "optim.lr=0.003",
        "optim.weight_decay=0", f"seed={seed}", *extra])


@functools.lru_cache(maxsize=None)
def _learn_fns(method: str, *extra: str):
    model = ict_jax.init_model(LEARN_MODEL, seed=0)
    gen = ict_jax.make_generate_fn(nnx.graphdef(model), num_samples=8, max_new_tokens=8, temperature=1.0)
    return make_train_step(_learn_config(method, 0, *extra)), gen


def _run(method: str, seed: int, steps: int, *extra: str):
    cfg = _learn_config(method, seed, *extra)
    step, gen = _learn_fns(method, *extra)
    state = init_train_state(cfg, ict_jax.init_model(LEARN_MODEL, seed=seed))
    prompts = jnp.asarray(np.random.default_rng(seed).integers(6, 16, (4, 3)), jnp.int32)
    pm = jnp.ones(prompts.shape, jnp.int32)
    rewards, metrics = [], []
    for s in range(steps):
        ro = gen(state.params, prompts, pm, jax.random.fold_in(jax.random.PRNGKey(seed + 100), s))
        r = ((ro.tokens == 5) & ro.valid).any(axis=1).astype(jnp.float32)  # toy reward: contains token 5
        state, m = step(state, build_rollout_batch(prompts, pm, ro, r, config=cfg))
        rewards.append(float(r.mean()))
        metrics.append({k: float(v) for k, v in m.items()})
    return np.array(rewards), metrics, step, gen


@pytest.mark.e2e  # 3 seeds x 40 rollout + update steps; the loop itself stays in the default suite (next test)
@pytest.mark.parametrize("method", ["dense", "ict"])
def test_learning_sanity_toy_reward(method):
    for seed in (0, 1, 2):
        rewards, _, _, _ = _run(method, seed, 40, "rl.selector.warmup_steps=0")
        gain = rewards[-10:].mean() - rewards[:10].mean()
        assert gain >= 0.15, f"{method} seed {seed}: last-10 minus first-10 mean reward = {gain:.3f}"


def test_twenty_steps_compile_once_across_the_warmup_switch(caplog):
    import logging

    jax.config.update("jax_log_compiles", True)
    try:
        with caplog.at_level(logging.WARNING):
            _, metrics, step, gen = _run("ict", 0, 20, "rl.selector.warmup_steps=10")
    finally:
        jax.config.update("jax_log_compiles", False)
    compiles = [r.getMessage() for r in caplog.records if "Compiling" in r.getMessage()]
    assert sum("step_fn" in m for m in compiles) == 1, compiles
    assert sum("pure" in m for m in compiles) == 1, compiles  # the sampler's program
    assert [fn._cache_size() for fn in step.jitted.values()] == [1]
    assert gen.jitted._cache_size() == 1
    # warm-up is data: M = valid before step 10, the sparse ICT mask after
    assert all(m["mask/selected_frac"] == 1.0 for m in metrics[:10])
    assert all(m["mask/selected_frac"] < 0.6 for m in metrics[10:])


def test_non_finite_loss_skips_the_update_and_is_counted():
    cfg = _config("ict", "seq-mean-token-mean", 1)
    model = ict_jax.init_model(MODEL, seed=1)
    state = init_train_state(cfg, model)
    before = jax.tree.map(np.asarray, state.params)
    bad = _batch().replace(advantages=_batch().advantages.at[0].set(jnp.nan))
    new, m = make_train_step(cfg)(state, bad, jax.tree.map(jnp.copy, state.params))
    assert float(m["train/skipped"]) == 1.0
    for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(jax.tree.map(np.asarray, new.params))):
        np.testing.assert_array_equal(x, y)
    assert int(new.step) == 1  # the rollout batch is consumed; only the update is skipped


def test_random_control_draws_afresh_in_every_mini_batch(monkeypatch):
    """docs/method.md §2: the random control's key folds in the mini-batch index, so the two mini-batches of
    one rollout step, given identical rollouts, draw different masks with the same per-response counts
    (the old code reused one score matrix for every mini-batch of the step)."""
    from ict_jax.rl import train_step as ts

    def step_metrics_with_masks(batch, valid, mask, *args, **kwargs):  # the step's masks, as a "metric"
        return {**real(batch, valid, mask, *args, **kwargs), "_mask": mask}

    real = ts.step_metrics
    monkeypatch.setattr(ts, "step_metrics", step_metrics_with_masks)
    cfg = _config("random", "seq-mean-token-mean", 1, "train.mini_batches=2", "rl.loss.kl_coef=0")
    b = _batch()
    half = P * G // 2
    twice = jax.tree.map(lambda a: jnp.concatenate([a[:half], a[:half]]), b)  # mini-batch 1 = mini-batch 0
    model = ict_jax.init_model(MODEL, seed=1)
    state = init_train_state(cfg, model)
    _, metrics = make_train_step(cfg)(state, twice)
    m = np.asarray(metrics["_mask"])
    first, second = m[:half], m[half:]
    np.testing.assert_array_equal(first.sum(1), second.sum(1))  # ict's counts in both
    assert first.sum() > 0 and np.all(m <= np.asarray(twice.response_valid))
    assert not np.array_equal(first, second)


@pytest.mark.e2e  # three more compiled steps (14 s); the default suite checks u_form in tests/rl/test_group_stats.py
def test_u_form_reaches_the_step_and_micro_batching_keeps_it():
    """stats.u_form is the reading of u that ICT's mask uses in the step (old-policy pass included):
    `pooled` changes the mask and gradient, and 4 micro-batches (whole groups) or 8 (half a group each)
    give the gradient of one."""
    agg = METHOD_AGG["ict"]
    d_aligned, m_aligned = _cached_delta("ict", agg, 1)
    d1, m1 = _cached_delta("ict", agg, 1, "stats.u_form=pooled")
    d4, m4 = _cached_delta("ict", agg, 4, "stats.u_form=pooled")
    assert m1["stats/js_mean"] != m_aligned["stats/js_mean"]
    assert max(np.abs(x - y).max() for x, y in zip(jax.tree.leaves(d1), jax.tree.leaves(d_aligned))) > 1e-6
    _assert_close_trees(d4, d1)
    np.testing.assert_allclose(m4["stats/js_mean"], m1["stats/js_mean"], rtol=1e-5)
    d8, m8 = _cached_delta("ict", agg, 8, "stats.u_form=pooled")
    _assert_close_trees(d8, d1)
    np.testing.assert_allclose(m8["stats/js_mean"], m1["stats/js_mean"], rtol=1e-5)
    assert m8["mask/selected_frac"] == m1["mask/selected_frac"]


# ------------------------------------------------------------------------------------------------
# A selector a user registers trains like the built-in it mirrors: the step reads its `needs`
# ------------------------------------------------------------------------------------------------
def _register_user_selectors():
    from ict_jax.rl.selectors import dense_mask, ict_mask, register_selector, topk_mask

    def my_ict(stats, adv, valid, *, key, step, config, group_size):  # reads u only; ICT's defaults are its own
        return ict_mask(stats.js, valid, group_size=group_size, rho=config.rho or 0.1, scope=config.scope or "sequence")

    def my_dense(stats, adv, valid, *, key, step, config, group_size):  # reads nothing
        return dense_mask(valid)

    def my_peaked(stats, adv, valid, *, key, step, config, group_size):  # reads max_v p, not computed by default
        return topk_mask(stats.pmax, valid, rho=0.3, scope="batch")

    register_selector("user_ict", my_ict, warmup=True, needs=("js",), overwrite=True)
    register_selector("user_dense", my_dense, needs=(), overwrite=True)
    register_selector("user_peaked", my_peaked, needs=("pmax",), overwrite=True)


@pytest.mark.parametrize("micro", [1, 4])
def test_a_registered_selector_that_needs_u_trains_like_ict(micro):
    """`rl.selector.method` names the user's selector; the step computes u for it (fused: the gradient
    forward; 4 micro-batches: the old-policy pass) and the gradient is ict's (to float32 rounding: ict's
    program also computes the tie share, and XLA may order the two programs' sums differently)."""
    from ict_jax.rl.train_step import StepPlan

    _register_user_selectors()
    agg = METHOD_AGG["ict"]
    plan = StepPlan.from_config(_config("user_ict", agg, micro), optax.sgd(0.1))
    assert plan.needs == ("js",) and plan.need_js and not plan.one_pass
    mine, m = _cached_delta("user_ict", agg, micro)
    ict, m_ict = _cached_delta("ict", agg, micro)
    assert 0 < m["mask/selected_frac"] < 1
    _assert_close_trees(mine, ict)
    # the tie share needs the score a selector ranks by, which only the built-in selectors name
    # (rl.saturation.RANKED_BY); every other metric is ict's
    assert m == {k: v for k, v in m_ict.items() if k != "mask/tie_selected_frac"}
    assert "mask/tie_selected_frac" in m_ict


def test_a_registered_selector_that_needs_nothing_takes_the_one_pass_head(monkeypatch):
    import ict_jax.rl.train_step as ts

    _register_user_selectors()
    calls = []
    real = ts.stats_and_surrogate
    monkeypatch.setattr(ts, "stats_and_surrogate", lambda *a, **k: calls.append(1) or real(*a, **k))
    agg = METHOD_AGG["dense"]
    mine, m = _param_delta(_config("user_dense", agg, 1, "rl.loss.kl_coef=0"))
    assert calls, "a selector that needs no statistics takes the one-pass head"
    dense, m_dense = _param_delta(_config("dense", agg, 1, "rl.loss.kl_coef=0"))
    _assert_close_trees(mine, dense, rtol=0, atol=0)
    assert m == m_dense and m["mask/selected_frac"] == 1.0


def test_a_registered_selector_gets_a_statistic_the_step_does_not_compute_by_default():
    """`needs=("pmax",)`: max_v p reaches the mask in both schedules (the gradient forward when fused, the
    no-grad statistics pass with micro-batches), and micro-batching keeps the gradient of one batch."""
    _register_user_selectors()
    agg = "token-mean"
    d1, m1 = _cached_delta("user_peaked", agg, 1)
    d4, m4 = _cached_delta("user_peaked", agg, 4)
    assert 0 < m1["mask/selected_frac"] < 0.5
    _assert_close_trees(d4, d1)
    assert m4["mask/selected_frac"] == m1["mask/selected_frac"]



# ------------------------------------------------------------------------------------------------
# rl.selector.ties: all, and 20-Entropy as its official code runs it (docs/method.md §2)
# ------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _lone_tail_batch() -> RolloutBatch:
    """:func:`_batch` with the first response of each group 6 tokens long and the others 2: positions 2-5 of
    that response have no sibling, so u = 0 exactly there (docs/method.md §1), and at rho 0.5 its k = 3 cut
    falls inside that tie of zeros (at most positions 0 and 1 have u > 0)."""
    b = _batch()
    lengths = np.tile([LR, 2, 2, 2], P)
    rv = (np.arange(LR)[None] < lengths[:, None]).astype(np.float32)
    am = np.asarray(b.attention_mask).copy()
    am[:, LP:] = rv.astype(am.dtype)
    return b.replace(response_valid=jnp.asarray(rv), attention_mask=jnp.asarray(am))


@functools.lru_cache(maxsize=None)
def _ties_delta(ties, micro, mesh_shape=None):
    cfg = _config("ict", "seq-mean-token-mean", micro, "rl.selector.rho=0.5", f"rl.selector.ties={ties}")
    mesh = None if mesh_shape is None else ict_jax.make_mesh(*mesh_shape)
    return _param_delta(cfg, mesh, _lone_tail_batch())


def test_ties_all_in_the_compiled_step_with_micro_batches():
    """ICT under ties: all keeps the whole tie at its cut in the compiled step (k varies per row): more
    tokens than position's exact k, the tie share counts them, and 4 micro-batches (the old-policy pass,
    the no-grad statistics pass) give the one-batch gradient, mask and metrics, as under position."""
    dp, mp = _ties_delta("position", 1)
    da, ma = _ties_delta("all", 1)
    # per group: the lone row keeps k = 3 (position) or all 6 (all: 3 more tied zeros); the others 1 of 2
    n_valid = P * (LR + 3 * 2)
    assert mp["mask/selected_frac"] == pytest.approx(P * (3 + 3 * 1) / n_valid)
    assert ma["mask/selected_frac"] == pytest.approx(P * (6 + 3 * 1) / n_valid)
    # the tie decided 1 of position's 3 (or 2, when u(t=0) rounds to 0 too) and 4 (or 5) of all's 6 a group
    assert 0 < mp["mask/tie_selected_frac"] < ma["mask/tie_selected_frac"] < 1
    assert not np.allclose(jax.tree.leaves(da)[0], jax.tree.leaves(dp)[0])
    for ties, (d1, m1) in (("position", (dp, mp)), ("all", (da, ma))):
        d4, m4 = _ties_delta(ties, 4)
        _assert_close_trees(d4, d1)
        np.testing.assert_allclose(m4["loss/total"], m1["loss/total"], rtol=1e-5, atol=1e-7)
        assert m4["mask/selected_frac"] == m1["mask/selected_frac"]
        assert m4["mask/tie_selected_frac"] == m1["mask/tie_selected_frac"]


@pytest.mark.slow  # the default suite: ties on one device, and the 8-device step of ict
def test_ties_all_on_eight_devices(devices8):
    """ties: all on a (2, 2, 2) mesh gives the gradients, loss and mask of one device, fused and with a
    group spread over the 4 batch shards (4 micro-batches)."""
    da, ma = _ties_delta("all", 1)
    for micro in (1, 4):
        d8, m8 = _ties_delta("all", micro, (2, 2, 2))
        _assert_close_trees(d8, da)
        np.testing.assert_allclose(m8["loss/total"], ma["loss/total"], rtol=1e-5, atol=1e-7)
        assert m8["mask/selected_frac"] == ma["mask/selected_frac"]


def _official(micro, *extra, mesh=None, batch=None):
    cfg = _config("entropy", "token-mean", micro, "rl.selector.rho=0.2", *extra,
                  f"train.prompts_per_step={P if batch is None else batch.rewards.shape[0] // G}")
    return _param_delta(cfg, mesh, batch)


OFFICIAL = ("rl.selector.scope=micro_batch", "rl.loss.normalize_scope=micro_batch")


def _halves():
    b = _batch()
    half = P * G // 2
    return [jax.tree.map(lambda a, sl=sl: a[sl], b) for sl in (slice(0, half), slice(half, None))]


def test_entropy_official_convention_is_the_mean_of_its_micro_batches():
    """rl.selector.scope: micro_batch + rl.loss.normalize_scope: micro_batch with 2 micro-batches (2 groups
    each): the top 20 % by H1 within each micro-batch and each micro-batch's token-mean over its own selected
    tokens, averaged (verl's gradient accumulation). Each half alone, as a mini-batch of one micro-batch, has
    exactly that mask and loss, so the step's gradient is the mean of the halves' gradients."""
    d, m = _official(2, *OFFICIAL)
    halves = [_official(1, *OFFICIAL, batch=h) for h in _halves()]
    want = jax.tree.map(lambda a, b: (a + b) / 2, halves[0][0], halves[1][0])
    _assert_close_trees(d, want)
    np.testing.assert_allclose(m["loss/total"], (halves[0][1]["loss/total"] + halves[1][1]["loss/total"]) / 2,
                               rtol=1e-5, atol=1e-7)
    # k = ceil(0.2 n) per micro-batch: the selected counts add up
    n = [float(np.asarray(h.response_valid).sum()) for h in _halves()]
    sel = sum(math.ceil(0.2 * k) for k in n)
    assert m["mask/selected_frac"] == pytest.approx(sel / sum(n))
    # the mini-batch default differs: one top 20 % over the 4 groups, one token-mean over it
    d_default, m_default = _official(2)
    assert m_default["mask/selected_frac"] == pytest.approx(math.ceil(0.2 * sum(n)) / sum(n))
    assert not np.allclose(np.asarray(jax.tree.leaves(d_default)[0]), np.asarray(jax.tree.leaves(d)[0]))
    # one micro-batch: the micro_batch scope is the batch scope and the normaliser the mini-batch's, bit for bit
    one, m_one = _official(1, *OFFICIAL)
    ref, m_ref = _official(1)
    _assert_close_trees(one, ref, rtol=0, atol=0)
    assert m_one == m_ref


@pytest.mark.slow  # the default suite: the convention on one device, and the 8-device step of ict
def test_entropy_official_convention_on_eight_devices(devices8):
    """On a (2, 2, 2) mesh each micro-batch (8 rows over 4 batch shards) is still one candidate set and one
    normaliser: the gradients of one device (the official code's per-rank micro-batch is not reproduced)."""
    d1, m1 = _official(2, *OFFICIAL)
    d8, m8 = _official(2, *OFFICIAL, mesh=ict_jax.make_mesh(data=2, fsdp=2, tensor=2))
    _assert_close_trees(d8, d1)
    np.testing.assert_allclose(m8["loss/total"], m1["loss/total"], rtol=1e-5, atol=1e-7)
    assert m8["mask/selected_frac"] == m1["mask/selected_frac"]
