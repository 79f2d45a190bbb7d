"""An experiment continued from its committed record after its working folder was lost.

The record (``<record>/experiment.json``, committed after every chunk) is what outlives a machine; the
working folder ``<out>`` (the run directories with their checkpoints, ``plan.json``, the invocation and
chunk logs) does not. :func:`recover_from_record` rebuilds ``<out>`` from the record so that the runner
(:mod:`ict_jax.tools.experiment`) can go on without losing anything the record holds:

- ``plan.json``, ``invocations.jsonl``: written back from the record (the plan's text, sha256 and git state;
  every invocation's start and end), so the rebuilt record repeats them;
- a **finished** (or diverged) run: its run directory is written back with its per-step metrics, its
  evaluation rows and its summary (final evaluation, wall time), and a ``restored.json`` that says it came
  from the record and holds no checkpoint; its chunks go back into ``chunks.jsonl``. It is not run again;
- the **base** evaluation, when finished: its summary, likewise;
- a run that had **started but not finished** cannot continue (its checkpoint is gone): it starts again
  from step 0, and everything the record held of it (per-step metrics, chunks, the machine and code that
  ran them) is kept as an earlier attempt in ``<out>/attempts/<run>.json`` and in the record
  (``runs.<run>.attempts``). Where the new attempt reaches a step the earlier one logged, the record
  compares the two (:func:`~ict_jax.tools.experiment_record.compare_attempt`): on the same machine and
  code they are equal bitwise, which is the runner's resume guarantee; on another machine the first
  difference is recorded.

:func:`lost_working_folder` says when there is something to recover; the runner refuses to start such an
experiment unless asked (``ict-jax compare --plan P --recover``), since a wrong ``out`` path would
otherwise look the same.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Sequence

from ict_jax.outputs import LOCK_FILE
from ict_jax.tools.experiment_plan import Plan, PlanError, base_run, plan_runs
from ict_jax.tools.experiment_record import (
    ATTEMPTS_DIR,
    BRANCH_FILE,
    CHUNKS_FILE,
    COMPILATION_CACHE,
    INVOCATIONS_FILE,
    PLAN_FILE,
    RECORD_FILE,
    RESTORED_FILE,
    RESUMED_FILE,
    STATUS_FILE,
    append_jsonl,
    steps_done,
    write_json,
)
from ict_jax.tools.provenance import now_iso
from ict_jax.train.record import write_summary

__all__ = ["END_KEYS", "lost_working_folder", "recover_from_record"]

#: the keys of an invocation that its end event wrote (the rest came with its start event)
END_KEYS = ("end", "stopped", "chunks_done", "wall_s")


def _record_has_results(record: Mapping[str, Any]) -> bool:
    runs = record.get("runs") or {}
    base = record.get("base") or {}
    return bool(record.get("invocations")) or any(r.get("steps_done") or r.get("metrics") for r in runs.values()) \
        or base.get("status") == "finished"


def lost_working_folder(plan: Plan) -> dict[str, Any] | None:
    """The plan's record when it holds results but ``<out>`` does not hold the experiment (no
    ``plan.json``): the working folder was lost (another machine, a fresh checkout) or ``out`` points
    elsewhere. None otherwise. A working folder that holds the experiment but fewer steps of a run than the
    record (a run directory lost or replaced) raises :class:`PlanError`: running on would overwrite them."""
    record_path = plan.record / RECORD_FILE
    if not record_path.is_file():
        return None
    record = json.loads(record_path.read_text())
    if not (plan.out / PLAN_FILE).is_file():
        return record if _record_has_results(record) else None
    entries = record.get("runs") or {}
    for spec in plan_runs(plan):
        recorded = int((entries.get(spec.name) or {}).get("steps_done") or 0)
        here = steps_done(spec.run_dir, plan.steps)
        if recorded > here:
            raise PlanError(f"the record {str(record_path)!r} holds {recorded} steps of run {spec.name}, its directory "
                            f"{str(spec.run_dir)!r} {here}: a run directory was lost or replaced, and running on "
                            f"would overwrite what the record holds. Put it back, or move {str(plan.out)!r} away "
                            "and pass --recover to rebuild the whole working folder from the record")
    return None


def _invocation_events(inv: Mapping[str, Any]) -> list[dict[str, Any]]:
    """An invocation of the record as the start and end events of ``invocations.jsonl`` it was built from."""
    start = {"event": "start", **{k: v for k, v in inv.items() if k not in END_KEYS}}
    if "end" not in inv:  # never ended (killed): the record's "unknown" stop is rebuilt from the start alone
        start.pop("stopped", None)
        return [start]
    return [start, {"event": "end", "id": inv["id"], **{k: inv[k] for k in END_KEYS if k in inv}}]


def _metrics_lines(rows: Sequence[Mapping[str, Any]]) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def _restore_run_dir(run_dir: Path, entry: Mapping[str, Any], when: str, record_path: Path) -> None:
    """A finished or diverged run written back from its record entry (metrics, evaluations, summary)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text(_metrics_lines(list(entry.get("metrics") or [])
                                                         + list(entry.get("evals") or [])), encoding="utf-8")
    summary: dict[str, Any] = {"status": "finished" if entry["status"] == "finished" else "stopped",
                               "steps": int(entry.get("steps_done") or 0), "wall_s": entry.get("wall_s")}
    if entry.get("eval_final") is not None:
        summary["eval_final"] = entry["eval_final"]
    write_summary(run_dir, summary)
    if entry["status"] == "diverged":
        write_json(run_dir / STATUS_FILE, {"status": "diverged", "error": entry.get("error"), "time": when})
    write_json(run_dir / RESTORED_FILE, {"restored_from": str(record_path), "time": when,
                                         "status": entry["status"], "steps_done": int(entry.get("steps_done") or 0),
                                         "checkpoint": None, "note": "written back from the experiment's record "
                                         "after its working folder was lost; no checkpoint, not run again"})


def _machines(record: Mapping[str, Any], chunks: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The machines (cpu, cores, host, backend) of the invocations that ran ``chunks``."""
    by_id = {inv.get("id"): inv.get("environment") or {} for inv in record.get("invocations") or []}
    seen: list[dict[str, Any]] = []
    for c in chunks:
        env = by_id.get(c.get("invocation")) or {}
        m = {k: env.get(k) for k in ("host", "cpu", "cores", "backend", "devices")}
        if m not in seen:
            seen.append(m)
    return seen


def recover_from_record(plan: Plan, record: Mapping[str, Any], say=print) -> dict[str, Any]:
    """Rebuild ``<out>`` from ``record`` (module docstring); returns what was done: ``{"restored": [runs
    written back], "restarted": [runs started again], "base": bool, "time": ...}``. ``<out>`` must not hold
    another experiment's files (anything but the compilation cache)."""
    if record.get("plan_sha256") != plan.sha256:
        raise PlanError(f"plan {str(plan.path)!r} changed since its record {str(plan.record / RECORD_FILE)!r} was "
                        f"written (sha256 {plan.sha256[:12]} now, {str(record.get('plan_sha256'))[:12]} on record): "
                        "a pre-registered plan is fixed")
    stray = sorted(p.name for p in plan.out.iterdir() if p.name not in (COMPILATION_CACHE, LOCK_FILE)) \
        if plan.out.is_dir() else []
    if stray:
        raise PlanError(f"--recover: {str(plan.out)!r} holds {', '.join(stray[:5])} but no {PLAN_FILE}: it is not "
                        "this experiment's working folder as the runner leaves it; move those away first")
    when = now_iso()
    record_path = plan.record / RECORD_FILE
    invocations = list(record.get("invocations") or [])
    write_json(plan.out / PLAN_FILE, {
        "sha256": record["plan_sha256"], "text": record["plan_text"], "path": record["plan_file"],
        "git": record.get("plan_git"), "first_run": invocations[0].get("start") if invocations else None,
        "restored_from_record": {"record": str(record_path), "time": when}})
    for inv in invocations:
        for event in _invocation_events(inv):
            append_jsonl(plan.out / INVOCATIONS_FILE, event)
    done: dict[str, Any] = {"restored": [], "restarted": [], "base": False, "time": when}
    entries = record.get("runs") or {}
    for spec in plan_runs(plan):
        entry = entries.get(spec.name)
        if not entry:
            continue
        earlier = list(entry.get("attempts") or [])
        if entry["status"] in ("finished", "diverged"):
            _restore_run_dir(spec.run_dir, entry, when, record_path)
            if spec.branch is not None and (entry.get("branch") or {}).get("forked"):
                write_json(spec.run_dir / BRANCH_FILE, dict(entry["branch"]))  # the checkpoint it started from
            if entry.get("resumed"):
                write_json(spec.run_dir / RESUMED_FILE, dict(entry["resumed"]))  # the branch point it resumed at
            for c in entry.get("chunks") or []:
                append_jsonl(plan.out / CHUNKS_FILE, c)
            done["restored"].append(spec.name)
        elif entry.get("steps_done") or entry.get("metrics") or entry.get("chunks"):
            earlier.append({
                "attempt": len(earlier) + 1, "status": entry["status"], "steps_done": entry.get("steps_done"),
                "lost": f"its working folder (checkpoints) was lost; started again from step 0 on {when}",
                "machines": _machines(record, entry.get("chunks") or []),
                "commits": sorted({str(c.get("commit")) for c in entry.get("chunks") or [] if c.get("commit")}),
                "chunks": entry.get("chunks") or [], "selection": entry.get("selection"),
                "metrics": entry.get("metrics") or [], "evals": entry.get("evals") or []})
            done["restarted"].append(spec.name)
        if earlier:
            write_json(plan.out / ATTEMPTS_DIR / f"{spec.name}.json", earlier)
    base = record.get("base") or {}
    if plan.evaluate_base and base.get("status") == "finished":
        b = base_run(plan)
        _restore_run_dir(b.run_dir, {"status": "finished", "steps_done": 0, "eval_final": base.get("eval_final"),
                                     "wall_s": base.get("wall_s")}, when, record_path)
        done["base"] = True
    say(f"recovered {plan.out} from {record_path}: {len(invocations)} invocation(s); written back: "
        + (", ".join(done["restored"] + (["base"] if done["base"] else [])) or "none")
        + "; started again from step 0 (checkpoints lost; the record keeps what they logged as earlier attempts): "
        + (", ".join(done["restarted"]) or "none"))
    return done
