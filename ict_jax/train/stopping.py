"""How a run stops early: Ctrl-C after the step in progress (:func:`stop_after_step`,
:class:`Interrupted`) and three non-finite updates in a row (:class:`TrainingDiverged`)."""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any, Callable, Iterator

import jax

from ict_jax.interrupts import raise_keyboard_interrupt


class TrainingDiverged(RuntimeError):
    """Three consecutive non-finite updates: the run stopped, the last good checkpoint is intact."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C: the run stopped after the step in progress and saved a checkpoint; ``--resume`` continues."""


class StopFlag:
    """``requested``: a first Ctrl-C asked the loop to stop after its step."""

    requested = False


@contextlib.contextmanager
def stop_after_step(say: Callable[[str], Any]) -> Iterator[StopFlag]:
    """The first Ctrl-C (SIGINT) sets ``flag.requested``: the loop finishes its step, saves a checkpoint
    and raises :class:`Interrupted`. A second Ctrl-C stops at once (a ``KeyboardInterrupt``, never lost in a
    garbage collection: :func:`ict_jax.interrupts.raise_keyboard_interrupt`). Only in the main thread of a
    single-process run (elsewhere Ctrl-C raises KeyboardInterrupt as usual)."""
    flag = StopFlag()
    if threading.current_thread() is not threading.main_thread() or jax.process_count() > 1:
        yield flag
        return
    previous = signal.getsignal(signal.SIGINT)

    def handler(signum: int, frame: Any) -> None:
        if flag.requested:
            raise_keyboard_interrupt(signum, frame)
            return
        flag.requested = True
        say("Ctrl-C: stopping after this step and saving a checkpoint (Ctrl-C again to stop at once)")

    signal.signal(signal.SIGINT, handler)
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, previous)
