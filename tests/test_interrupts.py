"""ict_jax.interrupts: a Ctrl-C that lands inside a garbage-collector callback is not lost.

The deterministic tests raise SIGINT from inside a gc callback of their own (as JAX's runs at every
collection): with Python's default handler the KeyboardInterrupt is dropped (the control, so the test can
fail), with ours it is raised in the test's own code."""

from __future__ import annotations

import gc
import signal
import sys
import threading
import time

import pytest

from ict_jax import interrupts


def _spin(seconds: float) -> None:
    """Python code running for ``seconds`` (where a pending signal's handler runs)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


@pytest.fixture
def sigint_inside_gc(monkeypatch):
    """A gc callback that, once armed, sends SIGINT while it runs and keeps running Python code (where the
    handler runs); the test installs the handler and arms it just before ``gc.collect()`` (armed earlier, an
    automatic collection could fire it first). Yields ``arm`` and the dropped exceptions (sys.unraisablehook)."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers are set in the main thread only")
    state = {"armed": False}
    dropped = []
    monkeypatch.setattr(sys, "unraisablehook", dropped.append)

    def callback(phase, info):
        if phase != "start" or not state["armed"]:
            return
        state["armed"] = False
        signal.raise_signal(signal.SIGINT)
        _spin(0.05)  # the handler runs at the first check, here, inside the callback

    before = signal.getsignal(signal.SIGINT)
    gc.callbacks.append(callback)
    try:
        yield lambda: state.update(armed=True), dropped
    finally:
        gc.callbacks.remove(callback)
        signal.signal(signal.SIGINT, before)


def test_the_control_python_s_default_handler_loses_a_ctrl_c_raised_in_a_gc_callback(sigint_inside_gc):
    arm, dropped = sigint_inside_gc
    signal.signal(signal.SIGINT, signal.default_int_handler)
    arm()
    gc.collect()
    _spin(0.3)  # no KeyboardInterrupt comes: it was dropped
    assert [d.exc_type for d in dropped] == [KeyboardInterrupt]


def test_our_handler_raises_it_in_the_program_s_code_once_the_callback_returned(sigint_inside_gc):
    arm, dropped = sigint_inside_gc
    signal.signal(signal.SIGINT, interrupts.raise_keyboard_interrupt)
    raised_in = None
    try:
        arm()
        gc.collect()
        _spin(2.0)
    except KeyboardInterrupt as e:
        raised_in = e.__traceback__
    assert raised_in is not None, "the Ctrl-C was lost"
    assert dropped == []  # nothing dropped
    frames = []
    tb = raised_in
    while tb is not None:
        frames.append(tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    assert "callback" not in frames, frames


def test_the_training_loop_s_second_ctrl_c_is_not_lost_in_a_gc_callback_either(sigint_inside_gc):
    from ict_jax.train.stopping import stop_after_step

    arm, dropped = sigint_inside_gc
    said = []
    with pytest.raises(KeyboardInterrupt):
        with stop_after_step(said.append) as stop:
            stop.requested = True  # the first Ctrl-C came earlier
            arm()
            gc.collect()
            _spin(2.0)
    assert dropped == [] and said == []


def test_in_gc_callback_looks_up_the_interrupted_frame_s_callers():
    seen = {}

    def callback(phase, info):
        if phase == "start" and "inside" not in seen:
            seen["inside"] = interrupts.in_gc_callback(sys._getframe())
            seen["nested"] = (lambda: interrupts.in_gc_callback(sys._getframe()))()

    class Timer:  # a callback object (its __call__'s frame is the one interrupted)
        def __call__(self, phase, info):
            if phase == "start" and "object" not in seen:
                seen["object"] = interrupts.in_gc_callback(sys._getframe())

    timer = Timer()
    gc.callbacks.extend([callback, timer])
    try:
        gc.collect()
    finally:
        gc.callbacks.remove(callback)
        gc.callbacks.remove(timer)
    assert seen == {"inside": True, "nested": True, "object": True}
    assert not interrupts.in_gc_callback(sys._getframe())
    assert not interrupts.in_gc_callback(None)


def test_install_replaces_only_python_s_default_handler_in_the_main_thread(monkeypatch):
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers are set in the main thread only")
    before = signal.getsignal(signal.SIGINT)
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        assert interrupts.install() and signal.getsignal(signal.SIGINT) is interrupts.raise_keyboard_interrupt
        assert interrupts.install()  # again: already in place
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a background job: Ctrl-C stays ignored
        assert not interrupts.install() and signal.getsignal(signal.SIGINT) is signal.SIG_IGN

        def theirs(signum, frame):
            pass

        signal.signal(signal.SIGINT, theirs)
        assert not interrupts.install() and signal.getsignal(signal.SIGINT) is theirs
        result = []
        t = threading.Thread(target=lambda: result.append(interrupts.install()))
        t.start()
        t.join()
        assert result == [False]
    finally:
        signal.signal(signal.SIGINT, before)


def test_the_command_line_installs_it(monkeypatch):
    from ict_jax.cli import main as cli_main

    calls = []
    monkeypatch.setattr(interrupts, "install", lambda: calls.append(1) or True)
    monkeypatch.setattr(sys, "argv", ["ict-jax"])
    assert cli_main.main() == 2  # no command: the help, exit 2
    assert calls == [1]
    assert cli_main.main([]) == 2  # a call from Python code leaves its caller's handlers alone
    assert calls == [1]
