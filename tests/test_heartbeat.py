"""ict_jax.heartbeat: a line whenever the interval passes without one, naming the phase that runs; lines the
work prints itself postpone it; the interval from the argument, else $ICT_JAX_HEARTBEAT_S, else 30 s."""

from __future__ import annotations

import time

from ict_jax.heartbeat import DEFAULT_INTERVAL, INTERVAL_ENV, Heartbeat, duration, heartbeat_interval


def test_a_line_each_interval_naming_the_phase():
    lines: list[str] = []
    with Heartbeat(lines.append, interval=0.05) as beat:
        time.sleep(0.2)  # no phase yet: nothing to say
        assert lines == []
        beat.phase("G8_T1: sampling prompts 1-4 of 4")
        time.sleep(0.4)
    n = len(lines)
    assert n >= 3, lines
    assert all(ln.startswith("G8_T1: sampling prompts 1-4 of 4: still running, ") and ln.endswith(" in all)")
               for ln in lines), lines
    time.sleep(0.2)
    assert len(lines) == n  # stopped with its block


def test_lines_of_the_work_postpone_it_and_a_status_function_gives_the_line():
    lines: list[str] = []
    with Heartbeat(lines.append, interval=0.3, status=lambda: "eval 3/8 problems") as beat:
        for _ in range(8):  # the work says something every 0.1 s: no heartbeat needed
            time.sleep(0.1)
            beat.said()
        assert lines == []
        time.sleep(0.5)
    assert lines and set(lines) == {"eval 3/8 problems"}
    quiet: list[str] = []
    with Heartbeat(quiet.append, interval=0.01, status=lambda: "x", enabled=False):
        time.sleep(0.1)
    assert quiet == []


def test_the_interval_and_durations(monkeypatch):
    monkeypatch.delenv(INTERVAL_ENV, raising=False)
    assert heartbeat_interval() == DEFAULT_INTERVAL == 30.0
    monkeypatch.setenv(INTERVAL_ENV, "0.5")
    assert heartbeat_interval() == 0.5 and heartbeat_interval(2) == 2.0
    for bad in ("0", "-1", "soon"):
        monkeypatch.setenv(INTERVAL_ENV, bad)
        assert heartbeat_interval() == DEFAULT_INTERVAL
    assert (duration(9), duration(75), duration(3725)) == ("9s", "1m15s", "1h02m")


def test_a_lent_heartbeat_speaks_for_the_borrower_on_its_own_clock():
    """A part of the work with progress of its own speaks through the running heartbeat (its lines, its
    status) until it gives it back; the clock goes on: no second thread, no gap at the hand-over."""
    own: list[str] = []
    lent: list[str] = []
    with Heartbeat(own.append, interval=0.05) as beat:
        beat.phase("loading")
        time.sleep(0.2)
        give_back = beat.lend(lent.append, lambda: "eval 1/4 problems")
        time.sleep(0.2)
        give_back()
        n = len(own)
        time.sleep(0.2)
    assert lent and set(lent) == {"eval 1/4 problems"}, lent
    assert own and all(ln.startswith("loading: still running, ") for ln in own) and len(own) > n, own


def test_counted_says_the_line_and_counts_it_as_said():
    from ict_jax.heartbeat import Heartbeat

    lines = []
    beat = Heartbeat(lines.append, interval=3600.0)
    before = beat._last
    time.sleep(0.01)
    beat.counted(lines.append)("loading ...")
    assert lines == ["loading ..."] and beat._last > before
