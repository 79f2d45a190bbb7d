"""The training loop's hooks (levanter's ``add_hook(fn, every=N)`` is the model): functions of a
:class:`StepInfo`, registered once per phase (the SFT warm start, RL; ``train.phase``), called after every
N-th step of their phase in registration order; end hooks are called once after the RL loop (also when a
resumed run had no step left to do).

The trainer registers (``Trainer.add_default_hooks``) for RL: the profiler (``--profile-steps``), the check
of background checkpoint saves, the non-finite guard, the evaluation every ``train.eval_every`` steps and
the checkpoint every ``train.save_every`` steps (and at the end and on Ctrl-C); at the end: the last save
finished, the final evaluation, the summary. For SFT (``train.warm_start.sft_phase``): the check of
background saves and the checkpoint every ``train.sft_save_every`` steps and on Ctrl-C (its end is the
``sft_model``). A user adds their own with ``trainer.add_hook(fn, every=N, phase="rl" | "sft")``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable, Mapping

import jax

from ict_jax.memory import peak_rss
from ict_jax.rl.state import TrainState
from ict_jax.train.checkpoints import Checkpointer
from ict_jax.train.evaluation import Evaluator
from ict_jax.train.logs import plot_metrics
from ict_jax.train.parts import RunParts
from ict_jax.train.stopping import TrainingDiverged
from ict_jax.train.summary import RunSummary

MAX_NONFINITE_IN_A_ROW = 3


@dataclasses.dataclass(frozen=True)
class StepInfo:
    """What a hook sees after a step of ``phase`` ("rl" or "sft"): ``step`` steps of the phase done (RL:
    rollout batches), the new ``state`` (SFT: the SFT state), the step's logged ``metrics``; ``final``: the
    phase's last step (``train.steps``, ``train.sft_steps``); ``stopping``: Ctrl-C (or a pause) asked to
    stop now."""

    step: int
    state: TrainState
    metrics: Mapping[str, float]
    final: bool = False
    stopping: bool = False
    phase: str = "rl"


Hook = Callable[[StepInfo], None]


class Hooks:
    """Step hooks ``(fn, every)`` and end hooks, in registration order. A step hook may have a ``begin(step)``
    method, called once before the loop's first step (``step``: the first step's index)."""

    def __init__(self) -> None:
        self.step_hooks: list[tuple[Hook, int]] = []
        self.end_hooks: list[Hook] = []

    def add(self, fn: Hook, every: int = 1) -> None:
        if every < 1:
            raise ValueError(f"a hook's every must be >= 1, got {every}")
        self.step_hooks.append((fn, int(every)))

    def add_end(self, fn: Hook) -> None:
        self.end_hooks.append(fn)

    def begin(self, step: int) -> None:
        for fn, _ in self.step_hooks:
            if hasattr(fn, "begin"):
                fn.begin(step)

    def run(self, info: StepInfo) -> None:
        for fn, every in self.step_hooks:
            if info.step % every == 0:
                fn(info)

    def run_end(self, info: StepInfo) -> None:
        for fn in self.end_hooks:
            fn(info)


class ProfileHook:
    """A ``jax.profiler`` trace of RL steps ``first`` .. ``stop - 1`` in ``directory`` (``--profile-steps``)."""

    def __init__(self, directory: Path, first: int, stop: int):
        self.directory, self.first, self.stop, self.active = directory, first, stop, False

    def begin(self, step: int) -> None:
        if step == self.first and not self.active:
            jax.profiler.start_trace(str(self.directory))
            self.active = True

    def __call__(self, info: StepInfo) -> None:
        if info.step == self.stop and self.active:
            jax.profiler.stop_trace()
            self.active = False
        self.begin(info.step)  # the next step is the first profiled one


def checkpoint_health(checkpointer: Checkpointer) -> Hook:
    """A background save that failed (a full disk) stops the run at the next step, not the next save."""
    return lambda info: checkpointer.check()


def count_nonfinite(step: Callable[[TrainState, int], tuple[TrainState, dict[str, float]]]
                    ) -> Callable[[TrainState, int], tuple[TrainState, dict[str, float]]]:
    """A phase's step function (``train.phase.PhaseStep``) whose metrics also count the non-finite updates
    in a row (``train/nonfinite_in_a_row``, from the step's ``train/skipped``), what :func:`nonfinite_guard`
    and :func:`save_checkpoint` read; the count starts at 0 with each phase run."""
    streak = 0

    def counted(state: TrainState, s: int) -> tuple[TrainState, dict[str, float]]:
        nonlocal streak
        state, metrics = step(state, s)
        streak = streak + 1 if metrics.get("train/skipped", 0) > 0 else 0
        metrics["train/nonfinite_in_a_row"] = float(streak)
        return state, metrics
    return counted


def nonfinite_guard(run_dir: Path) -> Hook:
    """Stops the run with :class:`TrainingDiverged` after :data:`MAX_NONFINITE_IN_A_ROW` non-finite updates
    in a row (each skipped inside the step; the metric ``train/nonfinite_in_a_row``)."""
    def guard(info: StepInfo) -> None:
        n = int(info.metrics.get("train/nonfinite_in_a_row", 0))
        if n >= MAX_NONFINITE_IN_A_ROW:
            raise TrainingDiverged(f"step {info.step - 1}: {n} non-finite updates in a row; stopped. The last "
                                   f"good checkpoint in {run_dir / 'checkpoints'} is intact")
    return guard


def save_checkpoint(parts: RunParts, phase: str = "rl", checkpointer: Checkpointer | None = None) -> Hook:
    """The checkpoint cadence of both phases, in ``checkpointer`` (default the RL one, ``parts.checkpointer``)
    with ``parts.checkpoint_meta``: a checkpoint every ``train.save_every`` steps (SFT:
    ``train.sft_save_every``), at the end of RL (SFT's end is saved as the ``sft_model`` instead) and on
    Ctrl-C or a pause; none right after a non-finite update (the last checkpoint stays a good one)."""
    t = parts.config.train
    every = t.save_every if phase == "rl" else t.sft_save_every
    ckpt = parts.checkpointer if checkpointer is None else checkpointer
    at_end = phase == "rl"

    def save(info: StepInfo) -> None:
        if info.final and not at_end:
            return
        if not ((every and info.step % every == 0) or info.final or info.stopping):
            return
        if info.metrics.get("train/nonfinite_in_a_row", 0):
            parts.logger.message(f"step {info.step}: checkpoint skipped after a non-finite update")
            return
        ckpt.save(info.step, info.state, parts.checkpoint_meta(info.step, phase))
    return save


def evaluate_every(evaluator: Evaluator) -> Hook:
    """An evaluation of the new policy (register with ``every=train.eval_every``)."""
    return lambda info: evaluator.evaluate_and_log(info.state, info.step)


def final_evaluation(evaluator: Evaluator, summary: RunSummary) -> Hook:
    """End: the pending checkpoint written, then the final policy evaluated (``eval_final``)."""
    def final(info: StepInfo) -> None:
        evaluator.parts.checkpointer.wait()
        if evaluator.parts.config.data.eval:
            summary["eval_final"] = evaluator.evaluate_and_log(info.state, info.step, "eval at the end")
    return final


def finish_summary(parts: RunParts, summary: RunSummary) -> Hook:
    """End: ``steps``, ``wall_s`` and the metrics plot recorded; the run's status "finished"."""
    def finish(info: StepInfo) -> None:
        summary["steps"] = parts.config.train.steps
        summary.stamp_wall()
        if parts.memory is not None:  # predicted by the pre-flight vs this process's peak (docs/memory.md)
            summary["memory"] = dict(parts.memory.record(), peak_rss=peak_rss())
        metrics = parts.run_dir / "metrics.jsonl"
        if jax.process_index() == 0 and metrics.exists():
            summary["plot"] = str(plot_metrics(metrics, parts.run_dir / "metrics.png"))
        summary.save("finished")
        summary.stop_clock()
    return finish
