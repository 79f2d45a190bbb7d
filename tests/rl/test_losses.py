"""ict_jax.rl.losses against golden values of an independent PyTorch reference (tests/rl/golden/grpo_reference.py),
plus the semantic properties of docs/method.md §3-§4: zero gradient where M = 0, advantages that sum to zero,
all-equal groups that do not learn, micro-batch denominators that add up to the mini-batch, and the
micro-batch normaliser of 20-Entropy's official code (rl.loss.normalize_scope: micro_batch) by hand."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ict_jax.config import LossSection
from ict_jax.rl.losses import (
    clipped_surrogate,
    group_advantages,
    k3_kl,
    loss_denominators,
    micro_batch_loss,
    mini_batch_loss,
    policy_loss,
    zero_std_groups,
)

DATA = Path(__file__).parent / "golden"
GOLDEN = json.loads((DATA / "grpo_golden.json").read_text())
TOL = dict(rtol=1e-6, atol=1e-6)  # float32 JAX vs float64 PyTorch
AGGS = ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm")
EPS_LOW, EPS_HIGH = GOLDEN["config"]["eps_low"], GOLDEN["config"]["eps_high"]

_inp = GOLDEN["inputs"]
LOGP, LOGP_OLD, LOGP_REF = (jnp.asarray(_inp[k], jnp.float32) for k in ("logp", "logp_old", "logp_ref"))
ADV = jnp.asarray(_inp["adv"], jnp.float32)
VALID = jnp.asarray(_inp["valid"], bool)
MASKS = {k: jnp.asarray(v, bool) for k, v in _inp["masks"].items()}
B, T = LOGP.shape


def loss_config(**kw) -> LossSection:
    base = dict(eps_low=EPS_LOW, eps_high=EPS_HIGH, dual_clip_c=3.0, kl_coef=0.05)
    return LossSection(**{**base, **kw})


@jax.jit
def _zeroed(valid, *xs):
    return tuple(jnp.where(valid, x, 0.0) for x in xs)


_GRAD_FNS: dict = {}
_group_advantages_jit = jax.jit(group_advantages, static_argnums=(1, 2))


def loss_and_grad(cfg: LossSection, logp=LOGP, logp_ref=LOGP_REF, adv=ADV, valid=VALID, mask=None, denoms=None,
                  logp_old=LOGP_OLD):
    """value_and_grad of policy_loss wrt logp, jitted once per config."""
    if cfg not in _GRAD_FNS:
        def f(logp, logp_old, logp_ref, adv, valid, mask, denoms):
            return policy_loss(logp, logp_old, logp_ref, adv, valid, mask, config=cfg, denoms=denoms)
        _GRAD_FNS[cfg] = jax.jit(jax.value_and_grad(f, has_aux=True))
    (loss, metrics), grad = _GRAD_FNS[cfg](logp, logp_old, logp_ref, adv, valid, mask, denoms)
    return loss, metrics, grad


# ------------------------------------------------------------------------------------ golden values
@pytest.mark.parametrize("case", ["main", "group_of_one", "row_valid"])
@pytest.mark.parametrize("mode", ["group", "batch", "none"])
def test_advantages_golden(case, mode):
    g = GOLDEN["advantages"][case]
    row_valid = jnp.asarray(g["row_valid"]) if "row_valid" in g else None
    adv = _group_advantages_jit(jnp.asarray(g["rewards"], jnp.float32), g["group_size"], mode, 1e-6, row_valid)
    assert adv.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(adv), g[mode], **TOL)
    want_zero = np.asarray(g[mode]) == 0.0  # all-equal groups and padding rows: exactly 0
    assert np.all(np.asarray(adv)[want_zero] == 0.0)


def test_all_equal_group_exactly_zero():
    # float32 mean of (0.9, 0.9, 0.9) is 0.9 - 6e-8 and its std ~0: a mean/std path would give
    # A = 6e-8 / (std + 1e-6) = O(0.05) garbage; max == min must zero the group exactly.
    r = jnp.asarray([0.9, 0.9, 0.9, 1.0, 0.0, 0.3, 0.45, 0.45, 0.45], jnp.float32)
    assert float(r[:3].sum() / 3) != float(r[0])  # the premise of this test
    for mode in ("group", "batch", "none"):
        adv = np.asarray(_group_advantages_jit(r, 3, mode))
        assert np.all(adv[:3] == 0.0) and np.all(adv[6:] == 0.0) and np.all(adv[3:6] != 0.0)
    assert zero_std_groups(r, 3).tolist() == [True, False, True]
    assert zero_std_groups(r[:8], 2).tolist() == [True, False, False, True]
    assert zero_std_groups(r, 3, row_valid=jnp.asarray([1, 1, 1, 1, 0, 0, 1, 1, 1])).tolist() == [True, False, True]


def test_per_token_golden():
    pt = GOLDEN["per_token"]
    lp, lpo, lpr = _zeroed(VALID, LOGP, LOGP_OLD, LOGP_REF)
    surr, ratio = clipped_surrogate(lp, lpo, ADV, eps_low=EPS_LOW, eps_high=EPS_HIGH, dual_clip_c=3.0)
    np.testing.assert_allclose(np.asarray(ratio), pt["ratio"], **TOL)
    np.testing.assert_allclose(np.asarray(surr), pt["surr_dual"], **TOL)
    surr_nd, _ = clipped_surrogate(lp, lpo, ADV, eps_low=EPS_LOW, eps_high=EPS_HIGH, dual_clip_c=None)
    np.testing.assert_allclose(np.asarray(surr_nd), pt["surr_nodual"], **TOL)
    # the batch exercises what it claims to: dual clip, clip-higher band and the k3 clamp all bite
    assert np.any(np.asarray(surr) != np.asarray(surr_nd))
    r = np.asarray(ratio)
    assert np.any((r > 1 + 0.2) & (r < 1 + EPS_HIGH)) and r.max() > 1e8 and r.min() < 1e-8
    k3 = k3_kl(lp, lpr)
    np.testing.assert_allclose(np.asarray(k3), pt["k3"], **TOL)
    assert float(k3.max()) == 10.0


@pytest.mark.parametrize("loss_agg", AGGS)
def test_loss_golden(loss_agg):
    """Loss, docs/method.md §5 metrics and d loss / d logp, every normalize_over x kl_masked x method mask."""
    cases = [c for c in GOLDEN["loss_cases"] if c["loss_agg"] == loss_agg]
    assert len(cases) == 6 * len(MASKS)
    for c in cases:
        cfg = loss_config(loss_agg=loss_agg, normalize_over=c["normalize_over"], kl_masked=c["kl_masked"],
                          kl_coef=c["kl_coef"], dual_clip_c=c["dual_clip_c"])
        loss, metrics, grad = loss_and_grad(cfg, mask=MASKS[c["method"]])
        where = f"{c['method']} {loss_agg} {c['normalize_over']} kl_masked={c['kl_masked']} kl={c['kl_coef']}"
        np.testing.assert_allclose(float(loss), c["loss"], **TOL, err_msg=where)
        assert set(metrics) == set(c["metrics"]), where
        for k, v in c["metrics"].items():
            np.testing.assert_allclose(float(metrics[k]), v, **TOL, err_msg=f"{where} {k}")
        np.testing.assert_allclose(np.asarray(grad), c["grad_logp"], **TOL, err_msg=where)


@pytest.mark.torch
def test_reference_reproduces_golden(tmp_path):
    pytest.importorskip("torch")
    out = tmp_path / "golden.json"
    subprocess.run([sys.executable, str(DATA / "grpo_reference.py"), str(out)], check=True, timeout=120)
    _assert_same(json.loads(out.read_text()), GOLDEN, "golden")


def _assert_same(a, b, path):
    """Same structure and values; floats to 1e-12 (float64 reductions may differ in the last bit across
    CPUs), NaN equals NaN."""
    assert type(a) is type(b) or {type(a), type(b)} <= {int, float}, path
    if isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            _assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, float) or isinstance(b, float):
        assert (math.isnan(a) and math.isnan(b)) or a == b or math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-12), path
    else:
        assert a == b, path


# ------------------------------------------------------------------------------------ semantics
@pytest.mark.parametrize("method", ["ict", "entropy", "stapo", "random"])
def test_unselected_tokens_get_zero_gradient(method):
    mask = MASKS[method]
    off = np.asarray(~mask)
    for agg in AGGS:
        for norm in ("selected", "valid"):
            # kl_coef = 0: only the policy term; kl_masked: the KL term too is confined to M.
            for kw in (dict(kl_coef=0.0, kl_masked=False), dict(kl_coef=0.05, kl_masked=True)):
                _, _, grad = loss_and_grad(loss_config(loss_agg=agg, normalize_over=norm, **kw), mask=mask)
                g = np.asarray(grad)
                assert np.all(np.isfinite(g))
                assert np.all(g[off] == 0.0), (method, agg, norm, kw)
                assert np.any(g[~off] != 0.0)
            # control (the test can fail): an unmasked KL term does reach valid unselected tokens
            _, _, grad = loss_and_grad(loss_config(loss_agg=agg, normalize_over=norm, kl_masked=False), mask=mask)
            assert np.any(np.asarray(grad)[off & np.asarray(VALID)] != 0.0)


def test_mask_all_ones_equals_dense():
    for agg in AGGS:
        for norm in ("selected", "valid"):
            cfg = loss_config(loss_agg=agg, normalize_over=norm)
            dense = loss_and_grad(cfg, mask=VALID)
            ones = loss_and_grad(cfg, mask=jnp.ones_like(VALID))
            assert float(dense[0]) == float(ones[0])
            np.testing.assert_array_equal(np.asarray(dense[2]), np.asarray(ones[2]))


def test_kl_requires_reference():
    with pytest.raises(ValueError, match="logp_ref"):
        policy_loss(LOGP, LOGP_OLD, None, ADV, VALID, VALID, config=loss_config(kl_coef=0.1))
    loss, metrics, grad = loss_and_grad(loss_config(kl_coef=0.0), logp_ref=None, mask=VALID)
    assert math.isfinite(float(loss)) and float(metrics["loss/kl"]) == 0.0
    assert float(metrics["kl/valid_mean"]) == 0.0 and np.all(np.isfinite(np.asarray(grad)))


@settings(max_examples=15, deadline=None)
@given(st.lists(st.sampled_from([0.0, 0.25, 0.5, 1.0, -0.1]), min_size=12, max_size=12),
       st.sampled_from([2, 3, 4, 6]), st.sampled_from(["group", "batch", "none"]))
def test_group_advantages_sum_to_zero(rewards, group_size, mode):
    adv = np.asarray(_group_advantages_jit(jnp.asarray(rewards, jnp.float32), group_size, mode))
    assert np.all(np.isfinite(adv))
    np.testing.assert_allclose(adv.reshape(-1, group_size).sum(-1), 0.0, atol=1e-5)


def test_all_equal_group_contributes_no_policy_gradient():
    rewards = jnp.asarray([1.0, 0.0, 1.0, 0.0, 0.7, 0.7, 0.7, 0.7, 0.0, 1.0, 0.5, 0.0], jnp.float32)
    adv = group_advantages(rewards, 4)
    for agg in AGGS:
        _, _, grad = loss_and_grad(loss_config(loss_agg=agg, kl_coef=0.0), adv=adv, mask=VALID)
        g = np.asarray(grad)
        assert np.all(g[4:8] == 0.0) and np.any(g[:4] != 0.0)


def test_row_without_selected_token_does_not_dilute_seq_mean():
    """docs/method.md §4, seq-mean-token-mean: a response with valid tokens but no selected one (group or
    batch scopes, STAPO, frequent) leaves R under normalize_over 'selected'; under 'valid' (GRPO's
    denominators) it stays. Hand-computed, r = 1 (logp = logp_old) so surr = A on selected tokens."""
    valid = jnp.asarray([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], bool)
    mask = jnp.asarray([[1, 1, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0]], bool)  # row 1: valid, none selected
    adv = jnp.asarray([1.0, 3.0, -2.0], jnp.float32)
    lp = jnp.full((3, 4), -1.0, jnp.float32)
    cfg = loss_config(kl_coef=0.0, loss_agg="seq-mean-token-mean")
    loss, _ = policy_loss(lp, lp, None, adv, valid, mask, config=cfg)
    # rows 0 and 2 only: -(mean_t of A over row 0's 2 selected + row 2's 1 selected) / 2
    np.testing.assert_allclose(float(loss), -((2 * 1.0) / 2 + (-2.0) / 1) / 2, rtol=1e-6)  # 0.5, not 1/3
    d = loss_denominators(valid, mask, cfg)
    assert float(d.pg_rows) == 2.0 and float(d.num_responses) == 3.0
    # normalize_over 'valid': GRPO's denominators, every row with a valid token counts
    cfg_v = loss_config(kl_coef=0.0, loss_agg="seq-mean-token-mean", normalize_over="valid")
    loss_v, _ = policy_loss(lp, lp, None, adv, valid, mask, config=cfg_v)
    np.testing.assert_allclose(float(loss_v), -((2 * 1.0) / 3 + 0.0 + (-2.0) / 4) / 3, rtol=1e-6)
    # the KL term: kl_masked rows with no selected token leave its R too; unmasked KL keeps them
    ref = jnp.full((3, 4), -1.5, jnp.float32)
    k3 = float(np.exp(-0.5) + 0.5 - 1.0)
    _, m = policy_loss(lp, lp, ref, adv, valid, mask, config=loss_config(kl_coef=0.1))
    np.testing.assert_allclose(float(m["loss/kl"]), k3, rtol=1e-5)  # mean over rows 0, 2 of k3
    _, m = policy_loss(lp, lp, ref, adv, valid, mask, config=loss_config(kl_coef=0.1, kl_masked=False))
    np.testing.assert_allclose(float(m["loss/kl"]), k3, rtol=1e-5)  # every row: per-row mean k3 = k3
    assert float(loss_denominators(valid, mask, loss_config(kl_masked=False)).kl_rows) == 3.0


@pytest.mark.parametrize("loss_agg", AGGS)
def test_micro_batch_denominators_add_up(loss_agg):
    """Micro-batch losses / gradients / metrics with mini-batch denominators sum to the full batch."""
    rng = np.random.default_rng(0)
    for method in ("dense", "ict", "entropy"):
        for cfg in (loss_config(loss_agg=loss_agg),
                    loss_config(loss_agg=loss_agg, normalize_over="valid", kl_masked=False)):
            mask = MASKS[method]
            full_loss, full_metrics, full_grad = loss_and_grad(cfg, mask=mask)
            denoms = loss_denominators(VALID, mask, cfg)
            for n_micro in (2, 4):  # 12 rows: P = 4 groups of G = 3 (or 6 x 2): groups never split
                order = rng.permutation(n_micro)  # the sum does not care about the order
                losses, grads, metrics = [], [None] * n_micro, []
                rows = B // n_micro
                for k in order:
                    s = slice(k * rows, (k + 1) * rows)
                    loss, m, g = loss_and_grad(cfg, logp=LOGP[s], logp_old=LOGP_OLD[s], logp_ref=LOGP_REF[s],
                                               adv=ADV[s], valid=VALID[s], mask=mask[s], denoms=denoms)
                    losses.append(float(loss))
                    grads[k] = np.asarray(g)
                    metrics.append(m)
                np.testing.assert_allclose(sum(losses), float(full_loss), rtol=1e-6, atol=1e-7)
                np.testing.assert_allclose(np.concatenate(grads), np.asarray(full_grad), rtol=1e-6, atol=1e-9)
                for key, v in full_metrics.items():
                    np.testing.assert_allclose(sum(float(m[key]) for m in metrics), float(v), rtol=1e-6,
                                               atol=1e-7, err_msg=key)
                if n_micro != 2:
                    continue
                # without the mini-batch denominators the micro-batch pieces do not add up
                s = slice(0, rows)
                alone, _, _ = loss_and_grad(cfg, logp=LOGP[s], logp_old=LOGP_OLD[s], logp_ref=LOGP_REF[s],
                                            adv=ADV[s], valid=VALID[s], mask=mask[s])
                assert float(alone) != losses[list(order).index(0)]



def test_sharded_rows_match_one_device(devices8):
    """Rows sharded over 4 devices (the global reductions of AGG) give the one-device numbers."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as Ps

    cfg = loss_config()
    mesh = Mesh(np.asarray(devices8[:4]), ("data",))
    rows, rows_t = NamedSharding(mesh, Ps("data")), NamedSharding(mesh, Ps("data", None))

    def f(logp, logp_old, logp_ref, adv, valid, mask):
        return policy_loss(logp, logp_old, logp_ref, adv, valid, mask, config=cfg)

    g = jax.jit(jax.value_and_grad(f, has_aux=True), in_shardings=(rows_t, rows_t, rows_t, rows, rows_t, rows_t))
    (loss, metrics), grad = g(LOGP, LOGP_OLD, LOGP_REF, ADV, VALID, MASKS["ict"])
    assert grad.sharding.num_devices == 4
    want_loss, want_metrics, want_grad = loss_and_grad(cfg, mask=MASKS["ict"])
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(grad), np.asarray(want_grad), rtol=1e-6, atol=1e-9)
    for k, v in want_metrics.items():
        np.testing.assert_allclose(float(metrics[k]), float(v), rtol=1e-6, atol=1e-7, err_msg=k)


# ------------------------------------------------------------------------------------------------
# Dynamic sampling: which groups carry a signal. Decided from the total reward, an all-wrong group whose
# rewards differ only by a format penalty would survive; rl.adv.filter_on: correct | reward.
# ------------------------------------------------------------------------------------------------
def test_informative_groups_hand_cases():
    from ict_jax.rl.dynamic_sampling import informative_groups

    # G = 4; rl.reward.correct = 1, wrong = 0, no_answer = -0.2 (a format penalty)
    rewards = np.array([
        -0.2, 0.0, -0.2, 0.0,   # all wrong, rewards differ only by format
        1.0, 0.0, 0.0, -0.2,    # one right
        1.0, 1.0, 1.0, 1.0,     # all right
        0.0, 0.0, 0.0, 0.0,     # all wrong, same reward
        1.0, 1.1, 1.0, 1.0,     # all right, one with a bonus (a custom reward)
        0.3, 0.0, 0.0, 0.0,     # partial credit, nothing correct (reasoning-gym style)
    ])
    assert informative_groups(rewards, 4, "correct", 1.0).tolist() == [False, True, False, False, False, False]
    assert informative_groups(rewards, 4, "reward", 1.0).tolist() == [True, True, False, False, True, True]
    # the threshold of "correct" is rl.reward.correct: with correct = 0.3 the last group has one right
    assert informative_groups(rewards, 4, "correct", 0.3).tolist()[-1]
    with pytest.raises(ValueError, match="filter_on"):
        informative_groups(rewards, 4, "score")
    with pytest.raises(ValueError, match="group_size=5"):
        informative_groups(rewards, 5)


def test_filter_on_config_key():
    from ict_jax.config import ConfigError
    from ict_jax.config_load import load_config

    assert load_config(None).rl.adv.filter_on == "correct"  # DAPO's definition (docs/config.md)
    assert load_config(None, ["rl.adv.filter_on=reward"]).rl.adv.filter_on == "reward"
    with pytest.raises(ConfigError, match="rl.adv.filter_on: 'score' is not allowed; allowed values: reward, correct"):
        load_config(None, ["rl.adv.filter_on=score"])


def test_micro_batch_normaliser_hand_computed():
    """rl.loss.normalize_scope (docs/loss.md): two micro-batches of two rows, token-mean over the selected
    tokens M (20-Entropy's official code), computed by hand.

    M = (0,0), (2,0), (3,0) (the top 20 % of H1 per micro-batch in tests/rl/test_selectors.py); A = 1, -1,
    0.5, -0.5; r = 1 but at (2,0), r = 1.1 (inside the clip: surr = 0.55); logp_ref - logp = ln 2 at (2,0)
    (k3 = 2 - ln 2 - 1), 0 elsewhere; kl_coef 0.1, masked.
      micro_batch: 1/2 [ -1/1 + -(0.55 - 0.5)/2 ] + 0.1 * 1/2 [ 0/1 + k3/2 ] = -0.5125 + 0.025 k3
      mini_batch:  -(1 + 0.55 - 0.5)/3 + 0.1 * k3/3 = -0.35 + k3/30
    """
    valid = jnp.array([[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 1, 1]], jnp.float32)
    mask = jnp.array([[1, 0, 0], [0, 0, 0], [1, 0, 0], [1, 0, 0]], jnp.float32)
    adv = jnp.array([1.0, -1.0, 0.5, -0.5])
    logp = jnp.log(jnp.array([[0.5, 0.4, 0.3], [0.6, 0.2, 1.0], [0.3, 0.7, 0.8], [0.9, 0.1, 0.2]], jnp.float32))
    logp_old = logp.at[2, 0].add(-jnp.log(1.1))
    logp_ref = logp.at[2, 0].add(jnp.log(2.0))
    k3 = 2.0 - math.log(2.0) - 1.0
    cfg = LossSection(loss_agg="token-mean", normalize_over="selected", kl_coef=0.1, kl_masked=True,
                      normalize_scope="micro_batch")
    loss, m = mini_batch_loss(logp, logp_old, logp_ref, adv, valid, mask, config=cfg, micro_batches=2)
    np.testing.assert_allclose(float(loss), -0.5125 + 0.025 * k3, rtol=1e-6)
    np.testing.assert_allclose(float(m["loss/policy"]), -0.5125, rtol=1e-6)
    np.testing.assert_allclose(float(m["loss/kl"]), k3 / 4, rtol=1e-6)
    np.testing.assert_allclose(float(m["mask/selected_frac"]), 3 / 11, rtol=1e-6)  # over the mini-batch
    # d loss / d logp: -A r / (#M of its micro-batch * 2) (dual clip inactive at (3,0): max(-0.5, 3 A)), and the
    # KL's -(exp(d) - 1) * 0.1 / (2 * 2) at (2,0)
    g = jax.grad(lambda lp: mini_batch_loss(lp, logp_old, logp_ref, adv, valid, mask, config=cfg,
                                            micro_batches=2)[0])(logp)
    want = np.zeros((4, 3))
    want[0, 0], want[2, 0], want[3, 0] = -0.5, -0.5 * 1.1 / 4 - 0.1 / 4, 0.5 / 4
    np.testing.assert_allclose(np.asarray(g), want, rtol=1e-5, atol=1e-7)
    # the default, mini-batch denominators: one mean over the mini-batch's 3 selected tokens
    mini = LossSection(loss_agg="token-mean", normalize_over="selected", kl_coef=0.1, kl_masked=True)
    loss2, m2 = mini_batch_loss(logp, logp_old, logp_ref, adv, valid, mask, config=mini, micro_batches=2)
    np.testing.assert_allclose(float(loss2), -0.35 + k3 / 30, rtol=1e-6)
    whole, mw = policy_loss(logp, logp_old, logp_ref, adv, valid, mask, config=mini)
    np.testing.assert_allclose(float(loss2), float(whole), rtol=1e-6)
    for k in mw:
        np.testing.assert_allclose(float(m2[k]), float(mw[k]), rtol=1e-6, atol=1e-7, err_msg=k)
    # one micro-batch: both conventions are policy_loss on the whole, and the default path is policy_loss itself
    one, _ = mini_batch_loss(logp, logp_old, logp_ref, adv, valid, mask, config=cfg, micro_batches=1)
    assert float(one) == float(whole)
    d = loss_denominators(valid[:2], mask[:2], mini)
    a = micro_batch_loss(logp[:2], logp_old[:2], logp_ref[:2], adv[:2], valid[:2], mask[:2], config=mini, denoms=d,
                         micro_batches=2)
    b = policy_loss(logp[:2], logp_old[:2], logp_ref[:2], adv[:2], valid[:2], mask[:2], config=mini, denoms=d)
    assert jax.tree.map(float, a) == jax.tree.map(float, b)
    with pytest.raises(ValueError, match="micro_batches=3"):
        mini_batch_loss(logp, logp_old, logp_ref, adv, valid, mask, config=cfg, micro_batches=3)
