"""The embedded default, `ict-jax train --config configs/demo.yaml`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
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


T_ONE_SIDED_1PCT = 2.34  # Student t, 255 degrees of freedom, one-sided p = 0.01


def _pass_at_1_per_problem(path: Path) -> dict[int, float]:
    """Each held-out problem's P@1 (the share of its samples that are correct) from an evaluation's jsonl."""
    samples: dict[int, list[bool]] = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        samples.setdefault(row["index"], []).append(bool(row["correct"]))
    return {i: sum(c) / len(c) for i, c in samples.items()}


@pytest.mark.slow
def test_demo_full_lifts_held_out_accuracy_beyond_evaluation_noise(tmp_path):
    """The README's main command: RL must lift accuracy (P@1, n = 4, temperature 0.6) on 256 fixed held-out
    problems over the SFT warm start at seed 0, by more than the evaluation's noise: the paired t over the
    problems (each problem's P@1 after RL minus after SFT) at least 2.34 (one-sided p < 0.01).

    How much RL gains depends on the CPU's floating-point kernels (the warm start's trajectory is chaotic,
    README): seed 0 went 0.366 -> 0.768 (+0.401) on the AMD EPYC where the README's table was measured, and
    0.251 -> 0.314 (+0.063, t = 3.37) on an Intel Xeon, with the same code (docs/results.md). An earlier form
    of this test asked for +0.10 absolute, which held on the first machine only."""
    run = tmp_path / "demo"
    summary = _run(run, timeout=1800)
    before, after = summary["eval_after_sft"][EVAL], summary["eval_final"][EVAL]
    sft, rl = (_pass_at_1_per_problem(run / "eval" / f"step_{s:06d}.jsonl") for s in (0, summary["steps"]))
    assert sorted(sft) == sorted(rl) == list(range(256))
    d = np.array([rl[i] - sft[i] for i in sorted(sft)])
    assert np.isclose(d.mean(), after - before)  # the per-problem rows are the summary's P@1
    t = d.mean() / (d.std(ddof=1) / np.sqrt(len(d)))
    assert t >= T_ONE_SIDED_1PCT, f"warm start {before:.3f} -> after RL {after:.3f}: paired t {t:.2f}"
