"""Issue 7: two processes x 4 CPU devices (jax.distributed on localhost, gloo collectives) give the
parameters of one process with 8 devices after 2 steps."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from test_trainer import DEMO, TINY  # tests/ is on sys.path (pytest rootdir conftest)

pytestmark = pytest.mark.slow

ARGS = TINY + ["train.steps=2", "train.save_every=2", "train.prompts_per_step=8", "mesh.data=-1",
               "rl.loss.kl_coef=0.01"]


def _cmd(run: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "ict_jax.cli", "train", "--config", str(DEMO), "--no-progress", *ARGS,
            f"run_dir={run}", *extra]


def _env(devices: int) -> dict[str, str]:
    return dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _params(run: Path):
    from flax import nnx

    from ict_jax.checkpoint import load_params_from_checkpoint

    model, meta = load_params_from_checkpoint(run / "checkpoints")
    return meta["step"], jax.tree.map(np.asarray, nnx.state(model, nnx.Param))


def test_two_processes_equal_one_process(tmp_path):
    one = subprocess.run(_cmd(tmp_path / "one"), env=_env(8), capture_output=True, text=True, timeout=900)
    assert one.returncode == 0, one.stderr[-3000:]
    port = _free_port()
    procs = [subprocess.Popen(_cmd(tmp_path / "two", f"--coordinator=127.0.0.1:{port}", "--num-processes=2",
                                   f"--process-id={i}"), env=_env(4), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outs = [p.communicate(timeout=900)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outs)
    step_a, a = _params(tmp_path / "one")
    step_b, b = _params(tmp_path / "two")
    assert step_a == step_b == 2
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(y, x, rtol=1e-5, atol=1e-7)
    # only process 0 logs
    assert len((tmp_path / "two" / "metrics.jsonl").read_text().splitlines()) == (
        len((tmp_path / "one" / "metrics.jsonl").read_text().splitlines()))
