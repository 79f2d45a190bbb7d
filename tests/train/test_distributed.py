"""Two processes x 4 CPU devices (jax.distributed on localhost, gloo collectives) give the
parameters and per-step statistics of one process with 8 devices.

The tiny random model never earns a reward on `arith`, so its RL gradient is rounding residue (norm
~1e-9) that Adam would normalise into lr-sized updates whose signs depend on the all-reduce order
(gloo across processes vs in-process): comparing parameters after such updates tests nothing. So the
parameters are compared after the SFT warm start (real gradients) with the RL learning rate at 0, and
the RL path itself (sampling on the global mesh, each process scoring its rows, the all-gather, the
sharded step) must reproduce the single-process statistics of every RL step."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from test_trainer import DEMO, TINY  # the same folder (pytest puts a test file's folder on sys.path)

pytestmark = pytest.mark.slow

# response buckets (2, 4, 6) of max_new_tokens 6: every process must cut the update and grow the decode cache
# alike (the longest response of the global batch), or the processes' programs would not match
ARGS = TINY + ["train.steps=2", "train.save_every=2", "train.prompts_per_step=8", "mesh.data=-1",
               "rl.loss.kl_coef=0.01", "optim.lr=0", "train.sft_steps=4", "rollout.min_response_bucket=2"]
STATS = ("reward/mean", "response/length_mean", "stats/H1_mean", "stats/H2_mean", "stats/js_mean",
         "mask/selected_frac", "rollout/logp_abs_diff_mean")


def _cmd(run: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "ict_jax.cli", "train", "--config", str(DEMO), "--no-progress", *ARGS,
            f"run_dir={run}", *extra]


def _env(devices: int) -> dict[str, str]:
    return dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} "
                                         + os.environ["ICT_JAX_TEST_SUBPROCESS_XLA_FLAGS"], JAX_PLATFORMS="cpu")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _params(run: Path):
    from flax import nnx

    from ict_jax.train.model_source import resolve_model

    source = resolve_model(run / "checkpoints", checkpoint=True)
    model, meta = source.load(), source.meta
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
    # Adam moves a parameter whose gradient is ~0 by ~lr in the direction of that gradient's rounding
    # noise, which the all-reduce order decides: such entries may differ, but by at most the Adam bound
    # (lr per step); every other entry agrees to float32 tolerance.
    # The key bias bk is all such entries: b_k adds q.b_k to every score of a query, which softmax
    # ignores, so its exact gradient is 0 and its Adam update is pure rounding noise (only the bound).
    sft_lr, sft_steps = 3e-3, 4
    flat_a = jax.tree_util.tree_flatten_with_path(a)[0]
    for (path, x), y in zip(flat_a, jax.tree.leaves(b)):
        name = jax.tree_util.keystr(path)
        np.testing.assert_allclose(y, x, rtol=0, atol=2 * sft_lr * sft_steps, err_msg=name)
        if "'bk'" in name:
            continue
        close = np.isclose(y, x, rtol=1e-5, atol=1e-7)
        assert close.mean() >= 0.98, f"{name}: {(~close).sum()} of {close.size} entries differ"
    from ict_jax.train.logs import read_metrics

    sa = read_metrics(tmp_path / "one" / "metrics.jsonl", phase="sft")
    sb = read_metrics(tmp_path / "two" / "metrics.jsonl", phase="sft")
    np.testing.assert_allclose([r["sft/loss"] for r in sb], [r["sft/loss"] for r in sa], rtol=1e-6)

    ra, rb = read_metrics(tmp_path / "one" / "metrics.jsonl"), read_metrics(tmp_path / "two" / "metrics.jsonl")
    assert [r["step"] for r in ra] == [r["step"] for r in rb] == [0, 1]  # only process 0 logs
    for x, y in zip(ra, rb):
        for k in STATS:
            np.testing.assert_allclose(y[k], x[k], rtol=1e-5, atol=1e-7, err_msg=k)
