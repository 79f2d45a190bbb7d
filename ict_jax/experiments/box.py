"""The time box of one experiment invocation (``ict-jax compare --plan P --max-hours H``): whether the next
piece of work still fits in it, and the pace of the invocation's progress lines' ETA.

The runner asks :meth:`TimeBox.fits` before every RL step and every final evaluation. A piece fits when it
is expected to end before the box does, at the pace measured: this invocation's own steps (the time between
two steps of a run) and evaluations once it has some, else the last invocation's
(:func:`~ict_jax.experiments.record.pace`), else nothing is expected and it fits. A run's last step
counts together with its final evaluation, which runs inside that step's training call and which the box
cannot pause. So an invocation ends before its box rather than one evaluation past it, except when a step
takes longer than those before it. Every invocation does at least one step or evaluation whatever its box
(``worked``): a box shorter than one piece of work still moves the experiment on.

The ETA counts what the whole experiment has left, chunk by chunk, so its pace is the chunks' own
(:meth:`TimeBox.chunk_done`, :meth:`TimeBox.eta_pace`): a chunk's wall time less its evaluation, per step,
its trainer's start-up included.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

__all__ = ["TimeBox"]


@dataclass
class TimeBox:
    """``deadline``: the box's end on ``clock`` (``time.monotonic``), None for no box. ``step_s``, ``eval_s``:
    the pace known before this invocation (seconds an RL step, a final evaluation; None when unknown).
    ``should_stop``: the caller's own request to stop (asked with the box)."""

    deadline: float | None
    step_s: float | None = None
    eval_s: float | None = None
    should_stop: Callable[[], bool] | None = None
    clock: Callable[[], float] = time.monotonic
    worked: bool = False  # this invocation has done a step or an evaluation
    ended_early: bool = False  # fits() said no: the box ends before the next piece would
    chunks: int = 0  # the runs' chunks this invocation has ended
    _steps: list[float] = field(default_factory=list)
    _chunk_steps: list[float] = field(default_factory=list)
    _evals: list[float] = field(default_factory=list)
    _last_step_end: float | None = None

    # -- what this invocation measures --
    def chunk_started(self) -> None:
        """A run's trainer starts: the time to its first step is its start-up, not a step."""
        self._last_step_end = None

    def step_done(self) -> None:
        """An RL step ended now (the trainer's pause callback): the time since the run's previous step is a
        step's."""
        now = self.clock()
        if self._last_step_end is not None:
            self._steps.append(now - self._last_step_end)
        self._last_step_end = now
        self.worked = True

    def evaluation_done(self, seconds: float | None) -> None:
        """A final evaluation ended, having taken ``seconds`` (None when unknown)."""
        if seconds is not None:
            self._evals.append(seconds)
        self.worked = True

    def chunk_done(self, wall_s: float, steps: int, evaluated: bool, eval_s: float | None) -> None:
        """A run's chunk ended after ``wall_s`` seconds: ``steps`` RL steps and, when ``evaluated``, the run's
        final evaluation, which took ``eval_s`` of them (None when unknown)."""
        self.chunks += 1
        if evaluated:
            self.evaluation_done(eval_s)
        if steps > 0:
            self._chunk_steps.append((wall_s - (eval_s or 0.0)) / steps)

    def step_seconds(self) -> float | None:
        """Seconds an RL step: this invocation's mean, else the known pace, else None."""
        return sum(self._steps) / len(self._steps) if self._steps else self.step_s

    def eval_seconds(self) -> float | None:
        """Seconds a final evaluation: this invocation's last, else the known pace, else None."""
        return self._evals[-1] if self._evals else self.eval_s

    def eta_pace(self) -> tuple[float | None, float | None]:
        """The pace of a progress line's ETA, over this invocation's chunks: seconds an RL step, its chunk's
        start-up shared among the chunk's steps (each chunk left starts a trainer again), and the mean seconds
        a final evaluation; None for what has not been measured yet."""
        step_s = sum(self._chunk_steps) / len(self._chunk_steps) if self._chunk_steps else None
        return step_s, (sum(self._evals) / len(self._evals) if self._evals else None)

    # -- what the runner asks --
    def spent(self) -> bool:
        """The box has ended, or the caller asked to stop."""
        return ((self.deadline is not None and self.clock() >= self.deadline)
                or (self.should_stop is not None and bool(self.should_stop())))

    def fits(self, steps: int = 0, evaluation: bool = False) -> bool:
        """Whether ``steps`` RL steps and then (``evaluation``) a final evaluation, started now, are expected
        to end inside the box (and the caller has not asked to stop). True without a box, before this
        invocation has worked, and for a piece whose time is unknown."""
        if self.spent():
            return False
        if self.deadline is None or not self.worked:
            return True
        step_s, eval_s = self.step_seconds(), self.eval_seconds()
        need = steps * (step_s or 0.0) + ((eval_s or 0.0) if evaluation else 0.0)
        if self.clock() + need <= self.deadline:
            return True
        self.ended_early = True
        return False

    def why(self) -> str:
        """Why the invocation stops early: ``time box`` (ended, or too short for the next piece) or ``stop
        requested``."""
        if self.deadline is not None and (self.ended_early or self.clock() >= self.deadline):
            return "time box"
        return "stop requested"
