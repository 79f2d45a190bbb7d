"""``ict-jax compare --plan`` after Ctrl-C: one line that says how to continue, exit 130."""

from __future__ import annotations

from pathlib import Path

from ict_jax.cli.main import main

PLAN = Path(__file__).resolve().parents[2] / "configs" / "experiments" / "demo_plan.yaml"


def test_ctrl_c_says_how_to_continue(capsys, monkeypatch):
    import ict_jax.experiments.runner as experiment
    from ict_jax.train.stopping import Interrupted

    def interrupted(*a, **k):
        raise Interrupted("interrupted after step 3")

    monkeypatch.setattr(experiment, "run_experiment", interrupted)
    assert main(["compare", "--plan", str(PLAN)]) == 130
    assert capsys.readouterr().err == (
        "ict-jax compare: interrupted (Ctrl-C); the runs keep their last checkpoints: continue with "
        f"ict-jax compare --plan {PLAN}\n")
