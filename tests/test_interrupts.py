"""ict_jax.interrupts: a Ctrl-C that lands while the garbage collector runs is not lost.

The deterministic tests raise SIGINT from inside code the collector runs (a gc callback of their own, as
JAX's runs at every collection; a weak reference's callback; a finalizer): with Python's default handler
the KeyboardInterrupt is dropped (the control, so the tests can fail), with ours it is raised in the test's
own code, at the line after the collection."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import weakref

import pytest

from ict_jax import interrupts

WHERE = ["gc_callback", "weakref_callback", "finalizer"]


def _spin(seconds: float) -> None:
    """Python code running for ``seconds`` (where a pending signal's handler runs)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def _sigint_here() -> None:
    signal.raise_signal(signal.SIGINT)
    _spin(0.01)  # the handler runs at the first check, here, inside the collection


class _Finalized:
    def __del__(self):
        _sigint_here()


@pytest.fixture(params=WHERE)
def sigint_in_collection(request, monkeypatch):
    """``arm()`` leaves garbage (or a gc callback) that sends SIGINT from inside the next ``gc.collect()``,
    in a gc callback, a weak reference's callback or a finalizer (automatic collections off meanwhile, so
    that none fires it first). Yields ``arm`` and the exceptions Python dropped (sys.unraisablehook)."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers are set in the main thread only")
    where = request.param
    state = {"armed": False}
    dropped = []
    monkeypatch.setattr(sys, "unraisablehook", dropped.append)
    keep = []

    def callback(phase, info):
        if phase == "start" and state["armed"]:
            state["armed"] = False
            _sigint_here()

    def arm():
        if where == "gc_callback":
            state["armed"] = True
            return
        node = _Finalized() if where == "finalizer" else type("Node", (), {})()
        node.cycle = node  # only the collector frees it
        if where == "weakref_callback":
            keep.append(weakref.ref(node, lambda ref: _sigint_here()))

    before = signal.getsignal(signal.SIGINT)
    was_enabled = gc.isenabled()
    gc.disable()
    # everything alive so far, earlier garbage included, out of the way: the test's collections see only
    # what it makes (and take milliseconds, where a full collection of a worker's objects took seconds)
    gc.freeze()
    gc.callbacks.append(callback)
    try:
        yield arm, dropped
    finally:
        gc.callbacks.remove(callback)
        signal.signal(signal.SIGINT, before)
        gc.unfreeze()
        if was_enabled:
            gc.enable()


def test_the_control_python_s_default_handler_loses_a_ctrl_c_raised_in_a_collection(sigint_in_collection):
    arm, dropped = sigint_in_collection
    signal.signal(signal.SIGINT, signal.default_int_handler)
    arm()
    gc.collect()
    _spin(0.1)  # no KeyboardInterrupt comes: it was dropped
    assert [d.exc_type for d in dropped] == [KeyboardInterrupt]


def _raised_at(tb) -> tuple[str, int]:
    """Where the exception was raised in the program's code: the last frame of its traceback that is not
    ict_jax.interrupts' own (its trace function raises it)."""
    where = None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename != interrupts.__file__:
            where = tb.tb_frame.f_code.co_name, tb.tb_lineno
        tb = tb.tb_next
    return where


def test_our_handler_raises_it_at_the_next_line_of_the_code_the_collection_interrupted(sigint_in_collection):
    arm, dropped = sigint_in_collection
    signal.signal(signal.SIGINT, interrupts.raise_keyboard_interrupt)
    reached, raised_at = False, None
    try:
        arm()
        gc.collect()
        reached = True  # never: the Ctrl-C comes first
    except KeyboardInterrupt as e:
        raised_at = _raised_at(e.__traceback__)
    line = sys._getframe().f_lineno
    assert raised_at == (sys._getframe().f_code.co_name, line - 3), raised_at
    assert not reached and dropped == []
    assert sys.gettrace() is None  # its trace function is gone


def test_a_second_ctrl_c_in_one_collection_raises_once_and_nothing_stays_traced(sigint_in_collection):
    arm, dropped = sigint_in_collection
    signal.signal(signal.SIGINT, interrupts.raise_keyboard_interrupt)
    state = {"on": False}

    def twice(phase, info):
        if phase == "start" and state["on"]:
            _sigint_here()
            _sigint_here()

    gc.callbacks.append(twice)
    raised = 0
    try:
        try:
            arm()
            state["on"] = True
            gc.collect()
            state["on"] = False
        except KeyboardInterrupt:
            raised += 1
        state["on"] = False
        _spin(0.05)
        raised_later = False
    except KeyboardInterrupt:
        raised_later = True
    finally:
        gc.callbacks.remove(twice)
    assert raised == 1 and not raised_later and dropped == []
    assert sys.gettrace() is None and sys._getframe().f_trace is None


def test_the_training_loop_s_second_ctrl_c_is_not_lost_in_a_collection_either(sigint_in_collection):
    from ict_jax.train.stopping import stop_after_step

    arm, dropped = sigint_in_collection
    said = []
    reached = False
    with pytest.raises(KeyboardInterrupt):
        with stop_after_step(said.append) as stop:
            stop.requested = True  # the first Ctrl-C came earlier
            arm()
            gc.collect()
            reached = True
    assert not reached and dropped == [] and said == []


@pytest.mark.skipif(os.name != "posix", reason="sends SIGINT to a child process")
def test_ctrl_c_stops_a_program_that_allocates_after_import_jax():
    """The case this module exists for: JAX's own gc callback runs at every collection of a loop that
    allocates; every Ctrl-C stops it (Python's default handler lost most on this machine)."""
    child = textwrap.dedent(
        """
        import sys
        import jax  # registers its gc callback
        from ict_jax import interrupts
        assert interrupts.install()
        print("ready", flush=True)
        try:
            while True:
                junk = [[i] for i in range(2000)]
                for j in junk:
                    j.append(j)  # cycles: collections keep running
        except KeyboardInterrupt:
            print("stopped", flush=True)
            sys.exit(130)
        """
    )
    for attempt in range(3):
        proc = subprocess.Popen(
            [sys.executable, "-c", child],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "JAX_PLATFORMS": "cpu"},
        )
        try:
            assert proc.stdout.readline().strip() == "ready"
            time.sleep(0.3 + 0.2 * attempt)
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        assert proc.returncode == 130 and out.strip() == "stopped", (proc.returncode, out, err[-2000:])
        assert "Exception ignored" not in err, err[-2000:]


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
