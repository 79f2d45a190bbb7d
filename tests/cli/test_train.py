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
    env = dict(os.environ, XLA_FLAGS=os.environ["ICT_JAX_TEST_SUBPROCESS_XLA_FLAGS"], JAX_PLATFORMS="cpu",
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
        # in a process of its own, whose `import jax` would never return: the refusal needs no JAX
        second = subprocess.run([sys.executable, "-m", "ict_jax.cli", "train", "--config", str(DEMO), "--resume",
                                 f"run_dir={run}"], env=env, capture_output=True, text=True, timeout=120)
        assert second.returncode == 2 and in_use in second.stderr, second.stderr
        assert "importing jax" not in second.stdout + second.stderr
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


# ------------------------------------------------------------------------------------------------
# The heartbeat covers every phase of the command, from its first second
# ------------------------------------------------------------------------------------------------
def test_a_heartbeat_while_jax_and_the_trainer_are_imported(tmp_path):
    """Redirected, the command names its first phase within the heartbeat's interval, before JAX has
    been imported (here: an `import jax` that never returns)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(NO_JAX)
    env = dict(os.environ, XLA_FLAGS=os.environ["ICT_JAX_TEST_SUBPROCESS_XLA_FLAGS"], JAX_PLATFORMS="cpu",
               ICT_JAX_HEARTBEAT_S="0.5",
               PYTHONPATH=os.pathsep.join([str(site), os.environ["PYTHONPATH"]]))
    p = subprocess.Popen([sys.executable, "-m", "ict_jax.cli", "train", "--config", str(DEMO),
                          f"run_dir={tmp_path / 'run'}"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True)
    try:
        assert p.stdout.readline().strip() == "importing jax"
        line = p.stdout.readline().strip()
        assert line.startswith("ict-jax train: starting (importing JAX and the trainer): still running, "), line
    finally:
        p.kill()
        p.wait()


class _Stop(Exception):
    """Raised by a stand-in: the build got this far."""


def _slow(fn=None, result=None, seconds=0.5):
    def slow(*a, **k):
        time.sleep(seconds)
        return fn(*a, **k) if fn is not None else result
    return slow


def test_every_phase_of_the_build_is_named_by_the_heartbeat(tmp_path, capsys, monkeypatch):
    """Each part of a run's build (data, model, compile and pre-flight, reward workers, weights) that runs
    past the interval gets a heartbeat line naming it (each made slow here by a stand-in)."""
    import ict_jax.train.parts as parts

    def no_weights(*a, **k):
        time.sleep(0.5)
        raise _Stop

    class Pool:
        def close(self):
            pass

    monkeypatch.setenv("ICT_JAX_HEARTBEAT_S", "0.1")
    monkeypatch.setattr(parts, "load_dataset", _slow(parts.load_dataset))
    monkeypatch.setattr(parts, "resolve_model", _slow(parts.resolve_model))
    monkeypatch.setattr(parts, "compile_and_check_gathering", _slow(lambda cfg, programs, *a, **k: (cfg, programs, None)))
    monkeypatch.setattr(parts, "make_reward_pool", _slow(result=Pool()))
    monkeypatch.setattr(parts, "_load_weights", no_weights)
    with pytest.raises(_Stop):
        main(["train", "--config", str(DEMO), "train.sft_steps=0", f"run_dir={tmp_path / 'run'}"])
    lines = capsys.readouterr().err.splitlines()
    for phase in ("loading the training data (split?digits=2&size=4000)", "resolving the model preset:demo",
                  "compiling the run's programs (the memory pre-flight)", "starting the reward workers",
                  "loading the weights of preset:demo"):
        assert any(line.startswith(f"ict-jax train: {phase}: still running, ") for line in lines), (phase, lines)
    assert not (tmp_path / "run").exists()  # nothing was written


def test_the_heartbeat_leaves_the_steps_to_the_run_and_covers_its_end(tmp_path, capsys, monkeypatch):
    """While the run trains, its own lines and heartbeat speak (the command's is silent); after the last
    step, the command's names the finishing phase."""
    import ict_jax.train.trainer as trainer_mod

    class Run:
        finished = None

        def __init__(self, cfg, *, tell, **kwargs):
            tell("building")
            time.sleep(0.5)

        def __enter__(self):
            return self

        def train(self):
            seen.append(capsys.readouterr().err)
            time.sleep(0.5)
            during = capsys.readouterr().err
            assert "ict-jax train: " not in during, during  # the command's heartbeat is silent while the run trains
            return {}

        def __exit__(self, *exc):
            time.sleep(0.5)

    monkeypatch.setenv("ICT_JAX_HEARTBEAT_S", "0.1")
    monkeypatch.setattr(trainer_mod, "Trainer", Run)
    seen: list[str] = []
    assert main(["train", "--config", str(DEMO), f"run_dir={tmp_path / 'run'}"]) == 0
    built = [line.split(": ")[1] for line in seen[0].splitlines() if line.startswith("ict-jax train: ")]
    ended = [line.split(": ")[1] for line in capsys.readouterr().err.splitlines() if line.startswith("ict-jax train: ")]
    assert len(built) >= 2 and set(built) == {"building"}, built
    assert len(ended) >= 2 and set(ended) == {"finishing (the last checkpoint, the summary and its plots)"}, ended
