"""The record of a pre-registered experiment, ``experiment.json`` (:mod:`ict_jax.tools.experiment`): built
from what is on disk alone (the plan as first recorded, the invocations, the chunks, and every run
directory's metrics and summary), so it can be rebuilt at any time and never disagrees with the runs.

Layout (docs/experiments.md)::

    {"format": 1, "plan": {...}, "plan_file", "plan_sha256", "plan_text", "plan_git": {commit, clean, ...},
     "environment": {...}  (the first invocation's), "invocations": [...], "status": {...},
     "runs": {"<arm>_s<seed>": {arm, seed, run_dir, status, steps_done, metrics: [per-step rows],
                                selection: {selected_frac, sparse_steps, dense_steps, steps, all_selected},
                                eval_final, wall_s, chunks: [...], outcomes: {name: value},
                                restored?: {...}, attempts?: [{attempt, lost, machines, commits, chunks,
                                metrics, ..., comparison: {steps_compared, steps_equal, first_difference}}]}},
     "base": {status, eval_final, run_dir} | null,
     "design": {n_seeds, df, assumed_sd, alpha, power, mde, note},
     "outcomes": [{name, metric, steps?, primary, per_arm: {arm: {mean, sd, n, values: {seed: v}}},
                   paired: [{arm, reference, seeds, diffs, mean, sd, n, se, t, df, p}]}]}
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

from ict_jax.tools.compare_report import dense_steps, has_checkpoint, pass_at_k, selection
from ict_jax.tools.experiment_plan import Outcome, Plan, RunSpec, base_run, differing_keys, plan_runs
from ict_jax.tools.experiment_stats import mean_sd, minimum_detectable_effect, paired_differences
from ict_jax.train.checkpoints import Checkpointer
from ict_jax.train.evaluation import eval_results
from ict_jax.train.logs import read_metrics
from ict_jax.train.record import read_summary

__all__ = ["FORMAT", "RECORD_FILE", "PLAN_FILE", "INVOCATIONS_FILE", "CHUNKS_FILE", "STATUS_FILE", "RESTORED_FILE",
           "COMPILATION_CACHE", "ATTEMPTS_DIR", "SAMPLE_METRICS", "build_record", "read_attempts", "compare_attempt",
           "write_json", "run_status", "steps_done", "read_branch", "trained_steps", "BRANCH_FILE",
           "RESUMED_FILE",
           "chunk_eval_seconds", "eval_seconds", "pace", "outcome_value", "append_jsonl",
           "read_jsonl"]

FORMAT = 1
RECORD_FILE = "experiment.json"  # in the plan's record folder
PLAN_FILE = "plan.json"  # in <out>: the plan as first run (text, sha256, git state)
INVOCATIONS_FILE = "invocations.jsonl"  # in <out>: one start and one end line per invocation
CHUNKS_FILE = "chunks.jsonl"  # in <out>: one line per run chunk done
STATUS_FILE = "experiment_status.json"  # in a run directory: a run the experiment stopped (diverged)
RESTORED_FILE = "restored.json"  # in a run directory written back from the record (experiment_recover)
COMPILATION_CACHE = "jax_cache"  # in <out>: the persistent compilation cache of an experiment
BRANCH_FILE = "branch.json"  # in a branched run's directory: the parent's checkpoint it started from
RESUMED_FILE = "resumed.json"  # in a lost run's directory resumed at a branch point (experiments.branch.resume)
ATTEMPTS_DIR = "attempts"  # in <out>: one JSON list per run started again from step 0 (experiment_recover)
#: per-step metrics that measure the machine, not the run: not compared between attempts of a run
IGNORED_IN_COMPARISON = ("time/", "throughput/")
#: per-step metrics that only the sampled tokens decide (counts and rewards, no float arithmetic of the
#: model): equal in two attempts whose rollouts were the same token for token
SAMPLE_METRICS = ("reward/mean", "reward/accuracy", "response/length_mean", "response/truncated_frac")


def write_json(path: Path, data: Any) -> Path:
    """``data`` as indented JSON, written atomically (a crash leaves the old file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=False, default=str) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


def append_jsonl(path: Path, row: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(row, default=str) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The rows of a JSON-lines file; a last line cut by a crash is ignored."""
    if not Path(path).is_file():
        return []
    rows = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


# ------------------------------------------------------------------------------------------------
# A run on disk
# ------------------------------------------------------------------------------------------------
def steps_done(run_dir: Path, steps: int) -> int:
    """RL steps a run directory holds for good: all of them when its summary says finished, else its
    latest checkpoint's step (what a resumed run continues from), else 0; a run directory written back
    from the record (``restored.json``): the steps it held."""
    restored = run_dir / RESTORED_FILE
    if restored.is_file():
        return int(json.loads(restored.read_text()).get("steps_done", 0))
    summary = read_summary(run_dir) if run_dir.is_dir() else None
    if summary is not None and summary.get("status") == "finished":
        return int(summary.get("steps", steps))
    if not has_checkpoint(run_dir):
        return 0
    with Checkpointer(run_dir / "checkpoints", read_only=True) as ck:
        return int(ck.latest_step() or 0)


def read_branch(run_dir: Path) -> dict[str, Any] | None:
    """A branched run's ``branch.json`` (:mod:`ict_jax.tools.experiment_branch`; None for a run that did not
    branch, or has not yet)."""
    path = run_dir / BRANCH_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def trained_steps(spec: RunSpec, done: int) -> int:
    """The RL steps of ``done`` that ``spec``'s run trained itself: a branched run's first steps are its
    parent's (0 until it has branched)."""
    if spec.branch is None:
        return done
    return max(0, done - spec.branch.step) if read_branch(spec.run_dir) is not None else 0


def run_status(run_dir: Path, steps: int) -> str:
    """``finished``, ``diverged`` (the experiment stopped it), ``started`` (some steps done), or ``pending``."""
    status_file = run_dir / STATUS_FILE
    if status_file.is_file():
        return str(json.loads(status_file.read_text()).get("status", "stopped"))
    summary = read_summary(run_dir) if run_dir.is_dir() else None
    if summary is not None and summary.get("status") == "finished":
        return "finished"
    metrics = run_dir / "metrics.jsonl"
    return "started" if (metrics.is_file() and metrics.stat().st_size > 0) or steps_done(run_dir, steps) else "pending"


def eval_seconds(run_dir: Path, step: int) -> float | None:
    """The seconds the evaluation of ``run_dir`` at ``step`` took (its results' per-benchmark ``seconds``);
    None when it has none (no evaluation set, or it did not run)."""
    path = eval_results(run_dir, step)
    try:
        benches = json.loads(path.read_text()).get("benchmarks", {})
        return float(sum(b["seconds"] for b in benches.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def chunk_eval_seconds(run_dir: Path, start: int, done: int, finished: bool) -> float | None:
    """The seconds a run's chunk from RL step ``start`` to ``done`` spent evaluating: the evaluations after
    its steps (``train.eval_every``) and, when ``finished``, its final one (at its last step, or after it
    when the chunk only evaluated); None when it evaluated nothing."""
    found = [eval_seconds(run_dir, s) for s in range(start + 1, done + 1)]
    if finished and done == start:
        found.append(eval_seconds(run_dir, done))
    found = [v for v in found if v is not None]
    return sum(found) if found else None


def pace(plan: Plan, specs: Sequence[RunSpec]) -> tuple[float | None, float | None]:
    """Seconds an RL step and seconds a final evaluation took in the last invocation that measured them
    (``chunks.jsonl``: a chunk's wall time less its final evaluation's, over its steps; the evaluation's own
    seconds); None for what none measured. The time left (``--status``) and the time box's expectations
    before an invocation has measured its own (:mod:`ict_jax.tools.experiment_box`) read it."""
    by_name = {s.name: s for s in specs}
    step_s: dict[str, list[float]] = {}
    eval_s: list[float] = []
    for row in read_jsonl(plan.out / CHUNKS_FILE):
        spec = by_name.get(row.get("run"))
        if spec is None:
            continue
        ev = chunk_eval_seconds(spec.run_dir, int(row.get("from", 0)), int(row.get("to", 0)),
                                row.get("status") == "finished")
        if ev is not None:
            eval_s.append(ev)
        n = int(row.get("to", 0)) - int(row.get("from", 0))
        if n > 0:
            step_s.setdefault(row.get("invocation", ""), []).append((float(row["wall_s"]) - (ev or 0.0)) / n)
    last = list(step_s.values())[-1] if step_s else []
    return (sum(last) / len(last) if last else None), (eval_s[-1] if eval_s else None)


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def outcome_value(outcome: Outcome, rows: Sequence[Mapping[str, Any]], eval_final: Mapping[str, Any] | None,
                  evals: Sequence[Mapping[str, Any]] = ()) -> float | None:
    """One run's value of ``outcome``: the mean of its metric over RL steps first..last (1-based; rows are
    0-based steps), None until every one of those steps is logged or when none has a finite value; a
    final-evaluation outcome from ``eval_final`` (``eval/pass@k``: the mean over benchmarks), one at step
    ``outcome.at`` from the evaluation row logged at that step (``evals``; None until there is one)."""
    if outcome.final_eval:
        if outcome.at is not None:
            eval_final = next((r for r in evals if int(r["step"]) == outcome.at), None)
        if not eval_final:
            return None
        if outcome.metric in eval_final:
            v = eval_final[outcome.metric]
            return float(v) if _finite(v) else None
        k = outcome.metric[len("eval/pass@"):] if outcome.metric.startswith("eval/pass@") else None
        if k is not None and k.isdigit():
            return pass_at_k(eval_final).get(int(k))
        return None
    want = range(outcome.first - 1, outcome.last)
    by_step = {int(r["step"]): r for r in rows}
    if any(s not in by_step for s in want):
        return None
    vals = [float(by_step[s][outcome.metric]) for s in want if _finite(by_step[s].get(outcome.metric))]
    return math.fsum(vals) / len(vals) if vals else None


def _json_rows(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Metrics rows with non-finite floats as text ("nan", "inf"), as metrics.jsonl keeps them."""
    return [{k: (v if not isinstance(v, float) or math.isfinite(v) else str(v)) for k, v in r.items()} for r in rows]


def read_run(spec: RunSpec, steps: int, chunks: Sequence[Mapping[str, Any]], out_dir: Path | None = None,
             ) -> dict[str, Any]:
    """One run's entry of the record from its directory (and, with the experiment's ``out_dir``, its
    earlier attempts, each compared with this one step by step)."""
    d = spec.run_dir
    metrics = d / "metrics.jsonl"
    rl_rows = read_metrics(metrics, "rl") if metrics.is_file() else []
    eval_rows = read_metrics(metrics, "eval") if metrics.is_file() else []
    summary = (read_summary(d) or {}) if d.is_dir() else {}
    status = run_status(d, steps)
    done = steps_done(d, steps)
    if status != "diverged":  # rows past the last checkpoint are logged again when the run resumes
        rl_rows = [r for r in rl_rows if int(r["step"]) < done]
    selector = spec.config.rl.selector
    out = {"arm": spec.arm, "seed": spec.seed, "run_dir": str(d), "status": status, "steps_done": done,
           "metrics": _json_rows(rl_rows), "evals": _json_rows(eval_rows),
           "selection": selection(rl_rows, dense_steps(selector.method, selector.warmup_steps)),
           "eval_final": summary.get("eval_final") if status == "finished" else None,
           "wall_s": summary.get("wall_s"), "chunks": [c for c in chunks if c.get("run") == spec.name]}
    if status == "diverged":
        out["error"] = json.loads((d / STATUS_FILE).read_text()).get("error")
    if (d / RESTORED_FILE).is_file():
        out["restored"] = json.loads((d / RESTORED_FILE).read_text())
    if spec.branch is not None:
        out["branch"] = {"from": spec.parent, "step": spec.branch.step, **(read_branch(d) or {"forked": None})}
    if (d / RESUMED_FILE).is_file():
        out["resumed"] = json.loads((d / RESUMED_FILE).read_text())
    attempts = read_attempts(spec.name, out_dir) if out_dir is not None else []
    if attempts:
        out["attempts"] = [{**a, "comparison": compare_attempt(out["metrics"], a.get("metrics") or [])}
                           for a in attempts]
    return out


def read_attempts(name: str, out: Path) -> list[dict[str, Any]]:
    """The earlier attempts of a run (``<out>/attempts/<run>.json``), oldest first; [] when none."""
    path = Path(out) / ATTEMPTS_DIR / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else []


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def compare_attempt(rows: Sequence[Mapping[str, Any]], earlier: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The steps both attempts logged, compared metric by metric (every key but the machine's timings,
    :data:`IGNORED_IN_COMPARISON`): ``{"steps_compared", "steps_equal", "first_difference": {"step",
    "metrics": {key: [earlier, now]}} | None, "steps_same_samples", "first_sample_difference": step |
    None}``. ``steps_equal`` counts the leading steps equal in every metric (bitwise: the values as
    logged); ``steps_same_samples`` the leading steps equal in :data:`SAMPLE_METRICS`, those of attempts
    that sampled the same tokens though their floats differ in the last bits (another CPU)."""
    now = {int(r["step"]): r for r in rows}
    before = {int(r["step"]): r for r in earlier}
    common = sorted(set(now) & set(before))
    equal, first = 0, None
    for s in common:
        keys = sorted(k for k in set(now[s]) | set(before[s]) if not k.startswith(IGNORED_IN_COMPARISON))
        diff = {k: [before[s].get(k), now[s].get(k)] for k in keys if not _same(before[s].get(k), now[s].get(k))}
        if diff:
            first = {"step": s, "metrics": diff}
            break
        equal += 1
    same, first_sample = 0, None
    for s in common:
        if any(not _same(before[s].get(k), now[s].get(k)) for k in SAMPLE_METRICS):
            first_sample = s
            break
        same += 1
    return {"steps_compared": len(common), "steps_equal": equal, "first_difference": first,
            "steps_same_samples": same, "first_sample_difference": first_sample}


# ------------------------------------------------------------------------------------------------
# The record
# ------------------------------------------------------------------------------------------------
def _design(plan: Plan) -> dict[str, Any]:
    d = plan.design
    n = len(plan.seeds)
    alpha, power = float(d.get("alpha", 0.05)), float(d.get("power", 0.8))
    sd = d.get("assumed_sd")
    mde = minimum_detectable_effect(float(sd), n, alpha, power) if sd is not None else None
    return {"n_seeds": n, "df": n - 1 if n > 1 else None, "assumed_sd": sd, "alpha": alpha, "power": power,
            "mde": mde, "outcome": plan.primary.name, "note": d.get("note", "")}


def _outcomes(plan: Plan, runs: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for i, o in enumerate(plan.outcomes):
        per_arm = {}
        for arm in plan.arm_names:
            values = {r["seed"]: r["outcomes"].get(o.name) for r in runs.values() if r["arm"] == arm}
            per_arm[arm] = {**mean_sd(values.values()), "values": {str(s): v for s, v in values.items()}}
        paired = []
        for ref in plan.reference_arms:
            for arm in plan.arm_names:
                if arm == ref:
                    continue
                a = {s: v for s, v in ((int(k), v) for k, v in per_arm[arm]["values"].items())}
                r = {s: v for s, v in ((int(k), v) for k, v in per_arm[ref]["values"].items())}
                paired.append({"arm": arm, "reference": ref, **paired_differences(a, r)})
        out.append({**o.to_dict(), "primary": i == 0, "per_arm": per_arm, "paired": paired})
    return out


def build_record(plan: Plan, *, plan_info: Mapping[str, Any]) -> dict[str, Any]:
    """The record of ``plan`` from disk (module docstring). ``plan_info``: ``<out>/plan.json``, the plan as
    first run (its text, sha256 and git state)."""
    specs = plan_runs(plan)
    chunks = read_jsonl(plan.out / CHUNKS_FILE)
    runs = {}
    for spec in specs:
        r = read_run(spec, plan.steps, chunks, plan.out)
        r["outcomes"] = {o.name: outcome_value(o, r["metrics"], r["eval_final"], r["evals"]) for o in plan.outcomes}
        runs[spec.name] = r
    base = None
    if plan.evaluate_base:
        b = base_run(plan)
        summary = (read_summary(b.run_dir) or {}) if b.run_dir.is_dir() else {}
        finished = summary.get("status") == "finished"
        base = {"run_dir": str(b.run_dir), "seed": b.seed, "status": "finished" if finished else "pending",
                "eval_final": summary.get("eval_final") if finished else None, "wall_s": summary.get("wall_s")}
    invocations = _invocations(read_jsonl(plan.out / INVOCATIONS_FILE))
    total = sum(plan.steps - spec.first_step for spec in specs)  # a branched run trains from its branch point
    done = sum(trained_steps(spec, runs[spec.name]["steps_done"]) for spec in specs)
    finished = sum(r["status"] == "finished" for r in runs.values())
    complete = finished + sum(r["status"] == "diverged" for r in runs.values()) == len(specs) \
        and (base is None or base["status"] == "finished")
    return {
        "format": FORMAT, "name": plan.name, "plan_file": str(plan.path), "plan_sha256": plan_info["sha256"],
        "plan_git": plan_info.get("git"), "plan_text": plan_info["text"], "plan": plan.to_dict(),
        "arm_differences": differing_keys(specs),
        "environment": invocations[0]["environment"] if invocations else None, "invocations": invocations,
        "status": {"complete": complete, "runs": len(specs), "runs_finished": finished, "steps_done": done,
                   "steps_planned": total},
        "design": _design(plan), "runs": runs, "base": base, "outcomes": _outcomes(plan, runs),
    }


def _invocations(events: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Start and end events paired by invocation id, in order of start."""
    by_id: dict[str, dict[str, Any]] = {}
    for e in events:
        inv = by_id.setdefault(e["id"], {"id": e["id"]})
        if e.get("event") == "start":
            inv.update({k: v for k, v in e.items() if k not in ("event",)})
            inv.setdefault("stopped", "unknown (no end recorded: killed?)")
        elif e.get("event") == "end":
            inv.update({k: v for k, v in e.items() if k not in ("event", "id")})
    return sorted(by_id.values(), key=lambda i: i.get("start", ""))
