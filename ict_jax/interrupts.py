"""A Ctrl-C that is never lost.

CPython prints and forgets an exception raised inside a garbage-collector callback ("Exception ignored
in: <function _xla_gc_callback ...>"). JAX registers such a callback, which runs at every collection, and
Python runs a signal's handler at the first point it checks for one, often inside that callback when the
program allocates: Python's default SIGINT handler then raises ``KeyboardInterrupt`` where it is dropped,
and the program goes on as if Ctrl-C had not been pressed (while loading a model, evaluating, building a
report: anywhere outside the training loop's own handler, :func:`ict_jax.train.stopping.stop_after_step`).

:func:`raise_keyboard_interrupt` is Python's default handler but for that: inside a gc callback it sends
the signal again :data:`RETRY_S` later, when the callback has returned, and the ``KeyboardInterrupt`` is
raised in the program's own code. :func:`install` puts it in place of Python's default handler; the
``ict-jax`` command line does so at its start. This module imports nothing heavy (the CLI's start stays
cheap)."""

from __future__ import annotations

import gc
import os
import signal
import threading
from types import CodeType, FrameType

# seconds before a Ctrl-C that arrived inside a gc callback is sent again (a callback returns in
# microseconds to milliseconds; a person does not notice 20 ms)
RETRY_S = 0.02


def _callback_codes() -> set[CodeType]:
    codes = set()
    for cb in gc.callbacks:  # a function, a bound method or an object with __call__
        fn = getattr(cb, "__func__", cb)
        call = next((vars(k)["__call__"] for k in type(fn).__mro__ if "__call__" in vars(k)), None)
        code = getattr(fn, "__code__", None) or getattr(call, "__code__", None)
        if code is not None:
            codes.add(code)
    return codes


def in_gc_callback(frame: FrameType | None) -> bool:
    """Whether ``frame`` (the frame a signal handler interrupted) runs inside a garbage-collector callback
    (a function of ``gc.callbacks``, or code it called), where a raised exception would be dropped."""
    codes = _callback_codes()
    while frame is not None and codes:
        if frame.f_code in codes:
            return True
        frame = frame.f_back
    return False


def send_again_later(signum: int = signal.SIGINT, delay: float = RETRY_S) -> None:
    """The signal ``signum`` sent to this process again in ``delay`` seconds (a daemon timer thread;
    Python runs the handler in the main thread, as for any signal)."""
    timer = threading.Timer(delay, os.kill, (os.getpid(), signum))
    timer.daemon = True
    timer.start()


def raise_keyboard_interrupt(signum: int, frame: FrameType | None) -> None:
    """A SIGINT handler: ``raise KeyboardInterrupt`` as Python's default one does, except inside a gc
    callback, where that would be dropped: there the signal comes again :data:`RETRY_S` later."""
    if in_gc_callback(frame):
        send_again_later(signum)
        return
    raise KeyboardInterrupt


def install() -> bool:
    """:func:`raise_keyboard_interrupt` as the SIGINT handler, in place of Python's default one; True when it
    was installed. Left alone: another thread than the main one (only it may set handlers), a SIGINT that
    is ignored (a background job started by a non-interactive shell: ``cmd &``) or handled by anyone else."""
    if threading.current_thread() is not threading.main_thread():
        return False
    current = signal.getsignal(signal.SIGINT)
    if current is raise_keyboard_interrupt:
        return True
    if current is not signal.default_int_handler:
        return False
    signal.signal(signal.SIGINT, raise_keyboard_interrupt)
    return True
