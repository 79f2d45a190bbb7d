"""train/phase.py: the one loop that runs every phase of a run (the SFT warm start, RL): the steps from
the phase's first, the metrics logged under the phase's name, the phase's hooks after each step, Ctrl-C
after the step in progress (the hooks see ``stopping``, the pending save is waited for, Interrupted), a
pause. A toy phase (a counter for a state), nothing compiled."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from ict_jax.train.hooks import Hooks
from ict_jax.train.phase import Phase, run_phase
from ict_jax.train.stopping import Interrupted


class _Checkpointer:
    def __init__(self) -> None:
        self.directory, self.waited = Path("/ckpt/sft"), 0

    def wait(self) -> None:
        self.waited += 1


class _Logger:
    def __init__(self) -> None:
        self.started, self.rows, self.messages = [], [], []

    def start(self, phase: str, total: int, initial: int = 0) -> "_Logger":
        self.started.append((phase, total, initial))
        return self

    def log(self, step: int, metrics: dict, *, phase: str = "rl") -> None:
        self.rows.append((phase, step, dict(metrics)))

    def message(self, text: str) -> None:
        self.messages.append(text)


def _phase(steps: int = 4, interrupt_at: int | None = None) -> tuple[Phase, list, _Checkpointer]:
    seen: list = []

    def step(state: int, s: int) -> tuple[int, dict[str, float]]:
        if s == interrupt_at:
            signal.raise_signal(signal.SIGINT)  # Ctrl-C while the step runs
        return state + 1, {"sft/loss": float(s)}

    hooks = Hooks()
    hooks.add(lambda info: seen.append(("every", info.phase, info.step, info.state, info.final, info.stopping)))
    hooks.add(lambda info: seen.append(("second", info.step)), every=2)
    ckpt = _Checkpointer()
    return Phase("sft", "SFT", steps, step, ckpt, hooks, resuming="resuming the SFT warm start at step {start}/{steps}"), \
        seen, ckpt


def test_a_phase_runs_from_its_first_step_with_its_hooks_and_logs_under_its_name():
    phase, seen, ckpt = _phase()
    logger, states = _Logger(), []
    end = run_phase(phase, 10, 1, logger.start, run_dir=Path("run"), on_state=states.append)
    assert (end.state, end.last, end.paused) == (13, {"sft/loss": 3.0}, None)
    assert logger.started == [("sft", 4, 1)] and logger.messages == ["resuming the SFT warm start at step 1/4"]
    assert [(p, s) for p, s, _ in logger.rows] == [("sft", 1), ("sft", 2), ("sft", 3)] and states == [11, 12, 13]
    assert seen == [("every", "sft", 2, 11, False, False), ("second", 2), ("every", "sft", 3, 12, False, False),
                    ("every", "sft", 4, 13, True, False), ("second", 4)]
    assert ckpt.waited == 0


def test_ctrl_c_stops_after_the_step_in_progress_with_the_hooks_told_and_the_save_waited_for():
    phase, seen, ckpt = _phase(interrupt_at=1)
    logger = _Logger()
    with pytest.raises(Interrupted, match=r"^interrupted at SFT step 2/4; checkpoints are in /ckpt/sft: continue "
                                          r"with --resume run_dir=run$"):
        run_phase(phase, 0, 0, logger.start, run_dir=Path("run"))
    assert seen[-2:] == [("every", "sft", 2, 2, False, True), ("second", 2)] and ckpt.waited == 1
    assert any("Ctrl-C" in m for m in logger.messages)


def test_a_pause_ends_the_phase_at_a_step_with_the_hooks_told():
    phase, seen, ckpt = _phase()
    end = run_phase(phase, 0, 0, _Logger().start, run_dir=Path("run"), pause=lambda done: done == 2)
    assert (end.state, end.paused) == (2, 2) and ckpt.waited == 1
    assert seen[-2:] == [("every", "sft", 2, 2, False, True), ("second", 2)]
    # never asked after the last step: the phase then ends as it would
    end = run_phase(_phase()[0], 0, 0, _Logger().start, run_dir=Path("run"), pause=lambda done: True)
    assert end.paused == 1
    end = run_phase(_phase(steps=1)[0], 0, 0, _Logger().start, run_dir=Path("run"), pause=lambda done: True)
    assert (end.state, end.paused) == (1, None)


def test_the_warm_start_has_no_loop_of_its_own():
    """One training loop: train.phase.run_phase; the warm start is a phase of it."""
    import ict_jax.train.warm_start as ws

    source = Path(ws.__file__).read_text()
    assert "for " not in "".join(line for line in source.splitlines(keepends=True) if "range(" in line)
