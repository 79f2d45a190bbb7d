"""The embedded default, `ict-jax train --config configs/demo.yaml`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ict_jax.train.logs import read_metrics

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "configs" / "demo.yaml"
EVAL = "eval/split?digits=2&size=256&seed=12345/pass@1"


def _run(run_dir: Path, *overrides: str, timeout: int) -> dict:
    # a fresh process with one CPU device, like a user's machine (conftest gives this one 8)
    env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu")
    p = subprocess.run([sys.executable, "-m", "ict_jax.cli", "train", "--config", str(DEMO), "--no-progress",
                        f"run_dir={run_dir}", *overrides], env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads((run_dir / "summary.json").read_text())


@pytest.mark.e2e
def test_demo_shortened_end_to_end(tmp_path):
    """The demo's own model, task and pipeline (SFT warm start, ICT RL, eval, checkpoint, plot), shortened."""
    run = tmp_path / "demo"
    summary = _run(run, "train.sft_steps=20", "train.steps=3", "data.eval=[\"split?digits=2&size=16&seed=12345\"]",
                   timeout=600)
    assert (run / "metrics.png").is_file() and (run / "sft_model" / "config.json").is_file()
    assert list((run / "checkpoints").iterdir())
    rl = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rl] == [0, 1, 2]
    assert len(read_metrics(run / "metrics.jsonl", phase="sft")) == 20
    assert "eval/split?digits=2&size=16&seed=12345/pass@1" in summary["eval_final"]


@pytest.mark.slow
def test_demo_full_improves_held_out_accuracy_by_a_tenth(tmp_path):
    """The README's main command: RL must lift accuracy (P@1, n = 4, temperature 0.6) on 256 fixed
    held-out problems by >= 0.10 absolute over the SFT warm start, at seed 0. Measured on the project's
    AMD EPYC (the RNG streams derived per step, 500 SFT steps): 0.366 -> 0.768 (+0.401); seeds 1 and 2 gained
    +0.086 and +0.110 (docs/results.md)."""
    summary = _run(tmp_path / "demo", timeout=1800)
    before, after = summary["eval_after_sft"][EVAL], summary["eval_final"][EVAL]
    assert after - before >= 0.10, f"warm start {before:.3f} -> after RL {after:.3f}"
