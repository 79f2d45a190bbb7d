"""A line at least every ~30 s while long work runs: a single sampler call of a real model on a CPU takes
minutes, and a redirected command (a log file, CI, ``nohup``) that prints nothing for ten minutes cannot be
told from a hung one.

:class:`Heartbeat` is a daemon thread started by its ``with`` block: whenever ``interval`` seconds pass
without a line, it prints one, saying what is running (the current :meth:`Heartbeat.phase`) and for how
long, or whatever its ``status`` function returns (``ict-jax eval``: problems done, elapsed, ETA). Lines
the work prints itself count (:meth:`Heartbeat.said`), so a chatty phase gets no extra lines. The interval
is ``interval`` when given, else the environment variable ``ICT_JAX_HEARTBEAT_S``, else 30 seconds. A
command has one heartbeat from its first second; a part of the work with progress lines of its own (an
evaluation's problems done) speaks through it for a while (:meth:`Heartbeat.lend`), on the same clock.

Imports nothing of ict_jax: every layer may use it.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable

__all__ = ["Heartbeat", "heartbeat_interval", "duration", "INTERVAL_ENV", "DEFAULT_INTERVAL"]

INTERVAL_ENV = "ICT_JAX_HEARTBEAT_S"
DEFAULT_INTERVAL = 30.0


def heartbeat_interval(interval: float | None = None) -> float:
    """Seconds between heartbeat lines: ``interval``, else ``$ICT_JAX_HEARTBEAT_S``, else 30 (a value that is
    not a positive number counts as unset)."""
    for value in (interval, os.environ.get(INTERVAL_ENV)):
        try:
            seconds = float(value) if value not in (None, "") else None
        except ValueError:
            seconds = None
        if seconds is not None and seconds > 0:
            return seconds
    return DEFAULT_INTERVAL


def duration(seconds: float) -> str:
    """``42s``, ``3m05s``, ``2h07m``."""
    s = int(round(max(0.0, seconds)))
    return f"{s}s" if s < 60 else f"{s // 60}m{s % 60:02d}s" if s < 3600 else f"{s // 3600}h{s % 3600 // 60:02d}m"


class Heartbeat:
    """``with Heartbeat(say) as beat: beat.phase("sampling ..."); ...``: ``say(line)`` from a daemon thread
    whenever ``interval`` seconds (:func:`heartbeat_interval`) pass without a line. The line is
    ``status()`` when a status function is given (None: no line this time), else
    ``"<phase>: still running, <time in the phase> so far (<time in all>)"``. Call :meth:`said` when the
    work prints a line of its own; :meth:`phase` names what runs now (it prints nothing). ``enabled``
    False: no thread, no line (a ``--no-progress`` command)."""

    def __init__(self, say: Callable[[str], None], *, interval: float | None = None,
                 status: Callable[[], str | None] | None = None, enabled: bool = True):
        self.say, self.status, self.enabled = say, status, enabled
        self.interval = heartbeat_interval(interval)
        self.start = time.monotonic()
        self._last = self._phase_start = self.start
        self._phase: str | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def phase(self, text: str | None) -> None:
        """What runs from now on (None: nothing to report)."""
        with self._lock:
            self._phase, self._phase_start = text, time.monotonic()

    def said(self) -> None:
        """The work printed a line: the next heartbeat is due ``interval`` seconds from now."""
        with self._lock:
            self._last = time.monotonic()

    def counted(self, say: Callable[[str], None]) -> Callable[[str], None]:
        """``say`` whose every line counts as one the work said (:meth:`said`): the next heartbeat line is due
        ``interval`` seconds after it."""
        def counted_say(line: str) -> None:
            say(line)
            self.said()

        return counted_say

    def lend(self, say: Callable[[str], None], status: Callable[[], str | None]) -> Callable[[], None]:
        """Until the returned function is called, the lines are ``status()`` said by ``say`` (a part of the
        work that shows progress of its own: :class:`ict_jax.sampling.evaluation.Progress`); the clock goes
        on, so a line stays due ``interval`` seconds after the last one, whoever said it."""
        with self._lock:
            before = self.say, self.status
            self.say, self.status = say, status

        def give_back() -> None:
            with self._lock:
                self.say, self.status = before

        return give_back

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def line(self) -> str | None:
        """The heartbeat line due now (None: nothing to say)."""
        with self._lock:
            status, phase, since = self.status, self._phase, self._phase_start
        if status is not None:
            return status()
        if phase is None:
            return None
        now = time.monotonic()
        return f"{phase}: still running, {duration(now - since)} so far ({duration(now - self.start)} in all)"

    def _run(self) -> None:
        while True:
            with self._lock:
                wait = self._last + self.interval - time.monotonic()
            if wait > 0:
                if self._stop.wait(wait):
                    return
                continue
            text = self.line()
            if self._stop.is_set():
                return
            if text:
                with self._lock:
                    say = self.say
                say(text)
            self.said()

    def __enter__(self) -> "Heartbeat":
        if not self.enabled:
            return self
        self._thread = threading.Thread(target=self._run, name="ict_jax-heartbeat", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
