"""ict_jax.experiments.box: what fits in an invocation's time box, on a hand-driven clock (the runner
keeping its box: tests/experiments/test_runner.py)."""

from __future__ import annotations

from ict_jax.experiments.box import TimeBox


class Clock:
    def __init__(self, t: float = 0.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_without_a_box_everything_fits_and_nothing_is_measured_against_it():
    clock = Clock()
    box = TimeBox(None, step_s=100.0, eval_s=1000.0, clock=clock)
    box.step_done()
    assert box.fits(steps=10**6, evaluation=True) and not box.spent() and box.why() == "stop requested"


def test_a_fresh_invocation_always_starts_then_the_pace_decides():
    clock = Clock(0.0)
    box = TimeBox(250.0, step_s=100.0, eval_s=1000.0, clock=clock)
    assert box.fits(steps=1, evaluation=True)  # nothing done yet: one piece whatever the box
    box.chunk_started()
    clock.t = 130.0  # start-up and the first step: not a step's time
    box.step_done()
    assert box.worked and box.step_seconds() == 100.0  # still the known pace
    assert box.fits(steps=1)  # 130 + 100 <= 250
    assert not box.ended_early
    assert not box.fits(steps=1, evaluation=True)  # 130 + 100 + 1000 > 250: the last step with its evaluation
    assert box.ended_early and box.why() == "time box" and not box.spent()
    clock.t = 190.0
    box.step_done()  # a step of 60 s measured: this invocation's pace replaces the known one
    assert box.step_seconds() == 60.0 and box.fits(steps=1) and not box.fits(steps=2)  # 250 = 250; 310 > 250
    clock.t = 250.0
    assert box.spent() and not box.fits() and box.why() == "time box"


def test_steps_are_timed_between_two_steps_of_one_chunk_and_evaluations_by_their_own_seconds():
    clock = Clock(0.0)
    box = TimeBox(10_000.0, clock=clock)
    assert box.step_seconds() is None and box.eval_seconds() is None
    assert box.fits(steps=1, evaluation=True)
    box.chunk_started()
    for t in (50.0, 60.0, 80.0):  # steps of 10 s and 20 s after the first
        clock.t = t
        box.step_done()
    assert box.step_seconds() == 15.0
    clock.t = 500.0  # the final evaluation ran inside the last step's call
    box.evaluation_done(400.0)
    assert box.eval_seconds() == 400.0
    box.chunk_started()  # the next run: its first step's time is its start-up
    clock.t = 700.0
    box.step_done()
    assert box.step_seconds() == 15.0
    box.evaluation_done(None)  # an evaluation of unknown length: counted as work, no time
    assert box.eval_seconds() == 400.0
    # 700 + 9 x 15 + 400 = 1235 fits; the unknown parts count nothing
    assert box.fits(steps=9, evaluation=True) and TimeBox(800.0, clock=clock, worked=True).fits(steps=5)


def test_the_caller_s_request_to_stop_counts_as_the_box():
    asked = []
    box = TimeBox(None, should_stop=lambda: asked.append(1) or len(asked) >= 2, clock=Clock())
    assert box.fits() and not box.fits() and box.why() == "stop requested"


def test_the_eta_s_pace_is_the_chunks_start_up_included():
    clock = Clock(0.0)
    box = TimeBox(None, step_s=100.0, eval_s=1000.0, clock=clock)
    assert box.eta_pace() == (None, None) and box.chunks == 0  # the known pace is the box's, not the ETA's
    box.chunk_done(130.0, 2, False, None)  # 2 steps in 130 s, start-up included
    assert box.eta_pace() == (65.0, None) and not box.worked  # work is counted by step_done/evaluation_done
    box.chunk_done(700.0, 3, True, 400.0)  # 3 steps and the final evaluation: (700 - 400) / 3 = 100 s a step
    assert box.eta_pace() == (82.5, 400.0) and box.worked and box.eval_seconds() == 400.0
    box.chunk_done(500.0, 0, True, 500.0)  # only an evaluation (its run was stopped inside it before)
    assert box.eta_pace() == (82.5, 450.0) and box.chunks == 3
    box.chunk_done(50.0, 0, True, None)  # an evaluation of unknown length: no time
    assert box.eta_pace() == (82.5, 450.0) and box.eval_seconds() == 500.0
