"""A Ctrl-C that is never lost.

CPython prints and forgets an exception raised while the garbage collector runs: in a gc callback ("Exception
ignored in: <function _xla_gc_callback ...>"), a finalizer or a weak reference's callback. JAX registers a gc
callback, which runs at every collection, and Python runs a signal's handler at the first point it checks for
one, often inside that collection when the program allocates: Python's default SIGINT handler then raises
``KeyboardInterrupt`` where it is dropped, and the program goes on as if Ctrl-C had not been pressed (while
loading a model, evaluating, building a report: anywhere outside the training loop's own handler,
:func:`ict_jax.train.stopping.stop_after_step`).

:func:`raise_keyboard_interrupt` is Python's default handler but for that: inside a collection it raises the
``KeyboardInterrupt`` in the program's own code instead, in the frame that was running when the collection
began, at that frame's next line (a trace function on that frame alone, removed once it has fired). Nothing
is timed, so it holds on a loaded machine too. A compilation or a computation in progress ends first, as with
Python's own handler. :func:`install` puts it in place of Python's default handler; the ``ict-jax`` command
line does so at its start. This module imports nothing heavy (the CLI's start stays cheap); importing it
registers one gc callback of its own (:func:`collecting`: which frame each thread's collection interrupted)."""

from __future__ import annotations

import gc
import signal
import sys
import threading
from types import CodeType, FrameType
from typing import Any

# thread id -> the frame that was running when that thread's collection began (None: no Python frame)
_collections: dict[int, FrameType | None] = {}


def _track(phase: str, info: dict) -> None:
    """gc callback: which frame each thread's collection interrupted, from its start to its stop."""
    if phase == "start":
        try:
            _collections[threading.get_ident()] = sys._getframe(1)
        except ValueError:  # the collection began where no Python code runs
            _collections[threading.get_ident()] = None
    else:
        _collections.pop(threading.get_ident(), None)


if _track not in gc.callbacks:
    gc.callbacks.insert(0, _track)  # first: in place before any other callback runs at a collection's start


def collecting() -> tuple[bool, FrameType | None]:
    """Whether this thread's garbage collector is running (from the start of its callbacks to the stop of
    this module's own), and the frame that was running when it began."""
    ident = threading.get_ident()
    return ident in _collections, _collections.get(ident)


def _callback_codes() -> set[CodeType]:
    codes = set()
    for cb in gc.callbacks:  # a function, a bound method or an object with __call__
        fn = getattr(cb, "__func__", cb)
        call = next((vars(k)["__call__"] for k in type(fn).__mro__ if "__call__" in vars(k)), None)
        code = getattr(fn, "__code__", None) or getattr(call, "__code__", None)
        if code is not None:
            codes.add(code)
    return codes


def _outermost_callback(frame: FrameType | None) -> FrameType | None:
    """The outermost frame of a gc callback among ``frame`` and its callers (None: none runs one)."""
    codes = _callback_codes()
    outermost = None
    while frame is not None and codes:
        if frame.f_code in codes:
            outermost = frame
        frame = frame.f_back
    return outermost


def in_gc_callback(frame: FrameType | None) -> bool:
    """Whether ``frame`` (the frame a signal handler interrupted) runs inside a garbage-collector callback
    (a function of ``gc.callbacks``, or code it called), where a raised exception would be dropped."""
    return _outermost_callback(frame) is not None


def raise_at_next_line(frame: FrameType, exc: type[BaseException] = KeyboardInterrupt) -> None:
    """``exc`` raised in ``frame`` (of this thread) at its next line, return or exception event, by a trace
    function on that frame alone; other frames are not traced (the thread-wide trace function this sets,
    when there is none, returns None for every call). Raising from a trace function makes CPython switch
    tracing off for the thread and clear the frame's trace function: nothing of this stays behind, and a
    trace function that was in place (a debugger's, coverage's) is switched off with it."""
    if getattr(frame.f_trace, "raises", None) is not None:  # armed already (a second Ctrl-C in one collection)
        return

    def only_new_calls(f: FrameType, event: str, arg: Any) -> None:
        return None

    def fire(f: FrameType, event: str, arg: Any) -> None:
        raise exc

    fire.raises = exc  # type: ignore[attr-defined]
    frame.f_trace = fire
    frame.f_trace_lines = True
    if sys.gettrace() is None:
        sys.settrace(only_new_calls)  # tracing on for this thread, so that the frame's own trace function runs


def raise_keyboard_interrupt(signum: int, frame: FrameType | None) -> None:
    """A SIGINT handler: ``raise KeyboardInterrupt`` as Python's default one does, except where the garbage
    collector runs (its callbacks, the finalizers and weak-reference callbacks it calls), where that would be
    dropped: there it is raised at the next line of the frame the collection interrupted."""
    in_collection, target = collecting()
    if not in_collection:
        callback = _outermost_callback(frame)  # a collection that began before this module was imported
        if callback is None:
            raise KeyboardInterrupt
        target = callback.f_back
    if target is None:  # no Python frame of the program to raise it in: here, as Python's own handler does
        raise KeyboardInterrupt
    raise_at_next_line(target)


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
