"""cli.progress: a command's heartbeat from its first second. Redirected, `ict-jax eval`, `diagnose` and
`align` name their first phase within the heartbeat's interval, before JAX has been imported (here: an
`import jax` that never returns), as `train` and `sft` do (tests/cli/test_train.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cli.test_train import NO_JAX  # tests/ is on sys.path (tests/cli: a namespace package)

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("argv, first", [
    (["eval", "--model", "preset:tiny", "--tokenizer", "char", "--benchmarks", "gsm8k_test"],
     "ict-jax eval: starting (importing JAX and the evaluation): still running, "),
    (["diagnose", "--model", "preset:tiny", "--tokenizer", "char", "--prompts", "split?digits=2&size=4"],
     "[diagnose] starting (importing JAX and the diagnostics): still running, "),
    (["align", "--config", str(ROOT / "configs" / "demo.yaml")],
     "[align] starting (importing JAX and the trainer): still running, "),
])
def test_a_heartbeat_while_jax_is_imported(argv, first, tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(NO_JAX)
    env = dict(os.environ, XLA_FLAGS=os.environ["ICT_JAX_TEST_SUBPROCESS_XLA_FLAGS"], JAX_PLATFORMS="cpu",
               ICT_JAX_HEARTBEAT_S="0.5",
               PYTHONPATH=os.pathsep.join([str(site), os.environ["PYTHONPATH"]]))
    p = subprocess.Popen([sys.executable, "-m", "ict_jax.cli", *argv, "--out", str(tmp_path / "out")], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert p.stdout.readline().strip() == "importing jax"
        line = p.stdout.readline().strip()
        assert line.startswith(first), line
    finally:
        p.kill()
        p.wait()
