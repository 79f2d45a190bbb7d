"""The gradient-alignment check (``ict-jax align``): its measures against hand computations, each selector's
gradient against the train step's own gradient under that method (recorded by an optimizer that keeps it),
the lowest-p mask against a sort by hand, and the equal-reward groups dropped."""

from __future__ import annotations

import math
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import ict_jax
from ict_jax.config_load import load_config
from ict_jax.diagnostics.gradient_alignment import (
    DRAWS,
    SELECTORS,
    alignment,
    compiled_selector_fns,
    counted_groups,
    drop_equal_reward_groups,
    flat,
    format_alignment,
    read_draws,
    selector_masks,
)
from ict_jax.model.adapters import add_adapters
from ict_jax.model.config import LoraSpec
from ict_jax.rl.batch import RolloutBatch
from ict_jax.rl.group_stats import GroupStatsRequest, group_stats
from ict_jax.rl.losses import group_advantages
from ict_jax.rl.selectors import random_key
from ict_jax.rl.state import init_train_state, make_optimizer
from ict_jax.rl.train_step import StepPlan, make_train_step

P, G, LP, LR = 2, 4, 2, 10
MODEL = ict_jax.ModelConfig.tiny(num_layers=1, remat="none")


def test_the_measures_by_hand():
    # three batches of 2-dimensional gradients; the reference of batch b is the mean dense gradient of the others
    dense = [np.array([1.0, 0.0]), np.array([3.0, 2.0]), np.array([1.0, 4.0])]
    sparse = [np.array([0.0, -1.0]), np.array([2.0, 0.5]), np.array([-1.0, 1.0])]
    out = alignment({"dense": dense, "ict_aligned": sparse})
    # the references (means of the other two dense gradients): [2, 3], [1, 2], [2, 1]
    cos = [-3 / math.sqrt(13), (2 + 1) / (math.sqrt(5) * math.sqrt(4.25)), (-2 + 1) / math.sqrt(5 * 2)]
    # gain: <ref, sign(g)> / <ref, sign(ref)> = <ref, sign(g)> / |ref|_1
    gain = [-3 / 5, (1 + 2) / 3, (-2 + 1) / 3]
    assert out["per_batch"]["ict_aligned"]["cos"] == pytest.approx(cos, rel=1e-12)
    assert out["per_batch"]["ict_aligned"]["gain"] == pytest.approx(gain, rel=1e-12)
    dense_cos = [2 / math.sqrt(13), (3 + 4) / (math.sqrt(5) * math.sqrt(13)), (2 + 4) / (math.sqrt(5) * math.sqrt(17))]
    assert out["per_batch"]["dense"]["cos"] == pytest.approx(dense_cos, rel=1e-12)
    assert out["per_batch"]["dense"]["gain"] == pytest.approx([2 / 5, 1.0, 1.0], rel=1e-12)
    s = out["summary"]["ict_aligned"]["gain"]
    assert s["mean"] == pytest.approx(np.mean(gain)) and s["sd"] == pytest.approx(np.std(gain, ddof=1))
    assert s["se"] == pytest.approx(np.std(gain, ddof=1) / math.sqrt(3))
    (pc,) = [p for p in out["paired"] if p["measure"] == "cos"]
    d = np.array(cos) - np.array(dense_cos)
    assert (pc["selector"], pc["reference"]) == ("ict_aligned", "dense")
    assert pc["mean"] == pytest.approx(d.mean()) and pc["sd"] == pytest.approx(d.std(ddof=1))
    assert "| ict_aligned − dense | gain |" in format_alignment(out)
    with pytest.raises(ValueError, match="needs at least 2"):
        alignment({"dense": dense[:1]})


def _config(method: str):
    return load_config(None, [
        f"rl.selector.method={method}", f"rollout.num_samples={G}", f"train.prompts_per_step={P}",
        f"rollout.max_new_tokens={LR}", "rl.selector.warmup_steps=0", "stats.chunk=4", "rl.loss.kl_coef=0",
        "rl.selector.rho=0.2", "rl.selector.scope=sequence", "stats.u_form=aligned"])


def _batch() -> RolloutBatch:
    rng = np.random.default_rng(3)
    B = P * G
    tokens = rng.integers(3, MODEL.vocab_size, (B, LP + LR))
    am = np.ones((B, LP + LR), np.int32)
    rv = np.zeros((B, LR), np.float32)
    for i, n in enumerate([10, 7, 4, 9, 6, 10, 3, 8]):  # right-padded responses
        rv[i, :n] = 1
        am[i, LP + n:] = 0
    rewards = np.array([1, 0, 0, 1, 0, 1, 1, 0], np.float32)
    return RolloutBatch(
        tokens=jnp.asarray(tokens, jnp.int32), attention_mask=jnp.asarray(am), response_valid=jnp.asarray(rv),
        rewards=jnp.asarray(rewards), advantages=group_advantages(jnp.asarray(rewards), G),
        sampler_logp=jnp.zeros((B, LR)), truncated=jnp.zeros(B), row_valid=jnp.ones(B),
        correct=jnp.asarray(rewards))


def _recorded_gradient(cfg, state_params_seed=1):
    """The train step's exact gradient under ``cfg``'s method: an optimizer that keeps it as its state."""
    tx = optax.GradientTransformation(lambda p: jax.tree.map(jnp.zeros_like, p),
                                      lambda g, s, p=None: (jax.tree.map(jnp.zeros_like, g), g))
    state = init_train_state(cfg, ict_jax.init_model(MODEL, seed=state_params_seed), tx=tx)
    new, _ = make_train_step(cfg, tx=tx)(state, _batch())
    return new.opt_state


def test_each_selectors_gradient_is_the_train_steps_gradient_under_that_method():
    cfg = _config("dense")
    state = init_train_state(cfg, ict_jax.init_model(MODEL, seed=1))
    plan, model_def, batch = StepPlan.from_config(cfg, make_optimizer(cfg)), state.model_def(), _batch()
    valid = (batch.response_valid > 0).astype(jnp.float32)
    request = GroupStatsRequest(G, 1.0, 4, ("logp", "js"), ("aligned", "pooled"))
    # compiled as run_alignment compiles them (one program each; run op by op they took most of a minute)
    stats_fn, grads_fn = compiled_selector_fns(plan, request)
    stats = stats_fn(state.params, model_def, batch, valid)
    keys = [random_key(state.rng, 0, d) for d in (0, 1)]
    masks = selector_masks(stats, valid, rho=0.2, group_size=G, keys=keys)
    assert list(masks) == list(SELECTORS)
    grads = grads_fn(state.params, model_def, batch, valid, masks, state.rng, jnp.int32(0))
    # dense, ICT (aligned) and random (the random arm's own draw at step 0) as the train step computes them
    for selector, method in (("dense", "dense"), ("ict_aligned", "ict"), ("random_a", "random")):
        chex.assert_trees_all_close(grads[selector], _recorded_gradient(_config(method)), rtol=2e-5, atol=1e-7)
    # the second random draw is another mask of the same counts, so another gradient
    assert np.array_equal(np.asarray(masks["random_a"]).sum(1), np.asarray(masks["random_b"]).sum(1))
    assert not np.array_equal(np.asarray(masks["random_a"]), np.asarray(masks["random_b"]))
    # lowest-p: per response, the k = max(1, ceil(0.2 n)) positions of lowest p(o_t), ties to the lower position
    logp = np.asarray(stats["aligned"].logp)
    for i, n in enumerate(np.asarray(valid).sum(1).astype(int)):
        k = max(1, math.ceil(0.2 * n))
        want = np.zeros(LR)
        want[np.argsort(logp[i, :n], kind="stable")[:k]] = 1
        assert np.array_equal(np.asarray(masks["lowest_p"])[i], want), i
    # every selector's mask lies inside the valid tokens
    assert all(float(jnp.sum(m * (1 - valid))) == 0 for m in masks.values())


def test_a_lora_runs_frozen_base_is_an_input_of_the_programs_not_a_constant_in_them():
    # with the base captured (a closure over the ModelDef), lowering embeds every frozen weight as a constant:
    # 2.5 GB for the real 0.5B, warned by jax past its threshold; set here below the tiny base's bytes
    cfg = _config("dense")
    model = add_adapters(ict_jax.init_model(MODEL, seed=1), LoraSpec(rank=2, alpha=4, targets=("q_proj",)), seed=1)
    state = init_train_state(cfg, model)
    assert state.frozen is not None
    base_bytes = sum(x.nbytes for x in jax.tree.leaves(state.frozen))
    plan, model_def, batch = StepPlan.from_config(cfg, make_optimizer(cfg)), state.model_def(), _batch()
    valid = (batch.response_valid > 0).astype(jnp.float32)
    stats_fn, grads_fn = compiled_selector_fns(plan, GroupStatsRequest(G, 1.0, 4, ("logp", "js"), ("aligned",)))
    masks = {s: valid for s in SELECTORS}
    before = jax.config.jax_captured_constants_warn_bytes
    jax.config.update("jax_captured_constants_warn_bytes", base_bytes // 4)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="A large amount of constants")
            stats_fn.lower(state.params, model_def, batch, valid)
            grads_fn.lower(state.params, model_def, batch, valid, masks, state.rng, jnp.int32(0))
            with pytest.raises(UserWarning, match="A large amount of constants"):  # the check can fail
                jax.jit(lambda p, b, v: group_stats(p, model_def, b.tokens, b.attention_mask, v,
                                                    GroupStatsRequest(G, 1.0, 4, ("logp",), ("aligned",)))
                        ).lower(state.params, batch, valid)
    finally:
        jax.config.update("jax_captured_constants_warn_bytes", before)


def test_groups_whose_rewards_are_all_equal_are_dropped():
    batch = _batch()
    equal = batch.replace(rewards=batch.rewards.at[4:].set(1.0))
    dropped, kept = drop_equal_reward_groups(equal, G)
    assert kept == 1 and np.asarray(dropped.row_valid).tolist() == [1, 1, 1, 1, 0, 0, 0, 0]
    same, kept = drop_equal_reward_groups(batch, G)
    assert kept == 2 and np.asarray(same.row_valid).tolist() == [1] * 8


def test_the_gradients_on_the_counted_groups_rows_alone_are_the_masked_full_batchs():
    cfg = _config("dense")
    state = init_train_state(cfg, ict_jax.init_model(MODEL, seed=1))
    plan, model_def = StepPlan.from_config(cfg, make_optimizer(cfg)), state.model_def()
    batch, kept = drop_equal_reward_groups(_batch().replace(rewards=_batch().rewards.at[:4].set(0.0)), G)
    assert kept == 1  # the first group's rewards are all equal: out
    valid = ((batch.response_valid > 0) & (batch.row_valid[:, None] > 0)).astype(jnp.float32)
    stats_fn, grads_fn = compiled_selector_fns(plan, GroupStatsRequest(G, 1.0, 4, ("logp", "js"), ("aligned", "pooled")))
    keys = [random_key(state.rng, 0, d) for d in (0, 1)]
    masks = selector_masks(stats_fn(state.params, model_def, batch, valid), valid, rho=0.2, group_size=G, keys=keys)
    sub, sub_valid, sub_masks = counted_groups(batch, valid, masks, G)
    assert sub.tokens.shape[0] == G and np.array_equal(np.asarray(sub.tokens), np.asarray(batch.tokens[G:]))
    assert all(np.array_equal(np.asarray(sub_masks[s]), np.asarray(masks[s][G:])) for s in SELECTORS)
    full = grads_fn(state.params, model_def, batch, valid, masks, state.rng, jnp.int32(0))
    cut = grads_fn(state.params, model_def, sub, sub_valid, sub_masks, state.rng, jnp.int32(0))
    for s in SELECTORS:
        assert float(np.abs(flat(full[s])).max()) > 0, s  # a gradient, not zeros equal to zeros
        chex.assert_trees_all_close(cut[s], full[s], rtol=2e-5, atol=1e-7)
    # every group counted: the batch as it is
    whole = _batch()
    assert counted_groups(whole, valid, masks, G)[0] is whole


def test_the_journal_drops_a_line_a_kill_cut_and_refuses_a_kept_batch_without_its_gradients(tmp_path):
    import json

    (tmp_path / "grads").mkdir()
    for s in SELECTORS:
        np.save(tmp_path / "grads" / f"00_{s}.npy", np.zeros(3, np.float32))
    lines = [{"step": 0, "kept": None, "iterator": {"i": 1}},
             {"step": 1, "kept": {"batch": 0, "step": 1}, "iterator": {"i": 2}}]
    (tmp_path / DRAWS).write_text("".join(json.dumps(d) + "\n" for d in lines) + '{"step": 2, "ke')
    assert read_draws(tmp_path) == lines
    (tmp_path / "grads" / "00_lowest_p.npy").unlink()
    with pytest.raises(ValueError, match=r"batch 0's gradients \['lowest_p'\] are missing"):
        read_draws(tmp_path)
    (tmp_path / DRAWS).write_text("not json\n" + json.dumps(lines[0]) + "\n")
    with pytest.raises(ValueError, match=r"draws.jsonl:1: not a JSON line"):
        read_draws(tmp_path)
    assert read_draws(tmp_path / "nothing") == []


REWARD = """\
def by_length(response, gold, meta):
    return float(len(response.strip()) % 3) / 2.0
"""


@pytest.mark.e2e
def test_the_check_runs_on_a_runs_own_rollouts_and_writes_its_report(tmp_path, monkeypatch, capfd):
    from pathlib import Path

    from ict_jax.cli.main import main as cli_main
    from ict_jax.diagnostics.gradient_alignment import run_alignment

    (tmp_path / "align_reward_t1.py").write_text(REWARD)
    monkeypatch.chdir(tmp_path)  # the reward workers import rl.reward.fn from the working directory
    demo = Path(__file__).resolve().parents[2] / "configs" / "demo.yaml"
    cfg = load_config(demo, [
        "model.preset=tiny", "rollout.num_samples=4", "train.prompts_per_step=2", "rollout.max_new_tokens=6",
        "rollout.max_prompt_len=16", "train.sft_steps=0", 'data.train=["arith?digits=1&size=64"]', "stats.chunk=8",
        "rl.reward.workers=1", "rl.reward.fn=align_reward_t1:by_length", "data.eval=[]", "mesh.data=2",
        "mesh.tensor=4"])
    said: list[str] = []
    monkeypatch.setenv("ICT_JAX_HEARTBEAT_S", "0.2")  # a run's heartbeat would print within the check
    out = run_alignment(cfg, batches=3, out=tmp_path / "align", say=said.append)
    monkeypatch.delenv("ICT_JAX_HEARTBEAT_S")
    assert " steps " not in capfd.readouterr().err  # the sampler's run trains nothing: its logger is closed
    assert out["batches"] == 3 and [b["batch"] for b in out["batches_info"]] == [0, 1, 2]
    assert set(out["summary"]) == set(SELECTORS) and len(list((tmp_path / "align" / "grads").glob("*.npy"))) == 18
    sel = out["batches_info"][0]["selected"]
    assert sel["dense"] == out["batches_info"][0]["valid_tokens"] > sel["ict_aligned"] == sel["random_a"] > 0
    assert any(s.startswith("batch 3/3 (step ") for s in said), said
    assert (tmp_path / "align" / "alignment.md").read_text().startswith("Batches: 3.")
    # the same folder again: one line, exit 2, nothing overwritten; --resume of a finished check: exit 0
    assert cli_main(["align", "--config", str(demo), "--out", str(tmp_path / "align")]) == 2
    assert cli_main(["align", "--config", str(demo), "--out", str(tmp_path / "align"), "--resume"]) == 0
    assert cli_main(["align", "--config", str(demo), "--out", str(tmp_path / "none"), "--resume"]) == 2

    # the same check in chunks (a time box stops it after each first batch; the journal goes on): bit for bit
    from ict_jax.diagnostics.gradient_alignment import AlignmentStopped

    chunked = tmp_path / "chunked"
    with pytest.raises(AlignmentStopped):
        run_alignment(cfg, batches=3, out=chunked, say=said.append, max_hours=1e-9)
    assert cli_main(["align", "--config", str(demo), "--out", str(chunked)]) == 2  # unfinished: --resume
    with pytest.raises(AlignmentStopped):
        run_alignment(cfg, batches=3, out=chunked, say=said.append, max_hours=1e-9, resume=True)
    assert len(list((chunked / "grads").glob("*.npy"))) == 12
    again = run_alignment(cfg, batches=3, out=chunked, say=said.append, resume=True)
    for b in range(3):
        for s in SELECTORS:
            name = f"{b:02d}_{s}.npy"
            assert np.array_equal(np.load(chunked / "grads" / name), np.load(tmp_path / "align" / "grads" / name))
    assert again["per_batch"] == out["per_batch"] and again["paired"] == out["paired"]
    assert [{k: v for k, v in b.items() if k != "seconds"} for b in again["batches_info"]] == \
        [{k: v for k, v in b.items() if k != "seconds"} for b in out["batches_info"]]
