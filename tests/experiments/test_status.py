"""ict_jax.experiments.status (``ict-jax compare --plan P --status``): where an experiment stands, read
from its working folder by hand-made run directories, without any of its outcomes, beside a holder."""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path

import pytest

from ict_jax.cli.main import main as cli_main
from ict_jax.experiments.plan import load_plan
from ict_jax.experiments.status import _left, experiment_status, format_status
from ict_jax.outputs import hold_output_dir
from ict_jax.train.evaluation import eval_results

ROOT = Path(__file__).resolve().parents[2]

PLAN = """\
name: st
config: {config}
overrides:
  model.preset: tiny
  data.eval: ["arith?digits=1&size=4&seed=7"]
arms:
  ict: {{method: ict}}
  grpo: {{method: grpo}}
seeds: [0, 1]
steps: 4
chunk_steps: 2
reference_arms: [grpo]
primary_outcome: {{metric: reward/mean, steps: [3, 4]}}
evaluation: {{base: true}}
stopping_rule: every run trains all 4 steps
out: {out}
"""

#: rewards no status line may show (a look at the experiment must not unblind)
REWARDS = (0.137, 0.291, 0.463, 0.859)


def _run(out: Path, name: str, steps: int, finished: bool = False, eval_seconds: float | None = None) -> Path:
    d = out / "runs" / name
    d.mkdir(parents=True)
    (d / "metrics.jsonl").write_text("".join(json.dumps({"phase": "rl", "step": s, "reward/mean": REWARDS[s]}) + "\n"
                                             for s in range(steps)))
    if finished:
        (d / "summary.json").write_text(json.dumps({"status": "finished", "steps": 4,
                                                    "eval_final": {"eval/e/pass@1": 0.777}}))
    if eval_seconds is not None:
        (d / "eval").mkdir()
        eval_results(d, 4).write_text(json.dumps({"benchmarks": {"e": {"seconds": eval_seconds}}}))
    return d


@pytest.fixture
def plan(tmp_path):
    path = tmp_path / "st.yaml"
    path.write_text(PLAN.format(config=ROOT / "configs" / "demo.yaml", out=tmp_path / "out"))
    return load_plan(path)


def _jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_a_paused_experiment_its_runs_and_the_time_left(plan, tmp_path):
    out = plan.out
    out.mkdir()
    (out / "plan.json").write_text(json.dumps({"sha256": plan.sha256}))
    _run(out, "ict_s0", 4, finished=True, eval_seconds=30.0)
    _run(out, "grpo_s0", 3)  # stopped after step 3, no checkpoint: continues from step 0
    # two invocations: the first trained ict_s0 in two chunks (the second with its evaluation), the second
    # grpo_s0 at another pace; the pace is the last invocation's
    _jsonl(out / "chunks.jsonl", [
        {"run": "ict_s0", "from": 0, "to": 2, "status": "paused", "wall_s": 20.0, "invocation": "a"},
        {"run": "ict_s0", "from": 2, "to": 4, "status": "finished", "wall_s": 50.0, "invocation": "a"},
        {"run": "grpo_s0", "from": 0, "to": 2, "status": "paused", "wall_s": 16.0, "invocation": "b"}])
    _jsonl(out / "invocations.jsonl", [{"event": "start", "id": "a", "start": "2026-01-01T10:00:00+00:00"},
                                       {"event": "end", "id": "a"},
                                       {"event": "start", "id": "b", "start": "2026-01-01T11:00:00+00:00",
                                        "max_hours": 1.5},
                                       {"event": "end", "id": "b"}])
    st = experiment_status(plan.path)
    states = {r.name: (r.state, r.logged, r.saved, r.done) for r in st["runs"]}
    assert states == {"ict_s0": ("finished", 4, 4, 4), "ict_s1": ("pending", 0, 0, 0),
                      "grpo_s0": ("paused", 3, 0, 0), "grpo_s1": ("pending", 0, 0, 0)}
    assert st["base"].state == "pending" and st["held_by"] is None and st["invocation"] is None
    # steps left: 4 + 4 + 4 (grpo_s0 starts again from its checkpoint, here none); evaluations: 3 runs + base
    assert st["steps_left"] == 12 and st["evaluations_left"] == 4
    assert st["step_s"] == pytest.approx(8.0) and st["eval_s"] == pytest.approx(30.0)
    text = format_status(st)
    assert text.splitlines()[0].startswith("st: 4/16 RL steps done, 1/4 runs finished, base model not evaluated")
    assert "\nnot running\n" in text
    assert "  grpo_s0  paused       0/4 (3 logged, continues from its checkpoint)" in text
    assert text.endswith("left: about 3m36s (12 steps x 8s + 4 evaluations x 30s) at the last "
                         "invocation's pace")
    for r in (*REWARDS, 0.777):  # no outcome anywhere
        assert f"{r}"[1:] not in text
    assert "reward" not in text and "pass" not in text


def test_a_branched_runs_steps_up_to_its_branch_point_are_its_parents(tmp_path):
    # as the record counts them: GRPO's 4 steps each, ICT's own 2 after it branched at step 2
    path = tmp_path / "br.yaml"
    path.write_text(PLAN.replace("  ict: {{method: ict}}\n  grpo: {{method: grpo}}\n",
                                 "  grpo: {{method: grpo}}\n  ict: {{method: ict, branch: {{from: grpo, step: 2}}, "
                                 "overrides: {{rl.selector.warmup_steps: 2}}}}\n")
                    .format(config=ROOT / "configs" / "demo.yaml", out=tmp_path / "out"))
    plan = load_plan(path)
    out = plan.out
    out.mkdir()
    (out / "plan.json").write_text("{}")
    _run(out, "grpo_s0", 4, finished=True)
    (_run(out, "ict_s0", 4, finished=True) / "branch.json").write_text(json.dumps({"from": "grpo_s0", "step": 2}))
    _run(out, "grpo_s1", 1)  # stopped after step 1, no checkpoint: continues from step 0
    st = experiment_status(plan.path)
    assert (st["steps_trained"], st["steps_planned"], st["steps_left"]) == (6, 12, 6)  # left: 4 + ict_s1's own 2
    text = format_status(st)
    assert text.splitlines()[0].startswith("st: 6/12 RL steps done, 2/4 runs finished")
    assert "  ict_s0   finished     4/4 (from grpo_s0 at step 2)" in text
    assert "  ict_s1   pending      0/4 (from grpo_s1 at step 2)" in text
    assert "  grpo_s0  finished     4/4\n" in text


def test_an_invocation_in_progress_and_one_that_never_ended(plan):
    out = plan.out
    out.mkdir()
    (out / "plan.json").write_text("{}")
    for name in ("ict_s0", "ict_s1", "grpo_s1"):
        _run(out, name, 4, finished=True)
    _run(out, "grpo_s0", 4)  # every step logged, its evaluation not finished
    start = {"event": "start", "id": "c", "start": "2026-01-01T10:00:00+00:00", "max_hours": 2.5}
    _jsonl(out / "invocations.jsonl", [start])
    with hold_output_dir(out, "out"):
        st = experiment_status(plan.path)
        assert st["held_by"].startswith("process ") and st["invocation"]["id"] == "c"
        assert [r.state for r in st["runs"]] == ["finished", "finished", "evaluating", "finished"]
        assert st["base"].state == "pending" and st["steps_left"] == 0 and st["evaluations_left"] == 2
        text = format_status(st)
        assert "\nrunning: process " in text
        assert "its time box ends at 2026-01-01T12:30+00:00 (no step or evaluation starts that would end past it)" in text
        assert text.endswith("left: 2 evaluations (no pace measured yet)")
    st = experiment_status(plan.path)  # released, but the start line has no end: killed or lost
    assert st["held_by"] is None and st["runs"][2].state == "to evaluate"
    assert "has no end in invocations.jsonl: it was killed or its machine lost" in format_status(st)
    (out / "runs" / "grpo_s0" / "summary.json").write_text(json.dumps({"status": "finished", "steps": 4}))
    base = out / "runs" / "base"
    base.mkdir()
    (base / "summary.json").write_text(json.dumps({"status": "finished", "steps": 0}))
    assert format_status(experiment_status(plan.path)).endswith(
        "complete: every run and evaluation of the plan is done")


def test_a_record_without_its_working_folder_points_to_recover(plan):
    plan.record.mkdir(parents=True, exist_ok=True)
    (plan.record / "experiment.json").write_text("{}")
    st = experiment_status(plan.path)
    assert st["working_folder"] is False and [r.state for r in st["runs"]] == ["pending"] * 4
    assert "continue with --recover" in format_status(st)


def test_the_time_left_by_hand():
    assert _left(0, None, 0, None) == "complete: every run and evaluation of the plan is done"
    assert _left(10, 60.0, 1, 600.0) == ("left: about 20m00s (10 steps x 1m00s + 1 evaluation x 10m00s) at "
                                         "the last invocation's pace")
    assert _left(1, 90.0, 3, None) == ("left: about 1m30s (1 step x 1m30s) at the last invocation's pace + "
                                       "3 evaluations (no pace measured yet)")


def test_the_time_left_less_what_the_work_in_progress_has_run_by_hand():
    assert _left(10, 60.0, 1, 600.0, ("step", 20.0)) == (
        "left: about 19m40s (10 steps x 1m00s + 1 evaluation x 10m00s, less the 20s the step in progress has run) "
        "at the last invocation's pace")
    assert _left(0, 60.0, 2, 600.0, ("evaluation", 450.0)) == (
        "left: about 12m30s (2 evaluations x 10m00s, less the 7m30s the evaluation in progress has run) at the "
        "last invocation's pace")
    # past its pace: the one in progress counts as done, never as negative time
    assert _left(0, 60.0, 1, 600.0, ("evaluation", 700.0)) == (
        "left: only what is in progress (1 evaluation x 10m00s; the evaluation in progress has run 11m40s, past "
        "that pace) at the last invocation's pace")
    assert _left(3, None, 1, 600.0, ("step", 20.0)) == (  # no step pace: nothing to take from
        "left: about 10m00s (1 evaluation x 10m00s) at the last invocation's pace + 3 steps (no pace measured yet)")


def test_the_work_in_progress_runs_from_the_experiment_s_latest_event(plan):
    out = plan.out
    out.mkdir()
    (out / "plan.json").write_text("{}")
    t0 = 1_800_000_000.0
    start = datetime.datetime.fromtimestamp(t0, datetime.timezone.utc).isoformat()
    _jsonl(out / "invocations.jsonl", [{"event": "start", "id": "d", "start": start}])
    done = _run(out, "ict_s0", 4, finished=True)
    os.utime(done / "metrics.jsonl", (t0 + 500, t0 + 500))  # its evaluation ended at t0 + 500
    training = _run(out, "ict_s1", 2)
    os.utime(training / "metrics.jsonl", (t0 + 900, t0 + 900))  # its second step ended at t0 + 900
    _jsonl(out / "chunks.jsonl", [{"run": "ict_s0", "from": 0, "to": 4, "status": "paused", "wall_s": 40.0,
                                   "invocation": "d"}])
    with hold_output_dir(out, "out"):
        st = experiment_status(plan.path, now=t0 + 904.0)
        assert st["runs"][1].state == "training" and st["in_progress"] == ("step", pytest.approx(4.0))
        assert format_status(st).endswith("(10 steps x 10s, less the 4s the step in progress has run) at the last "
                                          "invocation's pace + 4 evaluations (no pace measured yet)")
        for name in ("ict_s1", "grpo_s0", "grpo_s1"):  # every run done: the base model's evaluation runs
            (out / "runs" / name).mkdir(exist_ok=True)
            (out / "runs" / name / "summary.json").write_text(json.dumps({"status": "finished", "steps": 4}))
        st = experiment_status(plan.path, now=t0 + 1000.0)
        assert st["base"].state == "evaluating" and st["in_progress"] == ("evaluation", pytest.approx(100.0))
    st = experiment_status(plan.path, now=t0 + 1000.0)
    assert st["held_by"] is None and st["in_progress"] is None  # not running: nothing is in progress


def test_the_command_line_prints_it_and_refuses_flags_that_run(plan, capsys):
    assert cli_main(["compare", "--plan", str(plan.path), "--status"]) == 0
    assert capsys.readouterr().out.startswith("st: 0/16 RL steps done, 0/4 runs finished")
    assert not plan.out.exists()  # a look writes nothing
    assert cli_main(["compare", "--plan", str(plan.path), "--status", "--max-hours", "1"]) == 2
    assert "--status only reads where the experiment stands: --max-hours does not apply" in capsys.readouterr().err
    assert cli_main(["compare", "--plan", str(plan.path), "--status", "--report"]) == 2
    assert "--report does not apply" in capsys.readouterr().err
    assert cli_main(["compare", "--config", "x.yaml", "--status"]) == 2
    assert "--status" in capsys.readouterr().err
