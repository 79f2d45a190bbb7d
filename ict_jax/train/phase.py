"""A phase of a run (the SFT warm start, RL) and the one loop that runs every phase: :func:`run_phase`.

A :class:`Phase` holds what differs between the phases: its name (the rows of ``metrics.jsonl``, the
TensorBoard folder, the progress line), its number of steps, one step's function, its checkpoints and its
hooks. The loop is the same for both: from the phase's first step to its last, one step, its metrics
logged, then the phase's hooks (``train.hooks``; its checkpoint cadence is one of them,
``train.hooks.save_checkpoint``); Ctrl-C stops after the step in progress, the hooks saving a checkpoint,
and raises :class:`~ict_jax.train.stopping.Interrupted`; a pause (RL, ``Trainer.train(pause=...)``) ends
the phase with a checkpoint of the step it stopped at. The SFT phase is built by
``train.warm_start.sft_phase``, the RL phase by ``Trainer.rl_phase``; ``Trainer.run_phase`` runs either.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

from ict_jax.rl.state import TrainState
from ict_jax.train.checkpoints import Checkpointer
from ict_jax.train.hooks import Hooks, StepInfo
from ict_jax.train.logs import RunLogger
from ict_jax.train.stopping import Interrupted, stop_after_step

#: ``(state, s) -> (state after step s, the step's metrics as floats)``; the state is donated
PhaseStep = Callable[[TrainState, int], tuple[TrainState, dict[str, float]]]
#: ``(phase name, total steps, first step) -> the run's logger, started for the phase``
StartLogger = Callable[[str, int, int], RunLogger]


@dataclasses.dataclass(frozen=True)
class Phase:
    """One phase of a run, as :func:`run_phase` runs it."""

    name: str  # "sft" | "rl": the phase of metrics rows, hooks and checkpoint metadata
    title: str  # "SFT" | "RL": in messages
    steps: int  # the phase's steps: train.sft_steps, train.steps
    step: PhaseStep
    checkpointer: Checkpointer  # where the phase's checkpoints go (and are waited for when it stops)
    hooks: Hooks  # run after every step, the phase's checkpoint cadence among them
    resuming: str = "resuming {title} at step {start}/{steps}"  # said when a resumed phase starts later


@dataclasses.dataclass(frozen=True)
class PhaseEnd:
    """How a phase ended: its last ``state``, the ``last`` step's metrics ({} when no step was left), and
    ``paused``: the step a pause stopped it at (None when it ran to its end)."""

    state: TrainState
    last: dict[str, float]
    paused: int | None = None


def run_phase(phase: Phase, state: TrainState, start: int, start_logger: StartLogger, *, run_dir: Path,
              pause: Callable[[int], bool] | None = None,
              on_state: Callable[[TrainState], None] | None = None) -> PhaseEnd:
    """Steps ``start`` .. ``phase.steps - 1`` of ``phase`` from ``state``, each followed by the phase's hooks
    (``StepInfo(done, state, metrics, final, stopping, phase)``). ``on_state(state)`` is told each new state
    as soon as its step returns (the trainer holds the current one). Ctrl-C stops after the step in
    progress: the hooks see ``stopping`` (and save a checkpoint), the pending save is waited for, and
    :class:`~ict_jax.train.stopping.Interrupted` is raised naming the checkpoint folder. ``pause(done)``,
    asked after each step but the last: True ends the phase there (``stopping`` for the hooks: a
    checkpoint of that step), to be continued by a resumed run exactly as if it had not stopped."""
    steps, name = phase.steps, phase.name
    logger = start_logger(name, steps, start)
    if start:
        logger.message(phase.resuming.format(title=phase.title, start=start, steps=steps))
    phase.hooks.begin(start)
    last: dict[str, float] = {}
    with stop_after_step(logger.message) as stop:
        for s in range(start, steps):
            state, last = phase.step(state, s)
            if on_state is not None:
                on_state(state)
            logger.log(s, last, phase=name)
            done = s + 1
            pausing = done < steps and pause is not None and bool(pause(done))
            phase.hooks.run(StepInfo(done, state, last, final=done == steps, stopping=stop.requested or pausing,
                                     phase=name))
            if stop.requested and done < steps:
                phase.checkpointer.wait()
                raise Interrupted(f"interrupted at {phase.title} step {done}/{steps}; checkpoints are in "
                                  f"{phase.checkpointer.directory}: continue with --resume run_dir={run_dir}")
            if pausing:
                phase.checkpointer.wait()
                return PhaseEnd(state, last, paused=done)
    return PhaseEnd(state, last)
