"""Where a pre-registered experiment stands, read without its outcomes (``ict-jax compare --plan P --status``).

A look at an experiment, running or not, that cannot change it and cannot unblind whoever takes it: each
run's state and RL steps (logged, and saved in its latest checkpoint), the final evaluations left, whether
an invocation holds the experiment now (its process, since when, where its time box ends) or the last one
ended without a word (killed, or its machine lost), and the time left at the last invocation's pace, less
what the step or evaluation in progress has already run (counted from the experiment's latest event: a
metrics line written, or the invocation's start). Nothing
measured is read out: no reward, no selected fraction, no evaluation result. It takes no lock and writes
nothing, so it runs beside the invocation in progress (docs/experiments.md "Where it stands"). It sees an
invocation on this machine only (:func:`~ict_jax.outputs.held_by`): one on another machine that shares the
folder reads as not running.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ict_jax.experiments.plan import RunSpec, base_run, load_plan, plan_runs
from ict_jax.experiments.record import (
    INVOCATIONS_FILE,
    PLAN_FILE,
    RECORD_FILE,
    pace,
    read_jsonl,
    run_status,
    steps_done,
    trained_steps,
)
from ict_jax.heartbeat import duration
from ict_jax.outputs import held_by
from ict_jax.train.logs import read_metrics

__all__ = ["RunState", "experiment_status", "format_status", "STATES"]

#: a run's states: not begun; trained by the invocation in progress; stopped between steps (continues from
#: its checkpoint); all steps logged, its final evaluation running or still to run; done; stopped as diverged
STATES = ("pending", "training", "paused", "evaluating", "to evaluate", "finished", "diverged")


@dataclass(frozen=True)
class RunState:
    """One run of the plan (or the base model's evaluation, ``name`` "base"): its state (:data:`STATES`), the
    RL steps its metrics log holds and the step of its latest checkpoint (what a stopped run continues from)."""

    name: str
    state: str
    logged: int
    saved: int

    @property
    def done(self) -> int:
        """The steps that count as done: a paused run continues from its checkpoint (it logs the steps
        after it again), any other from what it logged."""
        return self.saved if self.state == "paused" else self.logged


def _logged_steps(run_dir: Path) -> int:
    metrics = run_dir / "metrics.jsonl"
    return len({int(r["step"]) for r in read_metrics(metrics, "rl")}) if metrics.is_file() else 0


def _run_state(spec: RunSpec, status: str, steps: int, active: bool) -> RunState:
    d = spec.run_dir
    saved = steps_done(d, steps)
    logged = max(_logged_steps(d), saved)
    if status in ("finished", "diverged"):
        state = status
    elif status == "pending":
        state = "pending"
    elif logged >= steps:
        state = "evaluating" if active else "to evaluate"
    else:
        state = "training" if active else "paused"
    return RunState(spec.name, state, logged, saved)


def _active(specs: list[RunSpec], statuses: dict[str, str]) -> str | None:
    """The run an invocation in progress works on: the unfinished run whose metrics log changed last."""
    best, when = None, -1.0
    for spec in specs:
        metrics = spec.run_dir / "metrics.jsonl"
        if metrics.is_file() and statuses[spec.name] not in ("finished", "diverged"):
            t = metrics.stat().st_mtime
            if t > when:
                best, when = spec.name, t
    return best


def _open_invocation(out: Path) -> dict[str, Any] | None:
    """The last invocation's start line when no end line follows it (running, or killed), else None."""
    ended, last = set(), None
    for e in read_jsonl(out / INVOCATIONS_FILE):
        if e.get("event") == "start":
            last = e
        elif e.get("event") == "end":
            ended.add(e.get("id"))
    return last if last is not None and last.get("id") not in ended else None


def _since(specs: list[RunSpec], invocation: dict[str, Any] | None) -> float | None:
    """When the work in progress began (seconds since the epoch): the latest metrics line any run wrote (a
    step ends, an evaluation ends) or the invocation's start, whichever came last; None when neither is known."""
    times = [m.stat().st_mtime for s in specs if (m := s.run_dir / "metrics.jsonl").is_file()]
    try:
        times.append(datetime.datetime.fromisoformat(str((invocation or {}).get("start"))).timestamp())
    except ValueError:
        pass
    return max(times) if times else None


def experiment_status(plan_path: str | Path, now: float | None = None) -> dict[str, Any]:
    """Where the experiment of the plan at ``plan_path`` stands (module docstring), as a dict that
    :func:`format_status` prints: ``name``, ``out``, ``record``, ``steps`` (a run's), ``runs`` and ``base``
    (:class:`RunState`; base None when the plan evaluates no base model), ``held_by`` (the invocation's
    process, or None), ``invocation`` (its start line when it has no end yet), ``steps_trained`` and
    ``steps_planned`` (the RL steps the runs train themselves, as the record counts them: a branched run's
    steps up to its branch point are its parent's), ``branches`` (a branched run's parent and branch step by
    name), ``steps_left``,
    ``evaluations_left``, ``step_s`` and ``eval_s`` (the last invocation's pace, or None), ``working_folder``
    (False when the record holds results that ``out`` does not: the machine was lost), ``in_progress``
    (while an invocation holds it: ``(what, seconds)``, the step or evaluation in progress and how long it has
    run by ``now``, time.time() by default; else None)."""
    plan = load_plan(plan_path)
    specs = plan_runs(plan)
    holder = held_by(plan.out)
    statuses = {s.name: run_status(s.run_dir, plan.steps) for s in specs}
    active = _active(specs, statuses) if holder else None
    runs = [_run_state(s, statuses[s.name], plan.steps, s.name == active) for s in specs]
    base = None
    if plan.evaluate_base:
        b = base_run(plan)
        done = run_status(b.run_dir, 0) == "finished"
        runs_done = all(r.state in ("finished", "diverged") for r in runs)
        base = RunState("base", "finished" if done else "evaluating" if holder and runs_done else "pending", 0, 0)
    unfinished = [(s, r) for s, r in zip(specs, runs) if r.state not in ("finished", "diverged")]
    own = {s.name: plan.steps - s.first_step for s in specs}  # a branched run trains from its branch point
    trained = {s.name: trained_steps(s, min(r.done, plan.steps)) for s, r in zip(specs, runs)}
    step_s, eval_s = pace(plan, specs)
    record = plan.record / RECORD_FILE
    invocation = _open_invocation(plan.out)
    in_progress = None
    working = [r.state for r in runs] + ([base.state] if base is not None else [])  # training/evaluating: held only
    what = "step" if "training" in working else "evaluation" if "evaluating" in working else None
    since = _since(specs, invocation) if what else None
    if since is not None:
        in_progress = (what, max(0.0, (time.time() if now is None else now) - since))
    return {
        "name": plan.name, "out": str(plan.out), "record": str(record), "steps": plan.steps, "runs": runs,
        "base": base, "held_by": holder, "invocation": invocation, "in_progress": in_progress,
        "steps_trained": sum(trained.values()), "steps_planned": sum(own.values()),
        "steps_left": sum(own[s.name] - trained[s.name] for s, _ in unfinished),
        "branches": {s.name: (s.parent, s.branch.step) for s in specs if s.branch is not None},
        "evaluations_left": sum(1 for s, _ in unfinished if s.config.data.eval)
        + int(base is not None and base.state != "finished"),
        "step_s": step_s, "eval_s": eval_s,
        "working_folder": (plan.out / PLAN_FILE).is_file() or not record.is_file(),
    }


def _box_end(invocation: dict[str, Any]) -> str | None:
    hours = invocation.get("max_hours")
    try:
        start = datetime.datetime.fromisoformat(str(invocation.get("start")))
    except ValueError:
        return None
    if not hours:
        return None
    return (start + datetime.timedelta(hours=float(hours))).isoformat(timespec="minutes")


def _left(steps: int, step_s: float | None, evals: int, eval_s: float | None,
          in_progress: tuple[str, float] | None = None) -> str:
    """The time left: the steps at the seconds a step, the evaluations at the seconds an evaluation, less
    what the one in progress (``in_progress``: ``("step" | "evaluation", seconds it has run)``) has run, up
    to its pace."""
    if not steps and not evals:
        return "complete: every run and evaluation of the plan is done"
    known, unknown, total, note = [], [], 0.0, ""
    for n, what, secs in ((steps, "steps", step_s), (evals, "evaluations", eval_s)):
        if not n:
            continue
        label = f"{n} {what if n != 1 else what[:-1]}"
        if secs is None:
            unknown.append(label)
            continue
        known.append(f"{label} x {duration(secs)}")
        total += n * secs
        if in_progress is not None and in_progress[0] == what[:-1]:
            ran = in_progress[1]
            total -= min(ran, secs)
            note = (f", less the {duration(ran)} the {what[:-1]} in progress has run" if ran <= secs
                    else f"; the {what[:-1]} in progress has run {duration(ran)}, past that pace")
    head = f"about {duration(total)}" if total > 0 else "only what is in progress"
    text = f"left: {head} ({' + '.join(known)}{note}) at the last invocation's pace" if known else ""
    if unknown:
        text = (f"{text} + " if text else "left: ") + f"{' and '.join(unknown)} (no pace measured yet)"
    return text


def format_status(status: dict[str, Any]) -> str:
    """The text ``--status`` prints: a head line, the invocation, one line a run, the time left."""
    runs: list[RunState] = status["runs"]
    steps = status["steps"]
    finished = sum(r.state == "finished" for r in runs)
    base = status["base"]
    lines = [f"{status['name']}: {status['steps_trained']}/{status['steps_planned']} RL steps done, "
             f"{finished}/{len(runs)} runs finished"
             + ("" if base is None else f", base model {'evaluated' if base.state == 'finished' else 'not evaluated'}")
             + f" (working folder {status['out']}, record {status['record']})"]
    inv = status["invocation"]
    if status["held_by"]:
        box = _box_end(inv) if inv else None
        lines.append(f"running: {status['held_by']}"
                     + (f"; its time box ends at {box} (no step or evaluation starts that would end past it)"
                        if box else ""))
    elif inv is not None:
        lines.append(f"not running; the last invocation (started {inv.get('start')}) has no end in "
                     f"{INVOCATIONS_FILE}: it was killed or its machine lost (the same command continues each run "
                     "from its last checkpoint)")
    else:
        lines.append("not running")
    if not status["working_folder"]:
        lines.append("the record holds results the working folder does not (another machine's): continue with "
                     "--recover (docs/experiments.md)")
    width = max(len(r.name) for r in [*runs, *([base] if base else [])])
    for r in runs:
        more = f" ({r.logged} logged, continues from its checkpoint)" if r.state == "paused" and r.logged > r.saved \
            else f" (checkpoint at {r.saved})" if r.state == "training" and r.saved != r.logged else ""
        parent = status["branches"].get(r.name)
        more += f" (from {parent[0]} at step {parent[1]})" if parent else ""
        lines.append(f"  {r.name:<{width}}  {r.state:<11}  {min(r.done, steps)}/{steps}{more}")
    if base is not None:
        lines.append(f"  {base.name:<{width}}  {base.state:<11}  final evaluation of the starting model")
    lines.append(_left(status["steps_left"], status["step_s"], status["evaluations_left"], status["eval_s"],
                       status.get("in_progress")))
    return "\n".join(lines)

