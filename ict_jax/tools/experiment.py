"""A pre-registered, resumable, paired experiment (``ict-jax compare --plan PLAN``; docs/experiments.md).

The plan (:mod:`ict_jax.tools.experiment_plan`), committed before its first result, fixes arms, seeds,
steps, the reference arms, the outcomes and the stopping rule. :func:`run_experiment` runs every arm x
seed in its own run directory ``<out>/runs/<arm>_s<seed>``, in turns of ``chunk_steps`` RL steps: every
run reaches step c before any run goes past it, so a stop at any time leaves the arms equally far. Each
turn resumes the run from its checkpoint (the trainer's resume: every random stream continues at its
step, the data position is saved), so a run stopped and continued, by the chunks, Ctrl-C, a kill or the
time box (``max_hours``), ends bitwise equal to one never stopped. Arms of one seed share ``seed``, hence
the data order, the sampler keys and the initial weights: their differences are paired by seed.

The order of the turns (``order``) changes no run's numbers, only which runs a stop leaves unfinished:
``chunks`` (the default, above) or ``runs``: seed by seed, each arm's run from its start to its end before
the next. ``runs`` is for a machine that may be lost between invocations: a finished run outlives it in
the record, an unfinished one loses its checkpoint. When it is lost, the committed record rebuilds the
working folder (``recover``, :mod:`ict_jax.tools.experiment_recover`): finished runs are written back,
unfinished ones start again from step 0 and what they had logged stays in the record as earlier attempts.

After each chunk the record (:mod:`ict_jax.tools.experiment_record`, ``<record>/experiment.json``) is
rebuilt from disk and the report (:mod:`ict_jax.tools.experiment_report`) from the record alone. One
invocation at a time holds ``<out>`` (:func:`ict_jax.outputs.hold_output_dir`); a plan whose text changed
under an existing experiment is refused, and, in a git checkout, a plan that is not committed as it is
(pre-registration) unless ``allow_uncommitted`` (recorded).

Files under ``out``: ``plan.json`` (the plan as first run: text, sha256, git state), ``invocations.jsonl``
(start and end of each invocation: time, machine, code commit, why it stopped), ``chunks.jsonl`` (one line
per run chunk: steps, wall time, commit), ``runs/``.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Mapping

import jax
from jax.experimental.compilation_cache import compilation_cache

from ict_jax.config import ConfigError
from ict_jax.heartbeat import duration
from ict_jax.outputs import check_output_dir, has_entries, hold_output_dir
from ict_jax.tools.experiment_box import TimeBox
from ict_jax.tools.experiment_branch import (
    branch_point_lost,
    branch_points,
    compare_rederived_again,
    fork,
    needs_rederive,
    rederive_spec,
    resume,
    resume_point,
    take_snapshot,
)
from ict_jax.tools.experiment_plan import Plan, PlanError, RunSpec, base_run, load_plan, plan_runs
from ict_jax.tools.experiment_record import (
    CHUNKS_FILE,
    COMPILATION_CACHE,
    INVOCATIONS_FILE,
    PLAN_FILE,
    RECORD_FILE,
    STATUS_FILE,
    append_jsonl,
    build_record,
    chunk_eval_seconds,
    eval_seconds,
    pace,
    read_jsonl,
    run_status,
    steps_done,
    write_json,
)
from ict_jax.tools.experiment_recover import lost_working_folder, recover_from_record
from ict_jax.tools.experiment_report import REPORT_FILE, selection_warnings, write_report
from ict_jax.tools.provenance import code_commit, environment, file_commit, now_iso
from ict_jax.train.evaluation import evaluated_steps
from ict_jax.train.logs import read_metrics
from ict_jax.train.parts import run_mesh_checked
from ict_jax.train.record import read_config
from ict_jax.train.stopping import TrainingDiverged
from ict_jax.train.trainer import Trainer

__all__ = ["run_experiment", "rebuild_report", "check_plan_provenance", "ExperimentStopped", "ORDERS",
           "COMPILATION_CACHE"]


class ExperimentStopped(Exception):
    """The time box or the caller's ``should_stop`` ended an invocation early; the same command continues."""


def _say(text: str) -> None:
    print(f"[experiment] {text}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------
# The plan's identity
# ------------------------------------------------------------------------------------------------
def check_plan_provenance(plan: Plan, allow_uncommitted: bool = False) -> dict[str, Any]:
    """The plan file's git state (:func:`~ict_jax.tools.provenance.file_commit`); in a git checkout a plan
    that is not committed as it is raises :class:`PlanError` unless ``allow_uncommitted``."""
    state = file_commit(plan.path)
    if state["in_git"] and not state["clean"] and not allow_uncommitted:
        why = "is not committed" if not state["committed"] else "has uncommitted changes"
        raise PlanError(f"plan {str(plan.path)!r} {why}: commit it before its first result (the plan is "
                        "pre-registered), or pass --uncommitted to run it anyway (the record says so)")
    return state


def _plan_info(plan: Plan, git_state: Mapping[str, Any]) -> dict[str, Any]:
    """``<out>/plan.json``: the plan as first run. A plan whose text changed since is refused."""
    path = plan.out / PLAN_FILE
    record = plan.record / RECORD_FILE
    known = None
    if path.is_file():
        known = json.loads(path.read_text())
    elif record.is_file():
        known = {"sha256": json.loads(record.read_text()).get("plan_sha256"), "where": str(record)}
    if known is not None and known.get("sha256") != plan.sha256:
        raise PlanError(f"plan {str(plan.path)!r} changed since the experiment in {str(plan.out)!r} started "
                        f"(sha256 {plan.sha256[:12]} now, {str(known.get('sha256'))[:12]} on record): a "
                        "pre-registered plan is fixed; for other settings write a new plan with another name and out")
    if known is not None and "text" in known:
        return known
    info = {"sha256": plan.sha256, "text": plan.text, "path": str(plan.path), "git": dict(git_state),
            "first_run": now_iso()}
    if jax.process_index() == 0:
        write_json(path, info)
    return info


# ------------------------------------------------------------------------------------------------
# Running
# ------------------------------------------------------------------------------------------------
def _chunk_means(run_dir: Path, first: int, last: int) -> dict[str, float]:
    """Mean of a few metrics over RL steps first..last-1 (0-based) of a run, for the progress line."""
    metrics = run_dir / "metrics.jsonl"
    rows = [r for r in (read_metrics(metrics, "rl") if metrics.is_file() else []) if first <= r["step"] < last]
    out = {}
    for key, short in (("reward/mean", "reward"), ("mask/selected_frac", "selected")):
        vals = [float(r[key]) for r in rows if isinstance(r.get(key), (int, float))]
        if vals:
            out[short] = sum(vals) / len(vals)
    return out


def _eta_text(steps_left: int, step_s: float | None, evals_left: int, eval_s: float | None) -> str:
    """The progress line's ETA: the steps left at the seconds a step so far, plus the evaluations left at the
    seconds an evaluation so far (``ETA 3h 10m (18 steps x 3m 48s + 3 evaluations x 40m 10s)``); the
    evaluations are named without a time until one has been measured; "" when nothing can be said."""
    if not steps_left and not evals_left:
        return ""
    parts, total = [], 0.0
    if steps_left:
        if step_s is None:
            return ""
        parts.append(f"{steps_left} steps x {duration(step_s)}")
        total += steps_left * step_s
    evals = f"{evals_left} evaluation{'s' if evals_left != 1 else ''}"
    if evals_left and eval_s is not None:
        parts.append(f"{evals} x {duration(eval_s)}")
        total += evals_left * eval_s
    text = f", ETA {duration(total)} ({' + '.join(parts)})" if parts else ""
    if evals_left and eval_s is None:
        text += f" + {evals}" if text else f", {evals} left"
    return text


def _evals_left(plan: Plan, specs: list[RunSpec], record: Mapping[str, Any]) -> int:
    """The final evaluations still to run: each unfinished run's (when it has an evaluation set) and the
    base model's."""
    left = sum(1 for spec in specs if spec.config.data.eval
               and record["runs"][spec.name]["status"] not in ("finished", "diverged"))
    return left + int(bool(plan.evaluate_base) and (record.get("base") or {}).get("status") != "finished")


def _train_chunk(spec: RunSpec, until: int, box: TimeBox, progress: bool) -> tuple[str, int]:
    """Train run ``spec`` until RL step ``until`` (or, after a step, until the next one does not fit in
    ``box``: :func:`_next_fits`); returns (status, steps done): ``paused``, ``finished`` or ``diverged``.
    Resumes from the run's checkpoint if it has one."""
    d = spec.run_dir
    resume = has_entries(d)

    def pause(done: int) -> bool:
        box.step_done()
        return done >= until or not _next_fits(spec, done, box)

    box.chunk_started()
    try:
        with Trainer(spec.config, resume=resume, progress=progress) as trainer:
            trainer.train(pause=pause)
            paused = trainer.paused
    except TrainingDiverged as e:
        if jax.process_index() == 0:
            write_json(d / STATUS_FILE, {"status": "diverged", "error": str(e), "time": now_iso()})
        return "diverged", steps_done(d, spec.config.train.steps)
    finally:
        gc.collect()
    if paused is not None:
        return "paused", paused
    return "finished", spec.config.train.steps


def _next_fits(spec: RunSpec, done: int, box: TimeBox) -> bool:
    """Whether what run ``spec`` does next after ``done`` RL steps fits in ``box``: a step, with an evaluation
    when it is the run's last step or one that ``train.eval_every`` evaluates after (the evaluation runs inside
    it), or only the final evaluation when every step is done."""
    steps, evaluates, every = spec.config.train.steps, bool(spec.config.data.eval), spec.config.train.eval_every
    if done >= steps:
        return box.fits(evaluation=evaluates)
    return box.fits(steps=1, evaluation=evaluates and (done + 1 == steps or bool(every) and (done + 1) % every == 0))


def _evaluate_base(spec: RunSpec, box: TimeBox, progress: bool, say: Callable[[str], None]) -> None:
    """The starting model's final evaluation (0 RL steps) in its own run directory, unless it has one."""
    d = spec.run_dir
    if run_status(d, 0) == "finished":
        return
    if not box.fits(evaluation=True):
        raise ExperimentStopped(box.why())
    say(f"base: evaluating the starting model (seed {spec.seed}) -> {d}")
    t0 = time.monotonic()
    with Trainer(spec.config, resume=has_entries(d), progress=progress) as trainer:
        trainer.train()
    gc.collect()
    box.evaluation_done(eval_seconds(d, 0))
    say(f"base: evaluated in {duration(time.monotonic() - t0)}")


def _update_record(plan: Plan, plan_info: Mapping[str, Any]) -> dict[str, Any]:
    record = build_record(plan, plan_info=plan_info)
    if jax.process_index() == 0:
        write_json(plan.record / RECORD_FILE, record)
        write_report(json.loads((plan.record / RECORD_FILE).read_text()), plan.record)
    return record


def _use_compilation_cache(folder: Path) -> None:
    """JAX's persistent compilation cache in ``folder`` when none is set: every chunk of a run builds the
    same programs again (a new trainer per chunk), and loads them from the cache instead of compiling them
    (the same executables, so the same numbers; minutes per chunk of a real model's step)."""
    if jax.config.jax_compilation_cache_dir:
        return
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    compilation_cache.reset_cache()  # JAX decides once per process whether the cache is used: decide again


#: the orders in which the runner takes the runs' chunks (``run_experiment(order=...)``)
ORDERS = ("chunks", "runs")


def _turns(plan: Plan, specs: list[RunSpec], order: str,
           runs: list[str] | None = None) -> list[tuple[int, RunSpec]]:
    """(chunk end, run) in the order they are trained. ``chunks``: at each chunk end c every run in turn
    (every run reaches step c before any goes past it); ``runs``: seed by seed, each arm's run from its
    start to its end before the next (what a machine that may be lost between invocations keeps best: a
    finished run needs no checkpoint to outlive it). ``runs``: only these runs' turns (None: every run's)."""
    ends = plan.chunk_ends()
    specs = [s for s in specs if runs is None or s.name in runs]
    if order == "chunks":
        return [(end, spec) for end in ends for spec in specs]
    seeds, arms = list(plan.seeds), list(plan.arm_names)
    ordered = sorted(specs, key=lambda s: (seeds.index(s.seed), arms.index(s.arm)))
    return [(end, spec) for spec in ordered for end in ends]


def _run_chunks(plan: Plan, specs: list[RunSpec], plan_info: Mapping[str, Any], inv_id: str,
                box: TimeBox, progress: bool, say: Callable[[str], None], order: str = "chunks",
                runs: list[str] | None = None) -> None:
    """Every run's chunks in ``order`` (:func:`_turns`): each unfinished run trains up to the chunk's end;
    after each chunk the chunk's line, the record and a progress line (its ETA at the pace of ``box``'s
    chunks so far: :meth:`~ict_jax.tools.experiment_box.TimeBox.eta_pace`)."""
    by_name = {s.name: s for s in specs}
    for end, spec in _turns(plan, specs, order, runs):
        if spec.branch is not None and end <= spec.branch.step:
            continue  # its steps up to the branch point are its parent's
        status = run_status(spec.run_dir, plan.steps)
        if status == "pending":
            _start_at_branch_point(plan, spec, by_name, inv_id, box, progress, say)
            status = run_status(spec.run_dir, plan.steps)
        start = steps_done(spec.run_dir, plan.steps)
        # a run at its last step but not finished was stopped in its final evaluation: it evaluates again
        if status in ("finished", "diverged") or (start >= end and end < plan.steps):
            continue
        if not _next_fits(spec, start, box):
            raise ExperimentStopped(box.why())
        t0 = time.monotonic()
        what, done = _train_chunk(spec, end, box, progress)
        wall = time.monotonic() - t0
        append_jsonl(plan.out / CHUNKS_FILE, {"run": spec.name, "from": start, "to": done, "status": what,
                                              "wall_s": round(wall, 1), "time": now_iso(), "invocation": inv_id,
                                              **code_commit()})
        if done in branch_points(plan, spec):  # the arms branching here start from this checkpoint
            take_snapshot(plan, spec, done)
            say(f"{spec.arm} s{spec.seed}: checkpoint of step {done} kept for the arms that branch from it")
        eval_s = chunk_eval_seconds(spec.run_dir, start, done, what == "finished")
        box.chunk_done(wall, done - start, eval_s is not None, eval_s)
        eta_step_s, eta_eval_s = box.eta_pace()
        record = _update_record(plan, plan_info)
        left = record["status"]["steps_planned"] - record["status"]["steps_done"]
        means = _chunk_means(spec.run_dir, start, done)
        span = f"steps {start + 1}-{done}" if done > start else f"after step {done}"  # only its final evaluation
        say(f"{spec.arm} s{spec.seed}: {span} of {plan.steps} {what} in {duration(wall)}"
            + (f" (evaluation {duration(eval_s)})" if eval_s is not None else "")
            + "".join(f", {k} {v:.3f}" for k, v in means.items())
            + f"; {record['status']['steps_done']}/{record['status']['steps_planned']} steps done"
            + _eta_text(left, eta_step_s, _evals_left(plan, specs, record), eta_eval_s))
        for a in record["runs"][spec.name].get("attempts", []):
            c = a["comparison"]
            if c["steps_compared"]:
                first = c["first_difference"]
                say(f"{spec.arm} s{spec.seed}: against its attempt {a['attempt']} (lost): {c['steps_equal']} of "
                    f"{c['steps_compared']} common steps equal bitwise, {c['steps_same_samples']} with the same "
                    "samples"
                    + (f"; first difference at step {first['step'] + 1} ({', '.join(sorted(first['metrics'])[:4])}"
                       + (", ..." if len(first["metrics"]) > 4 else "") + ")" if first else ""))
        if what == "paused" and done < end:  # the time box or a stop request paused it mid-chunk
            raise ExperimentStopped(box.why())


def _start_at_branch_point(plan: Plan, spec: RunSpec, by_name: Mapping[str, RunSpec], inv_id: str, box: TimeBox,
                           progress: bool, say: Callable[[str], None]) -> None:
    """Pending run ``spec``'s directory laid out at a branch point where it starts there: a branched run
    from its parent's (:func:`~ict_jax.tools.experiment_branch.fork`), a run lost after its own branch point
    from that (:func:`~ict_jax.tools.experiment_branch.resume`); each point re-derived first when lost."""
    who = f"{spec.arm} s{spec.seed}"
    if spec.branch is not None:
        parent = by_name[spec.parent]
        if needs_rederive(plan, spec, parent):
            _rederive(plan, who, parent, spec.branch.step, inv_id, box, progress, say)
        info = fork(plan, spec, parent)
        say(f"{who}: branched from {info['from']} at step {info['step']} "
            f"(checkpoint sha256 {info['checkpoint_sha256'][:12]})")
        return
    at = resume_point(plan, spec)
    if at is None:
        return
    if branch_point_lost(plan, spec, at):
        _rederive(plan, who, spec, at, inv_id, box, progress, say)
    info = resume(plan, spec, at)
    say(f"{who}: resumed at step {at} from its branch point (checkpoint sha256 {info['checkpoint_sha256'][:12]}), "
        "its evaluations up to it as its lost attempt recorded them" if info is not None else
        f"{who}: trained again to step {at}, it sampled other tokens than its lost attempt: it starts from "
        "step 0 (its recorded evaluations are another trajectory's)")


def _rederive(plan: Plan, who: str, parent: RunSpec, step: int, inv_id: str, box: TimeBox, progress: bool,
              say: Callable[[str], None]) -> None:
    """``parent``'s branch point ``step`` is lost (no snapshot, no checkpoint of that step: the working folder
    was rebuilt from the record): train the parent's config again to it
    (:func:`~ict_jax.tools.experiment_branch.rederive_spec`, in the box like any chunk; logged in
    ``chunks.jsonl`` under ``<parent>@<step>``), for run ``who`` that starts there."""
    redo = rederive_spec(plan, parent, step)
    start = steps_done(redo.run_dir, plan.steps)
    if start < step:
        say(f"{who}: the checkpoint of {parent.name} at step {step} is gone (a lost working "
            f"folder): training {parent.name} again to step {step} in {redo.run_dir}")
        if not _next_fits(redo, start, box):
            raise ExperimentStopped(box.why())
        t0 = time.monotonic()
        what, done = _train_chunk(redo, step, box, progress)
        append_jsonl(plan.out / CHUNKS_FILE, {"run": f"{parent.name}@{step}", "from": start, "to": done,
                                              "status": what, "wall_s": round(time.monotonic() - t0, 1),
                                              "time": now_iso(), "invocation": inv_id, **code_commit()})
        if what == "diverged":
            raise PlanError(f"plan {str(plan.path)!r}: {parent.name} trained again to step {step} diverged at step "
                            f"{done} ({redo.run_dir}): {who} has no branch point to start from")
        if done < step:
            raise ExperimentStopped(box.why())


def _compare_branch_points_again(plan: Plan, specs: list[RunSpec], say: Callable[[str], None]) -> None:
    """The branched runs' re-derived branch points compared again where their parents' recorded rows
    changed (:func:`~ict_jax.tools.experiment_branch.compare_rederived_again`), a line each."""
    for name, c in compare_rederived_again(plan, specs).items():
        say(f"{name}: its re-derived branch point compared again with its parent's recorded rows: "
            f"{c['steps_equal']} of {c['steps_compared']} steps equal bitwise, {c['steps_same_samples']} "
            "with the same samples")


def _eval_batch(plan: Plan, specs: list[RunSpec], requested: int | None,
                say: Callable[[str], None]) -> int | None:
    """The experiment's ``data.eval_batch``: ``requested``, else the one an earlier invocation used, else
    none (the plan's). Every evaluation of an experiment samples with the same batching, so that the final
    adapters and the base are compared on common random numbers: a value other than that of a finished
    evaluation is refused."""
    if requested is not None:
        try:  # before anything is recorded: a batch the mesh cannot split, one line
            run_mesh_checked(_with_eval_batch(specs[0], requested).config)
        except ConfigError as e:
            raise PlanError(f"eval_batch: {e}") from None
    earlier = [e.get("eval_batch") for e in read_jsonl(plan.out / INVOCATIONS_FILE) if e.get("event") == "start"]
    value = requested if requested is not None else next((b for b in reversed(earlier) if b is not None), None)
    if requested is None and value is not None:
        say(f"evaluation batch {value} prompts a sampler call, as an earlier invocation set (--eval-batch)")
    for spec in [*specs, *([base_run(plan)] if plan.evaluate_base else [])]:
        recorded = read_config(spec.run_dir) if evaluated_steps(spec.run_dir) else None
        if recorded is not None:
            used = recorded.data.eval_batch
            if used != value:
                raise PlanError(
                    f"{spec.name} was evaluated with data.eval_batch={used}, this invocation would evaluate "
                    f"with {value}: the evaluations of one experiment share their sampler batch (their samples "
                    f"draw the same random numbers); " + (f"pass --eval-batch {used}" if used is not None else
                                                          "a batch can be set only before the first evaluation"))
    return value


def _with_eval_batch(spec: RunSpec, value: int | None) -> RunSpec:
    if value is None:
        return spec
    return dataclasses.replace(spec, config=spec.config.replace(**{"data.eval_batch": value}))


def _recover_if_lost(plan: Plan, recover: bool, say: Callable[[str], None]) -> dict[str, Any] | None:
    """When the record holds results that ``out`` does not: refused, or with ``recover`` the working folder
    rebuilt from the record (what was done); None when ``out`` holds the experiment."""
    lost = lost_working_folder(plan)
    if lost is None:
        if recover:
            say(f"--recover: {plan.out} holds the experiment (or nothing is recorded yet): nothing to recover")
        return None
    if not recover:
        raise PlanError(
            f"the record {str(plan.record / RECORD_FILE)!r} holds {lost['status']['steps_done']} steps of this "
            f"experiment, but {str(plan.out)!r} does not hold its working folder (no {PLAN_FILE}): the machine "
            "that ran it was lost, or out points elsewhere. Pass --recover to rebuild the working folder from the "
            "record (finished runs written back; unfinished runs start again from step 0, what they logged kept "
            "in the record as earlier attempts); nothing is overwritten without it")
    return recover_from_record(plan, lost, say=say)


def _check_arguments(specs: list[RunSpec], max_hours: float | None, order: str, runs: list[str] | None) -> None:
    """:class:`PlanError` for a time box that is not positive, an unknown order, or ``runs`` (None: every run)
    that does not name some of the plan's runs and nothing else."""
    if max_hours is not None and not max_hours > 0:
        raise PlanError(f"max_hours: {max_hours!r}: expected a positive number of hours")
    if order not in ORDERS:
        raise PlanError(f"order: {order!r}: expected one of {', '.join(ORDERS)}")
    if runs is None:
        return
    unknown = [r for r in runs if r not in {s.name for s in specs}]
    if unknown or not runs:
        raise PlanError(f"runs: {', '.join(unknown) or 'none given'}: expected names of the plan's runs "
                        f"({', '.join(s.name for s in specs)})")


def run_experiment(plan_path: str | Path, *, max_hours: float | None = None, allow_uncommitted: bool = False,
                   progress: bool = False, should_stop: Callable[[], bool] | None = None,
                   say: Callable[[str], None] = _say, order: str = "chunks", recover: bool = False,
                   eval_batch: int | None = None, runs: list[str] | None = None) -> dict[str, Any]:
    """Run (or continue) the experiment of the plan at ``plan_path`` (module docstring); returns the record.

    ``order``: :data:`ORDERS` (module docstring; recorded per invocation). ``recover``: rebuild a lost ``out``
    from the record and continue (:mod:`ict_jax.tools.experiment_recover`); without it that is refused.
    ``eval_batch``: prompts a call of every evaluation's sampler (``data.eval_batch``, a resource of the
    machine, not a setting of the plan; recorded per invocation and kept by later ones); fixed for the
    experiment once an evaluation has finished (:func:`_eval_batch`). ``runs``: train only these runs (by
    name) in this invocation, the others untouched (recorded per invocation); None: every run.

    ``max_hours``: the time box of this invocation (:class:`~ict_jax.tools.experiment_box.TimeBox`): no step
    or final evaluation starts that is expected to end past it (a run's last step counts with its
    evaluation), at this invocation's pace, else the last invocation's; the run in progress pauses after its
    step (a checkpoint), the record is written and :class:`ExperimentStopped` is raised; the same call
    continues. Every invocation does at least one step or evaluation. ``should_stop()``: asked after every RL
    step and before every chunk, the same effect. Ctrl-C stops after the step in progress
    (:class:`~ict_jax.train.stopping.Interrupted`, the record written first). Bad plans raise
    :class:`PlanError` before any work."""
    plan = load_plan(plan_path)
    specs = plan_runs(plan)
    _check_arguments(specs, max_hours, order, runs)
    check_output_dir(plan.out, "out")
    check_output_dir(plan.record, "record")
    git_state = check_plan_provenance(plan, allow_uncommitted)
    t_start = time.monotonic()
    box = TimeBox(None if max_hours is None else t_start + max_hours * 3600.0, *pace(plan, specs),
                  should_stop=should_stop)

    with hold_output_dir(plan.out, "out"):
        recovered = _recover_if_lost(plan, recover, say)
        _compare_branch_points_again(plan, specs, say)
        plan_info = _plan_info(plan, git_state)
        batch = _eval_batch(plan, specs, eval_batch, say)
        specs = [_with_eval_batch(spec, batch) for spec in specs]
        _use_compilation_cache(plan.out / COMPILATION_CACHE)
        inv_id = uuid.uuid4().hex[:12]
        inv_path = plan.out / INVOCATIONS_FILE
        append_jsonl(inv_path, {"event": "start", "id": inv_id, "start": now_iso(), "environment": environment(),
                                "max_hours": max_hours, "plan_uncommitted": bool(git_state["in_git"]
                                                                                 and not git_state["clean"]),
                                "order": order, **({"runs": runs} if runs is not None else {}),
                                **({"recovered": recovered} if recovered else {}),
                                **({"eval_batch": batch} if batch is not None else {}),
                                **code_commit()})
        say(f"{plan.name}: {len(plan.arms)} arms x {len(plan.seeds)} seeds, {plan.steps} steps in chunks of "
            f"{plan.chunk_steps}, order {order} -> {plan.out} (record: {plan.record / RECORD_FILE})")
        stopped = "finished"
        try:
            _update_record(plan, plan_info)
            _run_chunks(plan, specs, plan_info, inv_id, box, progress, say, order, runs)
            if plan.evaluate_base and runs is None:
                _evaluate_base(_with_eval_batch(base_run(plan), batch), box, progress, say)
        except ExperimentStopped as e:
            stopped = str(e)
            raise
        except KeyboardInterrupt:  # the trainer's Interrupted (after a step, checkpoint saved) or a plain Ctrl-C
            stopped = "interrupted (Ctrl-C)"
            raise
        except BaseException as e:
            stopped = f"error: {type(e).__name__}: {str(e)[:200]}"
            raise
        finally:
            append_jsonl(inv_path, {"event": "end", "id": inv_id, "end": now_iso(), "stopped": stopped,
                                    "chunks_done": box.chunks,
                                    "wall_s": round(time.monotonic() - t_start, 1)})
            try:
                record = _update_record(plan, plan_info)
                say(f"{plan.name}: {stopped}; {record['status']['steps_done']}/{record['status']['steps_planned']} "
                    f"steps, {record['status']['runs_finished']}/{record['status']['runs']} runs finished; record "
                    f"{plan.record / RECORD_FILE}, report {plan.record / REPORT_FILE}")
                for line in selection_warnings(record):
                    say(line)
            except Exception as e:  # noqa: BLE001 - the error that stopped the experiment is the one raised
                say(f"{plan.name}: {stopped}; the record could not be rebuilt ({type(e).__name__}: {e})")
                if stopped == "finished":
                    raise
    return record


def rebuild_report(plan_path: str | Path, *, say: Callable[[str], None] = _say) -> Path:
    """The report of the plan's experiment rebuilt from its ``experiment.json`` alone (nothing is run and
    no run directory is read); returns the report's path. ``say`` gets the record's warnings (an arm of a
    sparse method that selected every token, :func:`~ict_jax.tools.experiment_report.selection_warnings`)."""
    plan = load_plan(plan_path)
    path = plan.record / RECORD_FILE
    if not path.is_file():
        raise PlanError(f"plan {str(plan.path)!r}: no record at {str(path)!r} yet: run the plan first")
    record = json.loads(path.read_text())
    if record.get("plan_sha256") != plan.sha256:
        raise PlanError(f"plan {str(plan.path)!r} is not the plan of the record {str(path)!r} (sha256 "
                        f"{plan.sha256[:12]} vs {str(record.get('plan_sha256'))[:12]})")
    out = write_report(record, plan.record)
    for line in selection_warnings(record):
        say(line)
    return out
