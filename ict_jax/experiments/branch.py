"""Branched arms of an experiment (docs/experiments.md "Branching"): an arm whose plan says
``branch: {from: PARENT, step: S}`` starts each of its runs from the parent arm's checkpoint at RL step S
of the same seed, so the arms share their first S steps exactly and pay for them once.

When the parent's run reaches S (a chunk end, so it pauses there with a checkpoint), :func:`take_snapshot`
copies that checkpoint and the parent's metrics rows of steps 1..S (its evaluations up to S too) into
``<out>/branches/<parent>@S`` (the parent's own checkpoints are pruned by ``train.keep`` as it trains on).
When the branched run's first turn comes, :func:`fork` lays out its run directory from the snapshot: the
checkpoint, those metrics rows, its own ``config.json`` and ``branch.json`` (the parent, the step, the
snapshot and the sha256 of its checkpoint files). From there the run is an ordinary run directory resumed at
step S: every random stream continues at its step, the data position is the parent's, so its step S+1
samples the parent's rollouts, and a stop and a continue end bitwise equal to a run never stopped.

Both are written into a temporary folder and renamed into place, so a kill leaves either nothing or the
whole snapshot / run directory. A snapshot lost with its machine (the working folder rebuilt from the record)
is taken again from a re-derivation: the parent's config trained again from step 0 to S in
``<out>/branches/<parent>@S.rederive`` (:func:`rederive_spec`, trained by the runner like any run, without
its evaluations: the snapshot takes the parent's as recorded), compared
step by step with the parent's recorded rows (bitwise on the same machine and code; on another CPU the floats
part in their last bits, and the samples follow once one token differs). The snapshot and every branched run
started from it say so (``rederived``: the folder and the comparison). The parent's recorded rows are its run
directory's, or, for a parent itself started again from step 0 after a lost working folder, its latest
earlier attempt's that reached S (:func:`recorded_rows`).

A parent run lost that way after it had reached a branch point resumes from that branch point instead of
from step 0 (:func:`resume_point`, :func:`resume`): its snapshot, re-derived when lost, holds its checkpoint
at S, and when the re-derivation sampled the same tokens as the attempt at every step, the run's directory is
laid out from it as a branched one is, with the evaluations the attempt recorded up to S and ``resumed.json``
(the attempt, the snapshot, the comparison). Its steps up to S are then trained once for the parent and its
branched arms together, and its evaluations there are not run again. Where the samples parted, the recorded
evaluations are another trajectory's: the run starts from step 0.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

from ict_jax.experiments.plan import Plan, PlanError, RunSpec
from ict_jax.experiments.provenance import now_iso
from ict_jax.experiments.record import (
    BRANCH_FILE,
    RESUMED_FILE,
    compare_attempt,
    read_attempts,
    read_branch,
    write_json,
)
from ict_jax.train.checkpoints import Checkpointer
from ict_jax.train.logs import read_metrics

__all__ = ["SNAPSHOTS_DIR", "snapshot_dir", "take_snapshot", "fork", "branch_points", "rederive_spec",
           "needs_rederive", "branch_point_lost", "recorded_rows", "resume_point", "resume"]

SNAPSHOTS_DIR = "branches"  # in <out>: <parent run>@<step>/, the parent's checkpoint at a branch point
_SNAPSHOT_FILE = "snapshot.json"
_METRICS = "metrics.jsonl"


def snapshot_dir(plan: Plan, parent: str, step: int) -> Path:
    return plan.out / SNAPSHOTS_DIR / f"{parent}@{step}"


def branch_points(plan: Plan, spec: RunSpec) -> list[int]:
    """The steps at which arms branch from ``spec``'s arm (empty when none does)."""
    return sorted({a.branch.step for a in plan.arms if a.branch is not None and a.branch.arm == spec.arm})


def _digest(folder: Path) -> str:
    """sha256 over the relative paths and contents of every file under ``folder``, in sorted order."""
    h = hashlib.sha256()
    for p in sorted(q for q in folder.rglob("*") if q.is_file()):
        h.update(str(p.relative_to(folder)).encode() + b"\0")
        with open(p, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def _rows(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / _METRICS
    return read_metrics(path, None) if path.is_file() else []


def recorded_rows(plan: Plan, run: RunSpec, step: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]], str | None]:
    """``run``'s rows as recorded up to ``step``: (its RL rows of steps 1..``step``, its evaluation rows up to
    it, where they come from). From its run directory when that logged ``step`` RL steps (``"run"``) and was
    not laid out from a branch point at or past ``step`` (:func:`resume`: those rows are the snapshot's),
    else from its latest earlier attempt that did (``"attempt N"``: a run started again from step 0 after a
    lost working folder, :mod:`ict_jax.experiments.recover`), else ``([], [], None)``."""
    rows = _rows(run.run_dir)
    rl = [r for r in rows if r.get("phase", "rl") == "rl" and int(r["step"]) < step]
    resumed = run.run_dir / RESUMED_FILE
    if len(rl) >= step and not (resumed.is_file() and int(json.loads(resumed.read_text())["step"]) >= step):
        return rl, [r for r in rows if r.get("phase") == "eval" and int(r["step"]) <= step], "run"
    for a in reversed(read_attempts(run.name, plan.out)):
        rl = [r for r in a.get("metrics") or [] if int(r["step"]) < step]
        if len(rl) >= step:
            return rl, [r for r in a.get("evals") or [] if int(r["step"]) <= step], f"attempt {a['attempt']}"
    return [], [], None


def _metrics_lines(run_dir: Path, step: int, evals: list[dict[str, Any]] | None = None) -> str:
    """A run's metrics up to ``step`` as JSON lines: the RL rows of steps 1..``step`` (0-based < step) and the
    evaluation rows up to it (an ``eval`` row's step is the number of RL steps done), ``evals`` when given (a
    re-derivation does not evaluate: its parent's evaluations, as recorded, are the policy's)."""
    rows = _rows(run_dir)
    keep = [r for r in rows if int(r["step"]) < step if r.get("phase", "rl") == "rl"]
    keep += [r for r in (rows if evals is None else evals) if int(r["step"]) <= step if r.get("phase") == "eval"]
    return "".join(json.dumps(r) + "\n" for r in keep)


def _checkpoint_steps(run_dir: Path) -> list[int]:
    if not (run_dir / "checkpoints").is_dir():
        return []
    with Checkpointer(run_dir / "checkpoints", read_only=True) as ck:
        return ck.all_steps()


def _replace_into(tmp: Path, final: Path) -> None:
    if final.exists():  # an empty folder (a run directory that was held but never written)
        final.rmdir()
    tmp.rename(final)


def rederive_spec(plan: Plan, parent: RunSpec, step: int) -> RunSpec:
    """The parent's run again, in ``<out>/branches/<parent>@<step>.rederive``: the same config but the run
    directory and no evaluation (``data.eval`` empty: the parent's recorded evaluations up to ``step`` go into
    the snapshot; an evaluation changes no training number), trained to ``step`` when the snapshot and the
    parent's checkpoint of ``step`` are both gone."""
    d = snapshot_dir(plan, parent.name, step).with_name(f"{parent.name}@{step}.rederive")
    return dataclasses.replace(parent, run_dir=d, config=parent.config.replace(**{"run_dir": str(d), "data.eval": []}))


def needs_rederive(plan: Plan, spec: RunSpec, parent: RunSpec) -> bool:
    """Whether branched run ``spec`` can start only from a re-derived branch point: it has not branched, its
    snapshot is missing and its parent holds no checkpoint of the branch step (a lost working folder)."""
    assert spec.branch is not None
    return read_branch(spec.run_dir) is None and branch_point_lost(plan, parent, spec.branch.step)


def branch_point_lost(plan: Plan, parent: RunSpec, step: int) -> bool:
    """Whether ``parent``'s checkpoint at branch point ``step`` is gone: no snapshot of it and no checkpoint
    of that step in its run directory (a lost working folder)."""
    return not (snapshot_dir(plan, parent.name, step) / _SNAPSHOT_FILE).is_file() \
        and step not in _checkpoint_steps(parent.run_dir)


def take_snapshot(plan: Plan, parent: RunSpec, step: int) -> dict[str, Any]:
    """Copy ``parent``'s checkpoint at ``step`` and its metrics rows up to it into :func:`snapshot_dir` (from
    its re-derivation, :func:`rederive_spec`, when that holds the checkpoint and the parent does not); returns
    the snapshot's description. Nothing happens when the snapshot exists. :class:`PlanError` when neither
    has a finished checkpoint at ``step``."""
    final = snapshot_dir(plan, parent.name, step)
    if (final / _SNAPSHOT_FILE).is_file():
        info = json.loads((final / _SNAPSHOT_FILE).read_text())
        redo = info.get("rederived")
        if redo is None or redo.get("recorded", "") == recorded_rows(plan, parent, step)[2]:
            return info
        return _compare_again(plan, parent, step, final, info)
    source = parent.run_dir
    steps = _checkpoint_steps(source)
    redo = rederive_spec(plan, parent, step).run_dir
    if step not in steps and step in _checkpoint_steps(redo):
        source = redo
    elif step not in steps:
        raise PlanError(f"plan {str(plan.path)!r}: {parent.name} has no checkpoint at step {step} to branch from "
                        f"(its checkpoints: {', '.join(map(str, steps)) or 'none'}; the snapshot "
                        f"{str(final)!r} is missing)")
    tmp = final.with_name(final.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    shutil.copytree(source / "checkpoints" / str(step), tmp / "checkpoints" / str(step))
    info: dict[str, Any] = {"parent": parent.name, "step": step, "checkpoint": str(source / "checkpoints" / str(step)),
                            "checkpoint_sha256": _digest(tmp / "checkpoints"), "taken": now_iso()}
    evals = None
    if source == redo:  # the trajectory it continues, against the parent's as recorded
        rows = [r for r in read_metrics(redo / _METRICS, "rl") if int(r["step"]) < step]
        comparison, where, evals = _against_recorded(plan, parent, step, rows)
        info["rederived"] = {"run_dir": str(redo), "comparison": comparison, "recorded": where}
    (tmp / _METRICS).write_text(_metrics_lines(source, step, evals=evals))
    write_json(tmp / _SNAPSHOT_FILE, info)
    final.parent.mkdir(parents=True, exist_ok=True)
    _replace_into(tmp, final)
    return info


def same_trajectory(comparison: dict[str, Any], step: int) -> bool:
    """Whether a re-derivation compared as ``comparison`` (:func:`~ict_jax.experiments.record.compare_attempt`)
    sampled the same tokens as the recorded run at every step up to ``step``: then the recorded
    evaluations up to ``step`` are those of the policy it holds (its floats may part in their last bits)."""
    return comparison["steps_compared"] >= step and comparison["steps_same_samples"] >= step


def _against_recorded(plan: Plan, parent: RunSpec, step: int, rows: list[dict[str, Any]]
                      ) -> tuple[dict[str, Any], str | None, list[dict[str, Any]]]:
    """A re-derivation's RL ``rows`` up to ``step`` against ``parent``'s recorded rows
    (:func:`recorded_rows`): (the comparison, where the recorded rows come from, the recorded evaluations up
    to ``step`` when the re-derivation sampled the same tokens at every step, :func:`same_trajectory`, else
    none: they evaluated another trajectory's policy)."""
    recorded, evals, where = recorded_rows(plan, parent, step)
    comparison = compare_attempt(rows, recorded)
    return comparison, where, evals if same_trajectory(comparison, step) else []


def _compare_again(plan: Plan, parent: RunSpec, step: int, final: Path, info: dict[str, Any]) -> dict[str, Any]:
    """Re-derived snapshot ``info`` in ``final`` compared again with ``parent``'s recorded rows
    (:func:`_against_recorded`) when they now come from elsewhere than its comparison's
    (``rederived.recorded``): a parent started again after a lost working folder that has reached ``step``
    again (``run``: the trajectory its branched arms are paired with), a later attempt, or a snapshot
    without ``recorded``, compared with the parent's run directory alone, which that restart had emptied (0
    steps compared, no evaluation rows). Its metrics get the recorded evaluations up to ``step`` where they
    are its policy's; its checkpoint is not touched. Both files are replaced atomically."""
    rows = [r for r in read_metrics(final / _METRICS, "rl") if int(r["step"]) < step]
    comparison, where, evals = _against_recorded(plan, parent, step, rows)
    tmp = final / f".{_METRICS}.tmp"
    tmp.write_text(_metrics_lines(final, step, evals=evals))
    tmp.replace(final / _METRICS)
    info = {**info, "rederived": {**info["rederived"], "comparison": comparison, "recorded": where,
                                  "compared_again": now_iso()}}
    write_json(final / _SNAPSHOT_FILE, info)
    return info


def compare_rederived_again(plan: Plan, specs: list[RunSpec]) -> dict[str, dict[str, Any]]:
    """Every branched run started from a re-derived snapshot that is still there (the same checkpoint) gets
    the snapshot's comparison in its ``branch.json`` where that has changed (:func:`take_snapshot` compares
    a snapshot again when the parent's recorded rows have, see :func:`_compare_again`); returns those runs'
    new comparisons by name. Its metrics are the ones it trained from: they are not rewritten."""
    by_name: dict[str, RunSpec] = {s.name: s for s in specs}
    done: dict[str, dict[str, Any]] = {}
    for spec in specs:
        known = read_branch(spec.run_dir) if spec.branch is not None else None
        if known is None or known.get("rederived") is None:
            continue
        path = snapshot_dir(plan, spec.parent, spec.branch.step) / _SNAPSHOT_FILE
        if not path.is_file() or json.loads(path.read_text())["checkpoint_sha256"] != known["checkpoint_sha256"]:
            continue  # gone with its machine, or another re-derivation's
        snap = take_snapshot(plan, by_name[spec.parent], spec.branch.step)
        if snap["rederived"] != known["rederived"]:
            write_json(spec.run_dir / BRANCH_FILE, {**known, "rederived": snap["rederived"]})
            done[spec.name] = snap["rederived"]["comparison"]
    return done


def fork(plan: Plan, spec: RunSpec, parent: RunSpec) -> dict[str, Any]:
    """Lay out branched run ``spec``'s directory from its parent's snapshot at ``spec.branch.step`` (taken
    now from the parent's checkpoint if missing); returns its ``branch.json``. A run that already branched is
    left as it is. :class:`PlanError` when the run directory holds something else, or the snapshot cannot
    be had."""
    assert spec.branch is not None and parent.name == spec.parent
    known = read_branch(spec.run_dir)
    if known is not None:
        return known
    d = spec.run_dir
    if d.exists() and any(p.name != ".lock" for p in d.iterdir()):
        raise PlanError(f"plan {str(plan.path)!r}: {spec.name} branches from {parent.name} at step "
                        f"{spec.branch.step}, but {str(d)!r} already holds files of a run that did not branch")
    snap = take_snapshot(plan, parent, spec.branch.step)
    src = snapshot_dir(plan, parent.name, spec.branch.step)
    info = {"from": parent.name, "step": spec.branch.step, "checkpoint": snap["checkpoint"],
            "checkpoint_sha256": snap["checkpoint_sha256"], "snapshot": str(src), "forked": now_iso(),
            **({"rederived": snap["rederived"]} if "rederived" in snap else {})}
    _lay_out(plan, spec, src, snap, BRANCH_FILE, info, "branched")
    return info


def _lay_out(plan: Plan, spec: RunSpec, src: Path, snap: dict[str, Any], file: str, info: dict[str, Any],
             what: str) -> None:
    """``spec``'s run directory from snapshot ``src`` (its checkpoint and metrics rows, ``spec``'s own
    ``config.json``) and ``file`` holding ``info``, written aside and renamed into place."""
    if _digest(src / "checkpoints") != snap["checkpoint_sha256"]:
        raise PlanError(f"plan {str(plan.path)!r}: the snapshot {str(src)!r} does not match its sha256 (changed "
                        f"on disk since it was taken): nothing was {what} from it")
    d = spec.run_dir
    tmp = d.with_name(f".{d.name}.fork")
    if tmp.exists():
        shutil.rmtree(tmp)
    shutil.copytree(src / "checkpoints", tmp / "checkpoints")
    shutil.copyfile(src / _METRICS, tmp / _METRICS)
    (tmp / "config.json").write_text(json.dumps(spec.config.to_dict(), indent=2))
    write_json(tmp / file, info)
    _replace_into(tmp, d)


def _evaluation_steps(spec: RunSpec, step: int) -> list[int]:
    """The steps up to ``step`` at which ``spec``'s run evaluates (``train.eval_every`` on ``data.eval``)."""
    every = spec.config.train.eval_every
    return list(range(every, step + 1, every)) if every and spec.config.data.eval else []


def resume_point(plan: Plan, spec: RunSpec) -> int | None:
    """The branch point at which lost run ``spec`` (started again from step 0: nothing in its directory)
    resumes: the latest of its arm's branch points that its latest earlier attempt reached with every
    evaluation due by then recorded; None when there is none (it trains from step 0)."""
    if spec.branch is not None or _rows(spec.run_dir):
        return None
    attempts = read_attempts(spec.name, plan.out)
    if not attempts:
        return None
    a = attempts[-1]
    reached = len(a.get("metrics") or [])
    evaluated = {int(r["step"]) for r in a.get("evals") or []}
    fits = [s for s in branch_points(plan, spec) if s <= reached and set(_evaluation_steps(spec, s)) <= evaluated]
    return max(fits) if fits else None


def resume(plan: Plan, spec: RunSpec, step: int) -> dict[str, Any] | None:
    """Lay out lost run ``spec``'s directory at branch point ``step`` from its snapshot (taken now if missing:
    :func:`take_snapshot`, from its re-derivation when the checkpoint is gone), with the evaluations its
    attempt recorded up to ``step``; returns ``resumed.json``. None, with nothing written, when the
    re-derivation sampled other tokens than the attempt at some step (its evaluations are another
    trajectory's: the run trains from step 0)."""
    snap = take_snapshot(plan, spec, step)
    redo = snap.get("rederived")
    if redo is not None and not same_trajectory(redo["comparison"], step):
        return None
    src = snapshot_dir(plan, spec.name, step)
    info = {"step": step, "checkpoint": snap["checkpoint"], "checkpoint_sha256": snap["checkpoint_sha256"],
            "snapshot": str(src), "resumed": now_iso(), **({"rederived": redo} if redo is not None else {})}
    _lay_out(plan, spec, src, snap, RESUMED_FILE, info, "resumed")
    return info
