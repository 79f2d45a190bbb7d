"""``ict-jax train`` / ``sft`` hold their run directory from the command's first second, before JAX is
imported: a second run, or a ``--resume``, on it is refused at once naming the first one's process, also
before the first run has written its config.json."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ict_jax.cli.main import main
from ict_jax.outputs import held_by

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "configs" / "demo.yaml"
#: sitecustomize of a process whose `import jax` never returns: what it holds then, it took before JAX
NO_JAX = """
import sys, time
from importlib.abc import MetaPathFinder

class _Hang(MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "jax":
            print("importing jax", flush=True)
            time.sleep(600)
        return None

sys.meta_path.insert(0, _Hang())
"""


@pytest.mark.parametrize("command", ["train", "sft"])
def test_the_run_dir_is_held_before_jax_is_imported(command, tmp_path, capsys):
    run = tmp_path / "run"
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(NO_JAX)
    env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([str(site), os.environ["PYTHONPATH"]]))
    for key in ("ICT_JAX_COORDINATOR", "ICT_JAX_NUM_PROCESSES"):
        env.pop(key, None)
    first = subprocess.Popen([sys.executable, "-m", "ict_jax.cli", command, "--config", str(DEMO), f"run_dir={run}"],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert first.stdout.readline().strip() == "importing jax", "the command imported JAX"
        holder = held_by(run)
        assert holder is not None and holder.startswith(f"process {first.pid} on "), holder
        assert sorted(p.name for p in run.iterdir()) == [".lock"]  # no config.json yet
        in_use = f"error: run_dir '{run}' is in use by process {first.pid} on "
        for argv in (["train", "--resume", f"run_dir={run}"],  # the recorded config: none yet
                     ["train", "--config", str(DEMO), "--resume", f"run_dir={run}"],
                     ["sft", "--config", str(DEMO), f"run_dir={run}"]):
            t0 = time.perf_counter()
            assert main(argv) == 2, argv
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and in_use in err and "(nothing was written)" in err, (argv, err)
            assert time.perf_counter() - t0 < 5, "refused at once"
    finally:
        first.kill()
        first.wait()
    assert not run.exists() or sorted(p.name for p in run.iterdir()) == [".lock"]


def test_resume_of_a_folder_that_is_not_held_and_has_no_run(tmp_path, capsys):
    """Without a holder the message is the one for a folder without a run (the hold check comes first)."""
    run = tmp_path / "run"
    run.mkdir()
    assert main(["train", "--resume", f"run_dir={run}"]) == 2
    err = capsys.readouterr().err
    assert err == (f"ict-jax train: error: --resume: '{run / 'config.json'}' does not exist: no run is recorded in "
                   f"run_dir '{run}' (name a config with --config to start one)\n")
