"""The pre-registered experiment (``ict-jax compare --plan``): the plan's checks, a run interrupted and
continued ending bitwise equal to one never stopped, the refusals (a changed plan, an uncommitted plan, a
second invocation), the paired statistics against hand computations, the report rebuilt from the
record byte for byte, and branched arms (started from their parent's checkpoint, resumed bitwise)."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
from pathlib import Path

import chex
import jax
import numpy as np
import pytest

from ict_jax.cli.main import main as cli_main
from ict_jax.outputs import OutputInUse, hold_output_dir
from ict_jax.tools import experiment
from ict_jax.tools.experiment import ExperimentStopped, rebuild_report, run_experiment
from ict_jax.tools.experiment_box import TimeBox
from ict_jax.tools.experiment_plan import Outcome, PlanError, load_plan, plan_runs
from ict_jax.tools.experiment_record import RECORD_FILE, build_record, outcome_value
from ict_jax.tools.experiment_report import FIGURES, REPORT_FILE
from ict_jax.tools.experiment_stats import (
    betainc,
    chi2_quantile,
    gammainc,
    mean_sd,
    minimum_detectable_effect,
    paired_differences,
    sd_interval,
    seeds_needed,
    t_cdf,
    t_quantile,
)
from ict_jax.train.logs import read_metrics

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "configs" / "demo.yaml"

# a tiny model from its preset, 2 prompts x G 4, 6 new tokens; a reward by the response's length gives the random
# model's groups different rewards, so that the updates are not zero (REWARD_MODULE, imported by the reward workers)
PLAN = """\
name: tiny
description: two arms on the tiny model
config: {config}
overrides:
  model.preset: tiny
  rollout.num_samples: 4
  train.prompts_per_step: 2
  rollout.max_new_tokens: 6
  rollout.max_prompt_len: 16
  train.sft_steps: 0
  data.train: ["arith?digits=1&size=64"]
  data.eval: ["arith?digits=1&size=4&seed=7"]
  data.eval_n: 2
  data.eval_k: [1, 2]
  stats.chunk: 8
  rl.reward.workers: 1
  rl.reward.fn: experiment_reward_t32:by_length
  rl.selector.warmup_steps: 0
  train.save_every: 2
  mesh.data: 2
  mesh.tensor: 4
arms:
  ict: {{method: ict}}
  grpo: {{method: grpo}}
seeds: [0]
steps: 3
chunk_steps: 2
reference_arms: [grpo]
primary_outcome: {{metric: reward/mean, steps: [2, 3]}}
secondary_outcomes:
  - {{metric: grad/norm, steps: [1, 1]}}
  - {{metric: eval/pass@1}}
design: {{assumed_sd: 0.05}}
stopping_rule: every run trains all 3 steps
out: {out}
"""


REWARD_MODULE = """\
def by_length(response, gold, meta):
    return float(len(response.strip()) % 3) / 2.0
"""


@pytest.fixture
def reward_module(tmp_path, monkeypatch):
    (tmp_path / "experiment_reward_t32.py").write_text(REWARD_MODULE)
    monkeypatch.chdir(tmp_path)  # the reward workers import rl.reward.fn from the caller's working directory


def _plan(tmp_path: Path, name: str, text: str | None = None, **fmt) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(text if text is not None else PLAN.format(config=DEMO, out=tmp_path / name, **fmt))
    return path


def _keep(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(("time/", "throughput/"))}


def _final_params(run: Path):
    from flax import nnx

    from ict_jax.train.model_source import resolve_model

    source = resolve_model(run / "checkpoints", checkpoint=True)
    model, meta = source.load(), source.meta
    return meta["step"], jax.tree.map(np.asarray, nnx.state(model, nnx.Param))


# ------------------------------------------------------------------------------------------------
# The statistics, by hand
# ------------------------------------------------------------------------------------------------
def test_t_distribution_against_closed_forms_and_tables():
    for t in (0.0, 0.3, 1.0, 2.5, 12.7):
        assert t_cdf(t, 1) == pytest.approx(0.5 + math.atan(t) / math.pi, abs=1e-12)  # Cauchy
        assert t_cdf(t, 2) == pytest.approx(0.5 + t / (2 * math.sqrt(2 + t * t)), abs=1e-12)
        assert t_cdf(-t, 3) == pytest.approx(1 - t_cdf(t, 3), abs=1e-12)
    # printed t tables: t_{0.975} for df 1, 2, 10, 30; t_{0.8} for df 1
    for q, df, want in ((0.975, 1, 12.7062), (0.975, 2, 4.3027), (0.975, 10, 2.2281), (0.975, 30, 2.0423),
                        (0.8, 1, 1.3764)):
        assert t_quantile(q, df) == pytest.approx(want, abs=1e-4)
    assert t_quantile(0.025, 4) == pytest.approx(-t_quantile(0.975, 4))
    assert betainc(2, 3, 0.4) == pytest.approx(0.5248, abs=1e-12)  # 1 - sum_{j<2} C(4,j) .4^j .6^(4-j)
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
    for x in (0.1, 1.0, 2.0, 7.5, 40.0):
        assert gammainc(1, x) == pytest.approx(1 - math.exp(-x), abs=1e-14)  # exponential
        assert gammainc(0.5, x) == pytest.approx(math.erf(math.sqrt(x)), abs=1e-14)  # chi2 with df 1
        assert gammainc(2, x) == pytest.approx(1 - math.exp(-x) * (1 + x), abs=1e-14)
    assert gammainc(3, 0.0) == 0.0 and gammainc(3, math.inf) == 1.0
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


def test_the_report_plans_a_next_design_from_the_primary_outcomes_observed_spread():
    from ict_jax.tools.experiment_report import _planning_lines

    paired = [{"arm": "ict", "reference": "grpo", "sd": 0.04, "df": 1},
              {"arm": "random", "reference": "grpo", "sd": None, "df": 1}]
    record = {"design": {"alpha": 0.05, "power": 0.8, "n_seeds": 2, "df": 1},
              "outcomes": [{"name": "other", "primary": False, "paired": []},
                           {"name": "reward steps 21-40", "primary": True, "paired": paired}]}
    text = "\n".join(_planning_lines(record))
    hi = 0.04 / math.sqrt(chi2_quantile(0.025, 1))
    mdes = [minimum_detectable_effect(0.04, n) for n in (5, 10, 20)] + [minimum_detectable_effect(hi, 20)]
    # MDE at 5 seeds by hand: (t_{0.975,4} + t_{0.8,4}) 0.04 / sqrt 5 = (2.7764 + 0.9410) 0.04 / 2.2361 = 0.0665
    assert f"{mdes[0]:.3f}" == "0.066"
    assert ("| ict − grpo | 0.040 (1) | 0.018 – 1.276 | " + " | ".join(f"{m:.3f}" for m in mdes) + " |") in text
    assert "| random − grpo | n/a | n/a | n/a | n/a | n/a | n/a |" in text
    assert "(reward steps 21-40)" in text and "a factor of 71.5 apart" in text
    record["design"].update(n_seeds=1, df=None)
    assert "One seed: no paired differences" in "\n".join(_planning_lines(record))


def test_outcome_values_from_rows_and_evaluations():
    rows = [{"step": s, "reward/mean": v} for s, v in enumerate([0.0, 0.5, 1.0, "nan"])]
    assert outcome_value(Outcome("reward/mean", 2, 3), rows, None) == pytest.approx(0.75)  # steps 2-3 = rows 1, 2
    assert outcome_value(Outcome("reward/mean", 3, 4), rows, None) == pytest.approx(1.0)  # "nan" left out
    assert outcome_value(Outcome("reward/mean", 4, 5), rows, None) is None  # step 5 not logged yet
    ev = {"eval/a/pass@1": 0.2, "eval/b/pass@1": 0.4, "eval/a/pass@2": 0.5}
    assert outcome_value(Outcome("eval/pass@1"), rows, ev) == pytest.approx(0.3)
    assert outcome_value(Outcome("eval/a/pass@2"), rows, ev) == 0.5
    assert outcome_value(Outcome("eval/pass@1"), rows, None) is None


def test_record_outcomes_and_paired_differences_from_run_directories(tmp_path):
    """build_record reads run directories alone: per-arm mean ± sd and arm − reference by seed, by hand."""
    text = PLAN.format(config=DEMO, out=tmp_path / "x").replace("seeds: [0]", "seeds: [0, 1]")
    text = text.replace("arms:\n", "arms:\n  random: {method: random}\n")
    text = text.replace("reference_arms: [grpo]", "reference_arms: [grpo, random]")
    plan = load_plan(_plan(tmp_path, "x", text))
    rewards = {("ict", 0): [0.1, 0.5, 0.7], ("ict", 1): [0.2, 0.6, 0.6], ("grpo", 0): [0.1, 0.2, 0.4],
               ("grpo", 1): [0.2, 0.4, 0.4], ("random", 0): [0.1, 0.3, 0.3]}  # random s1 never started
    for (arm, seed), rs in rewards.items():
        d = plan.out / "runs" / f"{arm}_s{seed}"
        d.mkdir(parents=True)
        (d / "metrics.jsonl").write_text("".join(json.dumps({"phase": "rl", "step": s, "reward/mean": r,
                                                             "grad/norm": 1.0 + s + seed}) + "\n"
                                                 for s, r in enumerate(rs)))
        (d / "summary.json").write_text(json.dumps({"status": "finished", "steps": 3,
                                                    "eval_final": {"eval/e/pass@1": 0.25 * (seed + 1)}}))
    rec = build_record(plan, plan_info={"sha256": plan.sha256, "text": plan.text})
    prim = rec["outcomes"][0]
    assert prim["primary"] and prim["name"] == "reward/mean steps 2-3"
    # per run: the mean over steps 2-3 (rows 1 and 2)
    assert prim["per_arm"]["ict"]["values"] == {"0": pytest.approx(0.6), "1": pytest.approx(0.6)}
    assert prim["per_arm"]["grpo"]["values"] == {"0": pytest.approx(0.3), "1": pytest.approx(0.4)}
    assert prim["per_arm"]["random"]["values"] == {"0": pytest.approx(0.3), "1": None}
    assert prim["per_arm"]["grpo"]["mean"] == pytest.approx(0.35)
    assert prim["per_arm"]["grpo"]["sd"] == pytest.approx(math.sqrt(0.005))
    by = {(p["arm"], p["reference"]): p for p in prim["paired"]}
    assert set(by) == {("ict", "grpo"), ("random", "grpo"), ("ict", "random"), ("grpo", "random")}
    d = by[("ict", "grpo")]  # 0.3, 0.2 -> mean 0.25, sd 0.0707, t = 0.25 / 0.05 = 5, df 1
    assert d["diffs"] == pytest.approx([0.3, 0.2]) and d["mean"] == pytest.approx(0.25)
    assert d["t"] == pytest.approx(5.0) and d["df"] == 1
    assert d["p"] == pytest.approx(1 - 2 * math.atan(5.0) / math.pi)
    assert by[("ict", "random")]["n"] == 1 and by[("ict", "random")]["t"] is None  # seed 1 unpaired
    grad = rec["outcomes"][1]  # grad/norm at step 1: 1 + seed
    assert grad["per_arm"]["ict"]["values"] == {"0": 1.0, "1": 2.0}
    ev = rec["outcomes"][2]
    assert ev["per_arm"]["grpo"]["values"] == {"0": 0.25, "1": 0.5}
    assert rec["status"] == {"complete": False, "runs": 6, "runs_finished": 5, "steps_done": 15,
                             "steps_planned": 18}
    assert rec["design"]["mde"] == pytest.approx(minimum_detectable_effect(0.05, 2))


def test_record_and_report_show_the_selected_fraction_and_warn_when_a_sparse_arm_selected_everything(tmp_path):
    """The hand case of a short plan: STAPO silenced no token (its curve is GRPO's), an ICT arm's 5-step warm-up
    covered all 3 steps; the record holds each run's selection, the report shows it and warns about both."""
    text = PLAN.format(config=DEMO, out=tmp_path / "s")
    text = text.replace("arms:\n", "arms:\n  stapo: {method: stapo}\n"
                        "  ict_warm: {method: ict, overrides: {rl.selector.warmup_steps: 5}}\n")
    plan = load_plan(_plan(tmp_path, "s", text))
    fracs = {"ict": [0.1, 0.12, 0.14], "grpo": [1.0] * 3, "stapo": [1.0] * 3, "ict_warm": [1.0] * 3}
    for arm, fs in fracs.items():
        d = plan.out / "runs" / f"{arm}_s0"
        d.mkdir(parents=True)
        (d / "metrics.jsonl").write_text("".join(json.dumps({"phase": "rl", "step": s, "reward/mean": 0.5,
                                                             "mask/selected_frac": f}) + "\n"
                                                 for s, f in enumerate(fs)))
        (d / "summary.json").write_text(json.dumps({"status": "finished", "steps": 3,
                                                    "eval_final": {"eval/e/pass@1": 0.5}}))
    rec = build_record(plan, plan_info={"sha256": plan.sha256, "text": plan.text})
    sel = {name: r["selection"] for name, r in rec["runs"].items()}
    assert sel["ict_s0"] == {"selected_frac": pytest.approx(0.12), "sparse_steps": 3, "dense_steps": 0, "steps": 3,
                             "all_selected": False}
    assert sel["stapo_s0"]["all_selected"] and sel["grpo_s0"]["all_selected"]  # grpo: by design, no warning
    assert sel["ict_warm_s0"] == {"selected_frac": None, "sparse_steps": 0, "dense_steps": 5, "steps": 3,
                                  "all_selected": True}
    from ict_jax.tools.experiment_report import format_report, selection_warnings

    warnings = selection_warnings(json.loads(json.dumps(rec)))
    assert [w.split(" (")[0] for w in warnings] == ["WARNING: stapo", "WARNING: ict_warm"]
    assert "selected fraction 1.000 on every one of its 3 sparse step(s)" in warnings[0]
    assert "every RL step inside the dense warm-up (rl.selector.warmup_steps 5)" in warnings[1]
    md = format_report(json.loads(json.dumps(rec)))
    assert all(f"- **{w}**" in md for w in warnings)
    lines = md.splitlines()
    runs = lines.index("## Runs")
    head = [c.strip() for c in lines[runs + 2].strip("|").split("|")]
    col = head.index("selected (sparse steps)")
    cells = {r[0]: r[col] for r in ([c.strip() for c in line.strip("|").split("|")] for line in lines[runs + 4:runs + 8])}
    assert cells == {"stapo_s0": "1.000 (3) (all)", "ict_warm_s0": "n/a (all 3 in warm-up)", "ict_s0": "0.120 (3)",
                     "grpo_s0": "1.000 (3)"}
    ev = lines.index("## Held-out evaluation")
    assert lines[ev + 2] == "| model | P@1 | selected (after warm-up) |"
    assert lines[ev + 4:ev + 8] == ["| stapo | 0.500 (n 1) | 1.000 (n 1) (all: seed 0) |",
                                    "| ict_warm | 0.500 (n 1) | n/a (all: seed 0) |",
                                    "| ict | 0.500 (n 1) | 0.120 (n 1) |", "| grpo | 0.500 (n 1) | 1.000 (n 1) |"]


# ------------------------------------------------------------------------------------------------
# The plan's checks
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("edit, message", [
    (("steps: 3", "steps: 0"), "steps: expected an integer >= 1"),
    (("seeds: [0]", "seeds: [0, 0]"), "seeds: [0, 0]: expected distinct"),
    (("reference_arms: [grpo]", "reference_arms: [dense]"), "reference_arms: ['dense']"),
    (("steps: [2, 3]", "steps: [2, 4]"), "primary_outcome.steps: [2, 4]: need 1 <= first <= last <= steps (3)"),
    (("  grpo: {method: grpo}", "  grpo: {method: grpo, overrides: {seed: 3}}"),
     "arms.grpo.overrides.seed: the plan sets this itself"),
    (("  grpo: {method: grpo}", "  grpo: {method: grpo, overrides: {rl.loss.kl_coef: -1}}"), "arms.grpo: "),
    (("  grpo: {method: grpo}", "  grpo: {method: nope}"), "arms.grpo: "),
    (("stopping_rule: every run trains all 3 steps", "stopping_rule: ''"), "stopping_rule: state the rule"),
    (("chunk_steps: 2", "chunk_size: 2"), "chunk_size: unknown key"),
    (("  - {metric: eval/pass@1}", "  - {metric: eval/pass@1, steps: [1, 1]}"), "an evaluation outcome (eval/...) has no steps"),
    (("name: tiny", "name: 'a b'"), "name: 'a b': letters, digits"),
])
def test_a_plan_that_cannot_run_is_one_line_naming_the_key(tmp_path, edit, message):
    text = PLAN.format(config=DEMO, out=tmp_path / "p")
    assert edit[0] in text
    with pytest.raises(PlanError, match=None) as err:
        load_plan(_plan(tmp_path, "p", text.replace(edit[0], edit[1], 1)))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_runs_have_their_own_directories_and_share_the_seed(tmp_path):
    plan = load_plan(_plan(tmp_path, "p"))
    specs = plan_runs(plan)
    assert [s.name for s in specs] == ["ict_s0", "grpo_s0"]
    assert len({s.run_dir for s in specs}) == len(specs)
    assert {s.config.seed for s in specs} == {0} and {s.config.train.steps for s in specs} == {3}
    assert [s.config.rl.selector.method for s in specs] == ["ict", "grpo"]
    assert plan.chunk_ends() == [2, 3]


# ------------------------------------------------------------------------------------------------
# Running: interrupted and continued = never stopped; refusals; the report from the record
# ------------------------------------------------------------------------------------------------
def test_interrupted_and_continued_ends_bitwise_equal_and_the_report_rebuilds(tmp_path, reward_module):
    # never paused: the plan in one chunk a run
    whole = _plan(tmp_path, "whole", PLAN.format(config=DEMO, out=tmp_path / "whole").replace("chunk_steps: 2",
                                                                                             "chunk_steps: 3"))
    said = []
    run_experiment(whole, progress=False, say=said.append)
    # the progress lines: ict's chunk ends its run with its evaluation, timed apart from its steps; the ETA
    # counts grpo's 3 steps and its evaluation at the times measured
    ict_line, grpo_line = [ln for ln in said if ln.startswith(("ict s0: steps", "grpo s0: steps"))]
    assert ict_line.startswith("ict s0: steps 1-3 of 3 finished in ") and " (evaluation " in ict_line, said
    assert "; 3/6 steps done, ETA " in ict_line and ict_line.endswith(" + 1 evaluation x " + ict_line.split(
        " (evaluation ")[1].split(")")[0] + ")"), said
    assert grpo_line.endswith("; 6/6 steps done"), said
    # in chunks of 2, stopped after its first step (as the time box stops), then continued
    cut = _plan(tmp_path, "cut")
    calls = []

    def stop_once() -> bool:
        calls.append(1)
        return len(calls) == 2  # asked before the first chunk, then after step 1

    with pytest.raises(ExperimentStopped):
        run_experiment(cut, progress=False, should_stop=stop_once, say=lambda s: None)
    rec = json.loads((tmp_path / "cut" / RECORD_FILE).read_text())
    assert rec["runs"]["ict_s0"]["steps_done"] == 1 and rec["runs"]["grpo_s0"]["status"] == "pending"
    assert rec["invocations"][0]["stopped"] == "stop requested"
    run_experiment(cut, progress=False, say=lambda s: None)
    for name in ("ict_s0", "grpo_s0"):
        a, b = tmp_path / "whole" / "runs" / name, tmp_path / "cut" / "runs" / name
        ra, rb = read_metrics(a / "metrics.jsonl"), read_metrics(b / "metrics.jsonl")
        assert [r["step"] for r in ra] == [r["step"] for r in rb] == [0, 1, 2]
        assert [_keep(r) for r in ra] == [_keep(r) for r in rb]
        (sa, pa), (sb, pb) = _final_params(a), _final_params(b)
        assert sa == sb == 3
        chex.assert_trees_all_equal(pa, pb)
    # arms of one seed share the rollouts of step 0 (same data, sampler key and initial weights) ...
    r0 = [read_metrics(tmp_path / "whole" / "runs" / n / "metrics.jsonl")[0] for n in ("ict_s0", "grpo_s0")]
    assert r0[0]["reward/mean"] == r0[1]["reward/mean"] and r0[0]["response/length_mean"] == r0[1]["response/length_mean"]
    # ... and ICT trains on a tenth of their tokens, GRPO on all, from nonzero gradients
    assert r0[0]["mask/selected_frac"] < 0.5 and r0[1]["mask/selected_frac"] == 1.0
    assert r0[0]["grad/norm"] > 0 and r0[1]["grad/norm"] > 0 and r0[0]["grad/norm"] != r0[1]["grad/norm"]
    # the record: both runs, their chunks, two invocations of the cut experiment
    rec = json.loads((tmp_path / "cut" / RECORD_FILE).read_text())
    assert rec["status"]["complete"] and [len(r["chunks"]) for r in rec["runs"].values()] == [3, 2]
    assert [len(r["chunks"]) for r in json.loads((tmp_path / "whole" / RECORD_FILE).read_text())["runs"].values()] \
        == [1, 1]
    assert [i["stopped"] for i in rec["invocations"]] == ["stop requested", "finished"]
    assert rec["plan_sha256"] == load_plan(cut).sha256 and rec["plan_git"]["in_git"] is False
    assert rec["outcomes"][1]["per_arm"]["ict"]["values"]["0"] == pytest.approx(r0[0]["grad/norm"])
    # the report rebuilt from the record alone is byte-identical (figures included)
    folder = tmp_path / "cut"
    before = {f: (folder / f).read_bytes() for f in [REPORT_FILE, *FIGURES]}
    for f in before:
        (folder / f).unlink()
    rebuild_report(cut)
    assert {f: (folder / f).read_bytes() for f in before} == before
    assert "ict − grpo" in before[REPORT_FILE].decode()
    # finished: running it again trains nothing and changes no result
    run_experiment(cut, progress=False, say=lambda s: None)
    assert json.loads((folder / RECORD_FILE).read_text())["runs"] == rec["runs"]


def test_the_runner_starts_no_last_step_whose_evaluation_would_end_past_the_box(tmp_path, reward_module,
                                                                                monkeypatch):
    """On a virtual clock (a step 100 s, an evaluation 500 s, a box of 1000 s): ict trains both steps and is
    evaluated (the first piece of work always runs; no pace is known before it), grpo's first step ends at
    700 s and its last step with its evaluation is expected to take 500 s more (no step's time is measured
    yet: that is the time between two steps of one run), so grpo pauses after step 1 although the box still
    had 300 s left; the next invocation finishes it."""
    class Virtual(TimeBox):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.now = self.deadline - 1000.0
            self.clock = lambda: self.now

        def step_done(self):
            self.now += 100.0
            super().step_done()

        def evaluation_done(self, seconds):
            assert seconds is not None and seconds > 0  # the run's own evaluation time was read
            self.now += 500.0
            super().evaluation_done(500.0)

    monkeypatch.setattr(experiment, "TimeBox", Virtual)
    text = (PLAN.format(config=DEMO, out=tmp_path / "box").replace("steps: 3\nchunk_steps: 2", "steps: 2\nchunk_steps: 2")
            .replace("steps: [2, 3]", "steps: [1, 2]").replace("all 3 steps", "all 2 steps"))
    path = _plan(tmp_path, "box", text)
    said = []
    with pytest.raises(ExperimentStopped, match="time box"):
        run_experiment(path, max_hours=1000.0 / 3600, progress=False, say=said.append)
    rec = json.loads((tmp_path / "box" / RECORD_FILE).read_text())
    assert rec["runs"]["ict_s0"]["status"] == "finished" and rec["runs"]["grpo_s0"]["steps_done"] == 1, said
    assert rec["invocations"][0]["stopped"] == "time box"
    monkeypatch.setattr(experiment, "TimeBox", TimeBox)
    run_experiment(path, progress=False, say=lambda s: None)
    rec = json.loads((tmp_path / "box" / RECORD_FILE).read_text())
    assert rec["status"]["complete"] and rec["runs"]["grpo_s0"]["steps_done"] == 2


def _eval_json(run: Path) -> dict:
    res = json.loads((run / "eval" / "step_000003.json").read_text())
    for b in res["benchmarks"].values():
        b.pop("seconds")
    return res


def test_an_evaluation_batch_is_kept_and_a_run_stopped_in_its_evaluation_evaluates_again(tmp_path, reward_module):
    """--eval-batch sets every run's data.eval_batch (recorded, kept by the next invocation, refused once an
    evaluation used another); a run killed in its final evaluation (its last checkpoint written, no summary)
    is evaluated when the experiment continues, ending as the run that was never stopped."""
    path = _plan(tmp_path, "b", PLAN.format(config=DEMO, out=tmp_path / "b").replace("chunk_steps: 2",
                                                                                    "chunk_steps: 3"))
    with pytest.raises(PlanError, match=r"eval_batch: data.eval_batch: 3 prompts cannot be split over the mesh's "
                                        r"data x fsdp = 2 x 1"):
        run_experiment(path, progress=False, say=lambda s: None, eval_batch=3)
    assert not (tmp_path / "b" / "invocations.jsonl").exists()  # refused before anything was recorded
    run_experiment(path, progress=False, say=lambda s: None, eval_batch=4)
    folder, run = tmp_path / "b", tmp_path / "b" / "runs" / "ict_s0"
    rec = json.loads((folder / RECORD_FILE).read_text())
    assert rec["invocations"][0]["eval_batch"] == 4
    assert all(json.loads((folder / "runs" / n / "config.json").read_text())["data"]["eval_batch"] == 4
               for n in ("ict_s0", "grpo_s0"))
    report = (folder / REPORT_FILE).read_text()
    assert "evaluation batch 4 prompts a sampler call" in report
    from ict_jax.config import load_config
    from ict_jax.train.programs import sampler_prompts

    cfg = load_config(None, base=json.loads((run / "config.json").read_text()))
    assert sampler_prompts("eval", cfg) == 4 and sampler_prompts("eval", cfg.replace(**{"data.eval_batch": None})) == 2
    evaluated, summary = _eval_json(run), json.loads((run / "summary.json").read_text())
    # killed in its final evaluation: its checkpoint of step 3 is there, its evaluation and summary are not
    for f in ("step_000003.json", "step_000003.jsonl"):
        (run / "eval" / f).unlink()
    rows = [x for x in (run / "metrics.jsonl").read_text().splitlines() if json.loads(x)["phase"] != "eval"]
    (run / "metrics.jsonl").write_text("".join(x + "\n" for x in rows))
    (run / "summary.json").write_text(json.dumps({k: v for k, v in summary.items()
                                                  if k not in ("final", "eval_final")} | {"status": "running"}))
    said = []
    run_experiment(path, progress=False, say=said.append)  # no --eval-batch: the experiment's is kept
    assert any("evaluation batch 4 prompts a sampler call, as an earlier invocation set" in x for x in said), said
    assert any(x.startswith("ict s0: after step 3 of 3 finished in ") for x in said), said
    again = json.loads((run / "summary.json").read_text())
    assert _eval_json(run) == evaluated and again["status"] == "finished"
    assert again["final"] == summary["final"] and again["eval_final"] == summary["eval_final"]
    rec2 = json.loads((folder / RECORD_FILE).read_text())
    assert rec2["status"]["complete"] and rec2["runs"]["ict_s0"]["eval_final"] == rec["runs"]["ict_s0"]["eval_final"]
    assert rec2["invocations"][1]["eval_batch"] == 4
    with pytest.raises(PlanError, match=r"ict_s0 was evaluated with data.eval_batch=4, this invocation would "
                                        r"evaluate with 2: .* pass --eval-batch 4"):
        run_experiment(path, progress=False, say=lambda s: None, eval_batch=2)


@pytest.mark.e2e
def test_the_base_model_is_evaluated_last_like_the_runs_and_recorded(tmp_path, reward_module):
    """evaluation.base with LoRA (the pilot's design): after every run, the starting model (fresh adapters, 0
    RL steps) is evaluated once in runs/base with the experiment's evaluation batch; the record and the report
    hold its result, it equals the evaluation of a LoRA run before its first step (same problems, seed and
    sampler keys), and the next invocation evaluates nothing again."""
    text = PLAN.format(config=DEMO, out=tmp_path / "e").replace("steps: 3\n", "steps: 1\n").replace(
        "chunk_steps: 2", "chunk_steps: 1").replace("primary_outcome: {metric: reward/mean, steps: [2, 3]}",
                                                    "primary_outcome: {metric: reward/mean, steps: [1, 1]}")
    text = text.replace("stopping_rule:", "evaluation: {base: true}\n"
                                                                "stopping_rule:")
    text = text.replace("  mesh.data: 2\n", "  mesh.data: 2\n  model.lora.enabled: true\n")
    path = _plan(tmp_path, "e", text)
    said = []
    run_experiment(path, progress=False, say=said.append, eval_batch=4)
    base = tmp_path / "e" / "runs" / "base"
    assert any(x.startswith("base: evaluating the starting model (seed 0)") for x in said), said
    assert any(x.startswith("base: evaluated in ") for x in said), said
    cfg = json.loads((base / "config.json").read_text())
    assert cfg["train"]["steps"] == 0 and cfg["data"]["eval_batch"] == 4 and cfg["model"]["lora"]["enabled"]
    rec = json.loads((tmp_path / "e" / RECORD_FILE).read_text())
    assert rec["status"]["complete"] and rec["base"]["status"] == "finished"
    assert rec["base"]["eval_final"] == json.loads((base / "summary.json").read_text())["eval_final"]
    assert "base" in (tmp_path / "e" / REPORT_FILE).read_text().split("## Held-out evaluation")[1]
    # what the fresh adapters change: nothing (B = 0), so the base's evaluation is that of the same config's
    # evaluation before any step
    from ict_jax.config import load_config
    from ict_jax.train.trainer import Trainer

    cfg0 = load_config(None, base=cfg).replace(run_dir=str(tmp_path / "again"))
    with Trainer(cfg0, progress=False) as trainer:
        trainer.train()
    assert json.loads((tmp_path / "again" / "summary.json").read_text())["eval_final"] == rec["base"]["eval_final"]
    said.clear()
    run_experiment(path, progress=False, say=said.append)
    assert not any(x.startswith("base:") for x in said), said


def test_a_changed_plan_and_a_second_invocation_are_refused(tmp_path):
    path = _plan(tmp_path, "p")
    plan = load_plan(path)
    # a second invocation while one holds the experiment
    with hold_output_dir(plan.out, "out"):
        with pytest.raises(OutputInUse, match=r"out '.*' is in use by process \d+"):
            run_experiment(path, progress=False, say=lambda s: None)
    # a plan that changed under its experiment (the record of a first run is there)
    from ict_jax.tools.experiment import _plan_info

    _plan_info(plan, {"in_git": False})
    path.write_text(path.read_text().replace("steps: 3", "steps: 4"))
    with pytest.raises(PlanError, match="changed since the experiment .* started"):
        run_experiment(path, progress=False, say=lambda s: None)


def test_an_uncommitted_plan_in_git_is_refused_unless_asked(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    git = lambda *a: subprocess.run(["git", "-C", str(repo), *a], check=True, capture_output=True)  # noqa: E731
    git("init", "-q")
    path = repo / "plan.yaml"
    path.write_text(PLAN.format(config=DEMO, out=tmp_path / "out"))
    with pytest.raises(PlanError, match="is not committed: commit it before its first result"):
        run_experiment(path, progress=False, say=lambda s: None)
    git("add", "plan.yaml")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "plan")
    path.write_text(path.read_text() + "# a change\n")
    with pytest.raises(PlanError, match="has uncommitted changes"):
        run_experiment(path, progress=False, say=lambda s: None)
    from ict_jax.tools.experiment import check_plan_provenance

    state = check_plan_provenance(load_plan(path), allow_uncommitted=True)
    assert state["in_git"] and state["committed"] and not state["clean"]


def test_the_command_line_refuses_mixed_flags_and_a_report_without_a_record(tmp_path, capsys):
    path = _plan(tmp_path, "p")
    assert cli_main(["compare", "--plan", str(path), "--methods", "ict"]) == 2
    assert "--plan: the plan fixes the runs; --methods cannot be given with it" in capsys.readouterr().err
    assert cli_main(["compare", "--plan", str(path), "--report"]) == 2
    assert "no record at" in capsys.readouterr().err
    assert cli_main(["compare", "--plan", str(path), "--max-hours", "0"]) == 2
    assert "--max-hours 0.0: expected a positive number" in capsys.readouterr().err
    assert cli_main(["compare", "--max-hours", "1", "--config", str(DEMO)]) == 2
    assert "go with --plan" in capsys.readouterr().err
    assert cli_main(["compare", "--recover", "--config", str(DEMO)]) == 2
    assert "--order, --recover, --eval-batch and --runs go with --plan" in capsys.readouterr().err
    assert cli_main(["compare", "--runs", "ict_s0", "--config", str(DEMO)]) == 2
    assert "and --runs go with --plan" in capsys.readouterr().err
    assert cli_main(["compare", "--plan", str(path), "--status", "--runs", "ict_s0"]) == 2
    assert "--status only reads where the experiment stands: --runs does not apply" in capsys.readouterr().err
    assert cli_main(["compare", "--plan", str(path), "--runs", "ict_s0,nope"]) == 2
    assert "runs: nope: expected names of the plan's runs" in capsys.readouterr().err
    assert cli_main(["compare", "--plan", str(path), "--eval-batch", "0"]) == 2
    assert "--eval-batch 0: expected a positive number of prompts" in capsys.readouterr().err
    assert cli_main(["compare", "--plan", str(path), "--report", "--eval-batch", "4"]) == 2
    assert "--report only rebuilds the report: --eval-batch does not apply" in capsys.readouterr().err
    assert cli_main(["compare", "--plan", str(path), "--report", "--order", "runs", "--recover"]) == 2
    assert "--report only rebuilds the report: --order, --recover does not apply" in capsys.readouterr().err
    bad = _plan(tmp_path, "bad", PLAN.format(config=DEMO, out=tmp_path / "bad").replace("steps: 3", "steps: x"))
    assert cli_main(["compare", "--plan", str(bad)]) == 2
    assert "steps: expected an integer >= 1, got 'x'" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


# ------------------------------------------------------------------------------------------------
# A lost working folder: refused, then recovered from the record; the order of the runs
# ------------------------------------------------------------------------------------------------
def test_the_runs_order_takes_each_run_to_its_end_seed_by_seed(tmp_path):
    from ict_jax.tools.experiment import _turns

    plan = load_plan(_plan(tmp_path, "p", PLAN.format(config=DEMO, out=tmp_path / "p").replace("seeds: [0]",
                                                                                             "seeds: [0, 1]")))
    specs = plan_runs(plan)
    assert [(e, s.name) for e, s in _turns(plan, specs, "chunks")] == [
        (2, "ict_s0"), (2, "ict_s1"), (2, "grpo_s0"), (2, "grpo_s1"),
        (3, "ict_s0"), (3, "ict_s1"), (3, "grpo_s0"), (3, "grpo_s1")]
    assert [(e, s.name) for e, s in _turns(plan, specs, "runs")] == [
        (2, "ict_s0"), (3, "ict_s0"), (2, "grpo_s0"), (3, "grpo_s0"),
        (2, "ict_s1"), (3, "ict_s1"), (2, "grpo_s1"), (3, "grpo_s1")]
    with pytest.raises(PlanError, match="order: 'seeds': expected one of chunks, runs"):
        run_experiment(plan.path, order="seeds", say=lambda s: None)
    # runs: only the named runs' turns, in the same order; a name the plan has not is refused before any work
    assert [(e, s.name) for e, s in _turns(plan, specs, "runs", ["grpo_s1", "ict_s0"])] == [
        (2, "ict_s0"), (3, "ict_s0"), (2, "grpo_s1"), (3, "grpo_s1")]
    assert [(e, s.name) for e, s in _turns(plan, specs, "chunks", ["grpo_s1"])] == [(2, "grpo_s1"), (3, "grpo_s1")]
    for runs, bad in ((["ict_s0", "ict_s7"], "ict_s7"), ([], "none given")):
        with pytest.raises(PlanError, match=f"runs: {bad}: expected names of the plan's runs "
                                            r"\(ict_s0, ict_s1, grpo_s0, grpo_s1\)"):
            run_experiment(plan.path, runs=runs, say=lambda s: None)
    assert not (tmp_path / "p").exists()


def test_the_eta_counts_steps_and_evaluations_by_hand():
    from ict_jax.tools.experiment import _eta_text

    # 18 x 228 s + 3 x 2410 s = 11334 s
    assert _eta_text(18, 228.0, 3, 2410.0) == ", ETA 3h08m (18 steps x 3m48s + 3 evaluations x 40m10s)"
    # no evaluation measured yet: named, not timed
    assert _eta_text(18, 228.0, 3, None) == ", ETA 1h08m (18 steps x 3m48s) + 3 evaluations"
    assert _eta_text(0, 228.0, 1, None) == ", 1 evaluation left"
    assert _eta_text(0, None, 1, 60.0) == ", ETA 1m00s (1 evaluation x 1m00s)"
    assert _eta_text(5, 10.0, 0, 60.0) == ", ETA 50s (5 steps x 10s)"
    assert _eta_text(0, 10.0, 0, 60.0) == "" and _eta_text(3, None, 2, 10.0) == ""


def test_compare_attempt_by_hand():
    from ict_jax.tools.experiment_record import compare_attempt

    old = [{"step": 0, "reward/mean": 0.5, "loss/total": 1.0, "time/update_s": 3.0},
           {"step": 1, "reward/mean": 0.25, "loss/total": "nan", "time/update_s": 3.0},
           {"step": 2, "reward/mean": 0.75, "loss/total": 0.5}]
    new = [{"step": 0, "reward/mean": 0.5, "loss/total": 1.0, "time/update_s": 9.0},  # a timing is not compared
           {"step": 1, "reward/mean": 0.25, "loss/total": "nan"},
           {"step": 2, "reward/mean": 0.75, "loss/total": 0.5000001},
           {"step": 3, "reward/mean": 1.0, "loss/total": 0.1}]
    assert compare_attempt(new, old) == {"steps_compared": 3, "steps_equal": 2, "first_difference": {
        "step": 2, "metrics": {"loss/total": [0.5, 0.5000001]}}, "steps_same_samples": 3,
        "first_sample_difference": None}
    assert compare_attempt(new[:2], old) == {"steps_compared": 2, "steps_equal": 2, "first_difference": None,
                                             "steps_same_samples": 2, "first_sample_difference": None}
    assert compare_attempt([], old) == {"steps_compared": 0, "steps_equal": 0, "first_difference": None,
                                        "steps_same_samples": 0, "first_sample_difference": None}
    # another machine: the floats part at step 1 (0-based 0), the samples at step 2 (0-based 1)
    other = [{**new[0], "loss/total": 1.0000002}, {**new[1], "reward/mean": 0.5}, new[2]]
    c = compare_attempt(other, old)
    assert (c["steps_equal"], c["first_difference"]["step"], c["steps_same_samples"], c["first_sample_difference"]) \
        == (0, 0, 1, 1)


def test_a_working_folder_with_fewer_steps_than_the_record_is_refused(tmp_path):
    from ict_jax.tools.experiment import _plan_info

    path = _plan(tmp_path, "p", PLAN.format(config=DEMO, out=tmp_path / "out") + f"record: {tmp_path / 'rec'}\n")
    plan = load_plan(path)
    _plan_info(plan, {"in_git": False})  # out holds the experiment (plan.json), but no run directory
    (tmp_path / "rec").mkdir()
    (tmp_path / "rec" / RECORD_FILE).write_text(json.dumps({"plan_sha256": plan.sha256, "status": {"steps_done": 2},
                                                            "runs": {"ict_s0": {"steps_done": 2}}}))
    before = (tmp_path / "rec" / RECORD_FILE).read_bytes()
    with pytest.raises(PlanError, match=r"holds 2 steps of run ict_s0, its directory .* 0: a run directory was lost"):
        run_experiment(path, say=lambda s: None)
    assert (tmp_path / "rec" / RECORD_FILE).read_bytes() == before


def test_the_report_says_how_an_earlier_attempt_compares():
    from ict_jax.tools.experiment_report import _attempt_lines

    attempt = {"attempt": 1, "steps_done": 20, "lost": "machine gone",
               "machines": [{"cpu": "AMD EPYC", "cores": 2, "backend": "cpu"}], "commits": ["ee9b83e647b852e0"],
               "comparison": {"steps_compared": 3, "steps_equal": 0, "steps_same_samples": 2,
                              "first_sample_difference": 2,
                              "first_difference": {"step": 0, "metrics": {"grad/norm": [0.25, 0.2500001]}}}}
    lines = _attempt_lines({"runs": {"ict_s0": {"attempts": [attempt]},
                                     "grpo_s0": {"restored": {"time": "T", "status": "finished", "steps_done": 40}}}})
    assert lines[:3] == ["", "## Earlier attempts", ""]
    assert lines[-2] == ("- `ict_s0`, attempt 1: 20 steps on AMD EPYC (2 cores, cpu), code `ee9b83e647b8`; lost: "
                         "machine gone; the run now equals it bitwise on 0 of 3 common steps; first difference at "
                         "step 1 (1 metrics: `grad/norm`); the same samples (reward, length, truncation) on the "
                         "first 2, parting at step 3.")
    assert lines[-1] == "- `grpo_s0`: written back from the record on T (finished, 40 steps; no checkpoint, not run again)."
    assert _attempt_lines({"runs": {"ict_s0": {}}}) == []


def test_the_report_names_every_machine_and_what_changed_between_invocations():
    from ict_jax.tools.experiment_report import _environment_lines, _ranges

    assert (_ranges([1, 2, 3, 5]), _ranges([4]), _ranges([1, 3, 4, 5, 9, 10])) == ("1-3, 5", "4", "1, 3-5, 9-10")
    amd = {"cpu": "AMD EPYC", "cores": 2, "backend": "cpu", "memory_gib": 23.5, "os": "L", "python": "3.11",
           "devices": "1 x cpu", "versions": {"jax": "0.10.2", "numpy": "2.4.6"}}
    xeon = {**amd, "cpu": "Xeon", "versions": {"jax": "0.10.2", "numpy": "2.4.7"}}
    inv = lambda env, c: {"start": "S", "end": "E", "commit": c, "environment": env, "chunks_done": 1,  # noqa: E731
                          "stopped": "time box"}
    lines = _environment_lines({"environment": amd, "invocations": [inv(amd, "a" * 40), inv(amd, "b" * 40),
                                                                    inv(xeon, "c" * 40)]})
    assert lines[3:] == [
        "- Machine of the first invocation: AMD EPYC, 2 cores, 23.5 GiB; L; Python 3.11; cpu (1 x cpu).",
        "- Versions: jax 0.10.2, numpy 2.4.6.",
        "- Machines: AMD EPYC (2 cores, cpu): invocations 1-2; Xeon (2 cores, cpu): invocation 3.",
        "- Invocation S to E: code at `aaaaaaaaaaaa`, 1 chunk(s), stopped: time box.",
        "- Invocation S to E: code at `bbbbbbbbbbbb`, 1 chunk(s), stopped: time box.",
        "- Invocation S to E: code at `cccccccccccc`, on Xeon (2 cores, cpu), with numpy 2.4.7, 1 chunk(s), "
        "stopped: time box."]
    one = _environment_lines({"environment": amd, "invocations": [inv(amd, "a" * 40)]})
    assert not any(line.startswith("- Machines:") for line in one)  # one machine: no such line


def test_a_lost_working_folder_is_refused_then_recovered_from_the_record(tmp_path, reward_module):
    record_dir = tmp_path / "record"
    text = PLAN.format(config=DEMO, out=tmp_path / "out") + f"record: {record_dir}\n"
    path = _plan(tmp_path, "lost", text)

    def grpo_at_2() -> bool:  # the time box, as it would stop after GRPO's step 2 (a chunk's end)
        m = tmp_path / "out" / "runs" / "grpo_s0" / "metrics.jsonl"
        return m.is_file() and len(read_metrics(m)) >= 2

    with pytest.raises(ExperimentStopped):  # order runs: ICT to its end (and evaluation), then GRPO to step 2
        run_experiment(path, order="runs", should_stop=grpo_at_2, say=lambda s: None)
    old = json.loads((record_dir / RECORD_FILE).read_text())
    assert old["runs"]["ict_s0"]["status"] == "finished" and old["runs"]["grpo_s0"]["steps_done"] == 2
    assert old["invocations"][0]["order"] == "runs"
    # the machine is lost: the working folder goes, the committed record stays
    import shutil

    shutil.rmtree(tmp_path / "out")
    before = (record_dir / RECORD_FILE).read_bytes()
    with pytest.raises(PlanError, match=r"holds 5 steps .* Pass --recover .* nothing is overwritten without it"):
        run_experiment(path, say=lambda s: None)
    assert (record_dir / RECORD_FILE).read_bytes() == before
    said: list[str] = []
    rec = run_experiment(path, order="runs", recover=True, say=said.append)
    assert rec["status"]["complete"]
    ict, grpo = rec["runs"]["ict_s0"], rec["runs"]["grpo_s0"]
    # the finished run is written back, not run again: its metrics, evaluation and chunks are the record's
    for key in ("metrics", "evals", "eval_final", "chunks", "selection", "outcomes", "steps_done", "status"):
        assert ict[key] == old["runs"]["ict_s0"][key], key
    assert ict["restored"]["checkpoint"] is None and not (tmp_path / "out" / "runs" / "ict_s0" / "checkpoints").exists()
    # the unfinished one started again from step 0; what it had logged is its attempt 1, and on this machine
    # and code the new attempt repeats it bitwise
    (attempt,) = grpo["attempts"]
    assert attempt["attempt"] == 1 and attempt["steps_done"] == 2
    assert attempt["metrics"] == old["runs"]["grpo_s0"]["metrics"]
    assert attempt["chunks"] == old["runs"]["grpo_s0"]["chunks"]
    assert attempt["comparison"] == {"steps_compared": 2, "steps_equal": 2, "first_difference": None,
                                     "steps_same_samples": 2, "first_sample_difference": None}
    assert [_keep(r) for r in grpo["metrics"][:2]] == [_keep(r) for r in attempt["metrics"]]
    assert grpo["steps_done"] == 3 and grpo["chunks"][0]["from"] == 0
    assert any("against its attempt 1 (lost): 2 of 2 common steps equal bitwise, 2 with the same samples" in s
               for s in said)
    # every earlier invocation is kept as it was; the new one says it rebuilt the folder
    assert rec["invocations"][:1] == old["invocations"]
    assert rec["invocations"][1]["recovered"]["restored"] == ["ict_s0"]
    assert rec["invocations"][1]["recovered"]["restarted"] == ["grpo_s0"]
    assert rec["plan_git"] == old["plan_git"] and rec["plan_sha256"] == old["plan_sha256"]
    report = (record_dir / REPORT_FILE).read_text()
    assert "## Earlier attempts" in report and "working folder rebuilt from the record" in report
    assert "`grpo_s0`, attempt 1: 2 steps on" in report and "equals it bitwise on all 2 common steps" in report
    rebuild_report(path)
    assert (record_dir / REPORT_FILE).read_text() == report
    # asked again with the folder in place: nothing to recover, nothing trained
    said.clear()
    again = run_experiment(path, order="runs", recover=True, say=said.append)
    assert any("nothing to recover" in s for s in said) and again["runs"] == rec["runs"]


# ------------------------------------------------------------------------------------------------
# Branched arms (docs/experiments.md "Branching")
# ------------------------------------------------------------------------------------------------
# the tiny plan of test_experiment, with GRPO first and ICT branched from its step-2 checkpoint: 4 steps in
# chunks of 2, the ICT arm's warm-up ends at the branch point (its steps 3-4 are sparse), an evaluation every
# 2 steps (the one at step 2 is GRPO's, before the branch point) and at the end; the record beside the working
# folder (so that a lost working folder can be rebuilt from it); train.keep 1, so that GRPO's checkpoint of step 2 is gone once it saved step 4 (the snapshot keeps it)
BRANCHED = (PLAN.replace("  ict: {{method: ict}}\n  grpo: {{method: grpo}}\n",
                         "  grpo: {{method: grpo}}\n"
                         "  ict: {{method: ict, branch: {{from: grpo, step: 2}}, "
                         "overrides: {{rl.selector.warmup_steps: 2}}}}\n")
            .replace("steps: 3\nchunk_steps: 2", "steps: 4\nchunk_steps: 2")
            .replace("primary_outcome: {{metric: reward/mean, steps: [2, 3]}}",
                     "primary_outcome: {{metric: reward/mean, steps: [3, 4]}}")
            .replace("  - {{metric: eval/pass@1}}\n", "  - {{metric: eval/pass@1, step: 2}}\n  - {{metric: eval/pass@1}}\n")
            .replace("  train.save_every: 2\n", "  train.save_every: 2\n  train.keep: 1\n  train.eval_every: 2\n")
            + "record: {out}-record\n")


def _branched(tmp_path: Path, name: str, text: str | None = None) -> Path:
    return _plan(tmp_path, name, (text or BRANCHED).format(config=DEMO, out=tmp_path / name))


@pytest.mark.parametrize("edit, message", [
    (("  ict: {{method: ict, branch: {{from: grpo, step: 2}}", "  ict: {{method: ict, branch: {{from: ict, step: 2}}"),
     "arms.ict.branch.from: 'ict': expected an arm listed before this one that is not branched itself (grpo)"),
    (("branch: {{from: grpo, step: 2}}", "branch: {{from: grpo, step: 3}}"),
     "arms.ict.branch.step: 3: a branch point is a chunk end before the last step (chunk ends: 2)"),
    (("branch: {{from: grpo, step: 2}}", "branch: {{from: grpo, step: 4}}"),
     "arms.ict.branch.step: 4: a branch point is a chunk end"),
    (("branch: {{from: grpo, step: 2}}", "branch: {{from: grpo}}"), "arms.ict.branch: expected {from:"),
    (("  - {{metric: eval/pass@1, step: 2}}", "  - {{metric: eval/pass@1, step: 5}}"),
     "secondary_outcomes[1].step: 5: expected an RL step 1..4"),
    (("  - {{metric: eval/pass@1, step: 2}}", "  - {{metric: eval/pass@1, steps: [2, 2]}}"),
     "secondary_outcomes[1].steps: an evaluation outcome (eval/...) has no steps"),
    (("  - {{metric: grad/norm, steps: [1, 1]}}", "  - {{metric: grad/norm, step: 1}}"),
     "secondary_outcomes[0].step: a per-step outcome takes steps: [first, last]"),
    (("overrides: {{rl.selector.warmup_steps: 2}}", "overrides: {{optim.lr: 0.5}}"),
     "arms.ict: a branched arm continues grpo's run, so its config may differ only in rl.*, stats.*; it differs "
     "in optim.lr"),
])
def test_a_branch_that_cannot_continue_its_parent_is_one_line_naming_the_key(tmp_path, edit, message):
    assert edit[0] in BRANCHED
    with pytest.raises(PlanError) as err:
        load_plan(_branched(tmp_path, "p", BRANCHED.replace(edit[0], edit[1], 1)))
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_a_branched_run_names_its_parent_and_skips_the_turns_before_its_branch_point(tmp_path):
    plan = load_plan(_branched(tmp_path, "p"))
    specs = plan_runs(plan)
    assert [(s.name, s.parent, s.first_step) for s in specs] == [("grpo_s0", None, 0), ("ict_s0", "grpo_s0", 2)]
    assert plan.to_dict()["arms"]["ict"]["branch"] == {"from": "grpo", "step": 2}
    assert "branch" not in plan.to_dict()["arms"]["grpo"]


def test_a_lost_parent_resumes_at_the_latest_branch_point_its_attempt_reached_with_its_evaluations(tmp_path):
    from ict_jax.tools.experiment_branch import recorded_rows, resume_point
    from ict_jax.tools.experiment_record import ATTEMPTS_DIR, RESUMED_FILE, write_json

    plan = load_plan(_branched(tmp_path, "p"))
    grpo, ict = plan_runs(plan)
    assert resume_point(plan, grpo) is None  # no attempt: from step 0

    def attempts(*steps_evals):
        write_json(plan.out / ATTEMPTS_DIR / "grpo_s0.json", [
            {"attempt": i, "metrics": [{"step": k, "phase": "rl", "x": 10 * i + k} for k in range(n)],
             "evals": [{"step": e, "phase": "eval", "y": i} for e in evals]}
            for i, (n, evals) in enumerate(steps_evals, 1)])

    attempts((1, []), (3, [2]))  # the latest reached step 3 with its evaluation at step 2 (eval_every 2)
    assert resume_point(plan, grpo) == 2 and resume_point(plan, ict) is None  # a branched run forks instead
    rl, evals, where = recorded_rows(plan, grpo, 2)
    assert where == "attempt 2" and [r["x"] for r in rl] == [20, 21] and evals == [{"step": 2, "phase": "eval", "y": 2}]
    attempts((3, [2]), (2, []))  # the latest reached step 2 but its evaluation there is missing
    assert resume_point(plan, grpo) is None
    assert recorded_rows(plan, grpo, 2)[2] == "attempt 2" and recorded_rows(plan, grpo, 3)[2] == "attempt 1"
    attempts((1, []))  # short of the branch point
    assert resume_point(plan, grpo) is None and recorded_rows(plan, grpo, 2) == ([], [], None)
    # the run's own directory, when it logged the steps, comes first; one that logged anything is not lost
    grpo.run_dir.mkdir(parents=True)
    (grpo.run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (
        {"step": 0, "phase": "rl", "x": 0}, {"step": 1, "phase": "rl", "x": 1}, {"step": 2, "phase": "eval", "y": 0})))
    assert recorded_rows(plan, grpo, 2) == ([{"step": 0, "phase": "rl", "x": 0}, {"step": 1, "phase": "rl", "x": 1}],
                                            [{"step": 2, "phase": "eval", "y": 0}], "run")
    assert resume_point(plan, grpo) is None
    # ... unless it was laid out from the branch point (resumed there): its rows up to it are the snapshot's
    write_json(grpo.run_dir / RESUMED_FILE, {"step": 2})
    attempts((3, [2]))
    assert recorded_rows(plan, grpo, 2)[2] == "attempt 1" and recorded_rows(plan, grpo, 3)[2] == "attempt 1"
    write_json(grpo.run_dir / RESUMED_FILE, {"step": 1})  # resumed before it: its own rows from there on
    assert recorded_rows(plan, grpo, 2)[2] == "run"


@pytest.mark.parametrize("parted", [False, True])
def test_a_snapshot_compared_with_an_emptied_run_directory_is_compared_again_with_the_recorded_rows(tmp_path, parted):
    # a re-derived snapshot (and the run branched from it) of code that compared with the parent's run
    # directory alone: after a lost working folder that is empty, 0 steps compared and no evaluation rows
    from ict_jax.tools.experiment_branch import compare_rederived_again, snapshot_dir, take_snapshot
    from ict_jax.tools.experiment_record import ATTEMPTS_DIR, BRANCH_FILE, read_branch, write_json

    plan = load_plan(_branched(tmp_path, "p"))
    grpo, ict = plan_runs(plan)
    snap = snapshot_dir(plan, grpo.name, 2)
    (snap / "checkpoints" / "2").mkdir(parents=True)
    (snap / "checkpoints" / "2" / "w").write_bytes(b"weights")
    redone = [{"step": 0, "phase": "rl", "reward/mean": 0.5, "loss": 1.0},
              {"step": 1, "phase": "rl", "reward/mean": 0.25, "loss": 2.0}]
    (snap / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in redone))
    stale = {"run_dir": "redo", "comparison": {"steps_compared": 0, "steps_equal": 0, "first_difference": None,
                                                "steps_same_samples": 0, "first_sample_difference": None}}
    write_json(snap / "snapshot.json", {"parent": grpo.name, "step": 2, "checkpoint_sha256": "abc",
                                        "rederived": stale})
    write_json(ict.run_dir / BRANCH_FILE, {"from": grpo.name, "step": 2, "checkpoint_sha256": "abc",
                                           "rederived": stale})
    # the attempt as recorded: step 0 as re-derived; step 1 in the last bits of its loss (another CPU), or
    # with other samples (its reward); its step-2 evaluation
    step1 = {**redone[1], "reward/mean": 0.375} if parted else {**redone[1], "loss": 2.0000001}
    write_json(plan.out / ATTEMPTS_DIR / f"{grpo.name}.json", [
        {"attempt": 1, "metrics": [redone[0], step1, {"step": 2, "phase": "rl"}],
         "evals": [{"step": 2, "phase": "eval", "pass_at_1": 0.125}, {"step": 4, "phase": "eval"}]}])

    differs = {"reward/mean": [0.375, 0.25]} if parted else {"loss": [2.0000001, 2.0]}
    assert compare_rederived_again(plan, [grpo, ict]) == {ict.name: {
        "steps_compared": 2, "steps_equal": 1, "first_difference": {"step": 1, "metrics": differs},
        "steps_same_samples": 1 if parted else 2, "first_sample_difference": 1 if parted else None}}
    branch = read_branch(ict.run_dir)
    assert branch["rederived"]["recorded"] == "attempt 1" and branch["checkpoint_sha256"] == "abc"
    assert branch["rederived"] == take_snapshot(plan, grpo, 2)["rederived"]
    # the recorded evaluation is the snapshot's policy's only where it sampled the same tokens throughout
    assert [json.loads(x) for x in (snap / "metrics.jsonl").read_text().splitlines()] == [
        *redone, *([] if parted else [{"step": 2, "phase": "eval", "pass_at_1": 0.125}])]
    assert (snap / "checkpoints" / "2" / "w").read_bytes() == b"weights"
    assert compare_rederived_again(plan, [grpo, ict]) == {}  # once
    # the parent, started again from step 0, reaches the branch point on the re-deriving machine: bitwise its
    # trajectory now, and its own step-2 evaluation is the snapshot's
    grpo.run_dir.mkdir(parents=True)
    (grpo.run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (
        *redone, {"step": 2, "phase": "eval", "pass_at_1": 0.25}, {"step": 2, "phase": "rl"})))
    assert compare_rederived_again(plan, [grpo, ict]) == {ict.name: {
        "steps_compared": 2, "steps_equal": 2, "first_difference": None, "steps_same_samples": 2,
        "first_sample_difference": None}}
    assert read_branch(ict.run_dir)["rederived"]["recorded"] == "run"
    assert [json.loads(x) for x in (snap / "metrics.jsonl").read_text().splitlines()] == [
        *redone, {"step": 2, "phase": "eval", "pass_at_1": 0.25}]
    assert compare_rederived_again(plan, [grpo, ict]) == {}
    # a snapshot of another re-derivation (another checkpoint) is not the one the run started from
    write_json(ict.run_dir / BRANCH_FILE, {**read_branch(ict.run_dir), "checkpoint_sha256": "other", "rederived": stale})
    assert compare_rederived_again(plan, [grpo, ict]) == {} and read_branch(ict.run_dir)["rederived"] == stale


def test_a_branched_arm_starts_from_its_parents_checkpoint_and_resumes_bitwise(tmp_path, reward_module):
    # never stopped, in turns of chunks: GRPO to 2, ICT branches at 2, both to 4
    whole = _branched(tmp_path, "whole")
    said: list[str] = []
    run_experiment(whole, progress=False, say=said.append)
    assert any(s.startswith("ict s0: branched from grpo_s0 at step 2 (checkpoint sha256 ") for s in said), said
    # seed by seed (GRPO runs to its end first: its step-2 checkpoint is gone by the time ICT branches, the
    # snapshot holds it), and stopped after ICT's first step of its own (step 3), then continued
    cut = _branched(tmp_path, "cut")
    calls: list[int] = []

    def stop_in_ict() -> bool:
        calls.append(1)
        return (tmp_path / "cut" / "runs" / "ict_s0" / "branch.json").is_file() and len(
            read_metrics(tmp_path / "cut" / "runs" / "ict_s0" / "metrics.jsonl")) == 3

    with pytest.raises(ExperimentStopped):
        run_experiment(cut, progress=False, should_stop=stop_in_ict, say=lambda s: None, order="runs")
    assert not (tmp_path / "cut" / "runs" / "grpo_s0" / "checkpoints" / "2").exists()
    rec = json.loads((tmp_path / "cut-record" / RECORD_FILE).read_text())
    assert rec["runs"]["ict_s0"]["steps_done"] == 3 and rec["status"]["steps_done"] == 4 + 1
    # the machine lost: the working folder (checkpoints, the snapshot) is gone, rebuilt from the record; GRPO's
    # finished run is written back without checkpoints, so ICT's branch point is trained again (GRPO to step 2)
    shutil.rmtree(tmp_path / "cut")
    said = []
    run_experiment(cut, progress=False, say=said.append, order="runs", recover=True)
    assert any("the checkpoint of grpo_s0 at step 2 is gone" in s for s in said), said

    for folder in ("whole", "cut"):
        runs = tmp_path / folder / "runs"
        grpo, ict = (read_metrics(runs / n / "metrics.jsonl") for n in ("grpo_s0", "ict_s0"))
        assert [r["step"] for r in grpo] == [r["step"] for r in ict] == [0, 1, 2, 3]
        # its first two steps are GRPO's rows; its third samples GRPO's rollouts from GRPO's weights ...
        assert [_keep(r) for r in ict[:2]] == [_keep(r) for r in grpo[:2]]
        for key in ("reward/mean", "response/length_mean", "adv/zero_std_group_frac"):
            assert ict[2][key] == grpo[2][key], key
        # ... and trains on ICT's tokens from there (its warm-up of 2 steps is over at the restored step)
        assert ict[2]["mask/selected_frac"] < 0.5 and grpo[2]["mask/selected_frac"] == 1.0
        assert ict[3]["reward/mean"] != grpo[3]["reward/mean"] or ict[3]["grad/norm"] != grpo[3]["grad/norm"]
        # the evaluation at the branch point is GRPO's (the same policy), the final ones are each arm's own
        evals = [read_metrics(runs / n / "metrics.jsonl", "eval") for n in ("grpo_s0", "ict_s0")]
        assert [[r["step"] for r in e] for e in evals] == [[2, 4], [2, 4]] and evals[0][0] == evals[1][0]
    # stopped, its machine lost and continued = never stopped, bitwise (GRPO's run written back from the record)
    for name in ("grpo_s0", "ict_s0"):
        a, b = tmp_path / "whole" / "runs" / name, tmp_path / "cut" / "runs" / name
        assert [_keep(r) for r in read_metrics(a / "metrics.jsonl")] == [_keep(r) for r in read_metrics(b / "metrics.jsonl")]
    (sa, pa), (sb, pb) = _final_params(tmp_path / "whole" / "runs" / "ict_s0"), _final_params(
        tmp_path / "cut" / "runs" / "ict_s0")
    assert sa == sb == 4
    chex.assert_trees_all_equal(pa, pb)
    # the record names the checkpoint each branched run started from (and the sha256 of the copy it started from)
    recs = [json.loads((tmp_path / f"{f}-record" / RECORD_FILE).read_text()) for f in ("whole", "cut")]
    branches = [r["runs"]["ict_s0"]["branch"] for r in recs]
    for f, b in zip(("whole", "cut"), branches):
        assert b["from"] == "grpo_s0" and b["step"] == 2
        assert b["snapshot"] == str(tmp_path / f / "branches" / "grpo_s0@2")
        snap = json.loads((tmp_path / f / "branches" / "grpo_s0@2" / "snapshot.json").read_text())
        assert b["checkpoint_sha256"] == snap["checkpoint_sha256"] and len(b["checkpoint_sha256"]) == 64
    # the whole experiment branched from GRPO's own checkpoint; the cut one from GRPO trained again, equal to it
    # bitwise on this machine (the comparison says so)
    assert branches[0]["checkpoint"] == str(tmp_path / "whole" / "runs" / "grpo_s0" / "checkpoints" / "2")
    assert "rederived" not in branches[0]
    redo = tmp_path / "cut" / "branches" / "grpo_s0@2.rederive"
    assert branches[1]["checkpoint"] == str(redo / "checkpoints" / "2")
    # the re-derivation trains without evaluating: the branched run's evaluation at step 2 is GRPO's, as recorded
    assert read_metrics(redo / "metrics.jsonl", "rl") and not read_metrics(redo / "metrics.jsonl", "eval")
    assert branches[1]["rederived"] == {"run_dir": str(redo), "comparison": {
        "steps_compared": 2, "steps_equal": 2, "first_difference": None, "steps_same_samples": 2,
        "first_sample_difference": None}, "recorded": "run"}
    assert "trained again" in (tmp_path / "cut-record" / "report.md").read_text()
    assert recs[1]["runs"]["ict_s0"]["attempts"][0]["steps_done"] == 3  # the attempt lost with the machine
    assert "branch" not in recs[0]["runs"]["grpo_s0"]
    at2 = [recs[0]["runs"][n]["outcomes"]["eval/pass@1 at step 2"] for n in ("grpo_s0", "ict_s0")]
    assert at2[0] is not None and at2[0] == at2[1]
    # steps counted as trained: GRPO's 4 and ICT's own 2
    assert [r["status"]["steps_done"] for r in recs] == [6, 6] and recs[0]["status"]["steps_planned"] == 6
    assert all(r["status"]["complete"] for r in recs)

    # GRPO itself lost after its branch point (stopped at step 3, then the machine lost): it resumes at the
    # branch point, re-derived once for it and ICT, its evaluation at step 2 the attempt's, not run again
    lost = _branched(tmp_path, "lost")
    grpo_dir = tmp_path / "lost" / "runs" / "grpo_s0"
    with pytest.raises(ExperimentStopped):
        run_experiment(lost, progress=False, order="runs", say=lambda s: None,
                       should_stop=lambda: (grpo_dir / "metrics.jsonl").is_file()
                       and len(read_metrics(grpo_dir / "metrics.jsonl", "rl")) == 3)
    shutil.rmtree(tmp_path / "lost")
    said = []
    rec = run_experiment(lost, progress=False, say=said.append, order="runs", recover=True)
    assert any(s.startswith("grpo s0: resumed at step 2 from its branch point") for s in said), said
    chunks = [json.loads(line) for line in (tmp_path / "lost" / "chunks.jsonl").read_text().splitlines()]
    assert [c["run"] for c in chunks if "@" in c["run"]] == ["grpo_s0@2"]  # trained again once, for both
    for name in ("grpo_s0", "ict_s0"):
        a, b = tmp_path / "whole" / "runs" / name, tmp_path / "lost" / "runs" / name
        assert [_keep(r) for r in read_metrics(a / "metrics.jsonl")] == [_keep(r) for r in read_metrics(b / "metrics.jsonl")]
        chex.assert_trees_all_equal(_final_params(a)[1], _final_params(b)[1])
    resumed = rec["runs"]["grpo_s0"]["resumed"]
    assert resumed["step"] == 2 and resumed["snapshot"] == str(tmp_path / "lost" / "branches" / "grpo_s0@2")
    assert resumed["rederived"]["recorded"] == "attempt 1"
    assert resumed["rederived"]["comparison"]["steps_same_samples"] == 2
    assert rec["runs"]["ict_s0"]["branch"]["rederived"] == resumed["rederived"]
    attempt = rec["runs"]["grpo_s0"]["attempts"][0]
    assert attempt["steps_done"] == 3 and attempt["comparison"]["steps_compared"] == 3
    assert [r for r in rec["runs"]["grpo_s0"]["evals"] if r["step"] == 2] == attempt["evals"]
    assert "resumed at its branch point, step 2" in (tmp_path / "lost-record" / "report.md").read_text()
    assert rec["status"]["steps_done"] == 6 and rec["status"]["complete"]
    # and lost once more when finished: the record keeps where it resumed
    shutil.rmtree(tmp_path / "lost")
    assert run_experiment(lost, progress=False, say=lambda s: None, order="runs",
                          recover=True)["runs"]["grpo_s0"]["resumed"] == resumed
