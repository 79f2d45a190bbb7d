"""Checkpoints: bitwise save/restore of a trained TrainState, exact continuation, keep-K, restore onto
a mesh, atomicity (a leftover temporary save, a SIGKILL mid-save), export to Hugging Face, the CLI."""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import ict_jax
from ict_jax.config_load import load_config
from ict_jax.rl.batch import RolloutBatch
from ict_jax.rl.state import init_train_state
from ict_jax.rl.train_step import make_train_step
from ict_jax.train.checkpoints import Checkpointer, abstract_train_state
from ict_jax.train.model_source import resolve_model

P, G, LP, LR = 2, 4, 3, 5
MODEL = ict_jax.ModelConfig.tiny()


def _config():
    return load_config(None, [
        "rl.selector.method=ict", f"rollout.num_samples={G}", f"train.prompts_per_step={P}",
        f"rollout.max_new_tokens={LR}", "rl.selector.warmup_steps=0", "stats.chunk=4", "rl.loss.kl_coef=0",
        "optim.lr=0.001"])


def _batch() -> RolloutBatch:
    rng = np.random.default_rng(0)
    B = P * G
    am = np.ones((B, LP + LR), np.int32)
    rv = np.ones((B, LR), np.float32)
    for i, n in enumerate(rng.integers(2, LR + 1, B)):
        rv[i, n:] = 0
        am[i, LP + n:] = 0
    rewards = rng.integers(0, 2, B).astype(np.float32)
    return RolloutBatch(
        tokens=jnp.asarray(rng.integers(3, MODEL.vocab_size, (B, LP + LR)), jnp.int32),
        attention_mask=jnp.asarray(am), response_valid=jnp.asarray(rv), rewards=jnp.asarray(rewards),
        advantages=ict_jax.group_advantages(jnp.asarray(rewards), G),
        sampler_logp=jnp.asarray(-rng.random((B, LR)).astype(np.float32)), truncated=jnp.zeros(B),
        row_valid=jnp.ones(B), correct=jnp.asarray(rewards))


def _host(tree):
    return jax.tree.map(lambda a: np.array(jax.device_get(a)), tree)


def _assert_bitwise(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    assert len(la) == len(lb) > 0
    for x, y in zip(la, lb):
        x, y = np.asarray(jax.device_get(x)), np.asarray(jax.device_get(y))
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(x.reshape(-1).view(np.uint8), y.reshape(-1).view(np.uint8))


def _pytree(state):
    return (state.params, state.opt_state, state.step, state.rng)


@functools.lru_cache(maxsize=None)
def _trained():
    """(config, host copy of the state after one train step, the step function, a host copy of the state
    after a second step, its metrics) and a checkpoint dir with step 1 saved asynchronously, the saved
    state donated to the second step while the save ran."""
    import tempfile

    cfg = _config()
    step = make_train_step(cfg)
    state, _ = step(init_train_state(cfg, ict_jax.init_model(MODEL, seed=0)), _batch())
    saved = _host(_pytree(state))
    d = Path(tempfile.mkdtemp(prefix="ckpt_test_")) / "run" / "checkpoints"
    ckpt = Checkpointer(d, keep=3, async_save=True)
    meta = {"data": {"epoch": 0, "position": 7}, "config": cfg, "tokenizer": {"kind": "char"},
            "metrics": {"reward/mean": np.float32(0.5), "loss/total": float("nan")}}
    ckpt.save(1, state, meta)
    state2, metrics2 = step(state, _batch())  # donates the arrays being saved (where the backend can)
    for a in jax.tree.leaves(_pytree(state)):  # what save returned from is no longer needed
        if not a.is_deleted():
            a.delete()
    ckpt.wait()
    ckpt.close()
    return cfg, saved, step, _host(_pytree(state2)), _host(metrics2), d


def test_round_trip_is_bitwise_and_resume_continues_exactly():
    cfg, saved, step, after2, metrics2, d = _trained()
    with Checkpointer(d) as ckpt:
        assert ckpt.all_steps() == [1] and ckpt.latest_step() == 1
        template = abstract_train_state(cfg, MODEL)
        state, meta = ckpt.restore(template)
    _assert_bitwise(_pytree(state), saved)
    assert int(state.step) == 1 and state.graphdef is template.graphdef
    assert meta["data"] == {"epoch": 0, "position": 7} and meta["step"] == 1
    assert meta["config"] == cfg.to_dict() and meta["tokenizer"] == {"kind": "char"}
    assert meta["model_config"] == json.loads(json.dumps(MODEL.__dict__))
    assert meta["metrics"]["reward/mean"] == 0.5 and np.isnan(meta["metrics"]["loss/total"])
    for leaf, t in zip(jax.tree.leaves(_pytree(state)), jax.tree.leaves(_pytree(template))):
        assert leaf.sharding == t.sharding
    # the restored state continues exactly as the uninterrupted run (same executable, same numbers)
    state2, metrics = step(state, _batch())
    _assert_bitwise(_pytree(state2), after2)
    _assert_bitwise(metrics, metrics2)
    assert len(step.jitted) == 1


def test_restore_with_a_concrete_template_and_params_only():
    cfg, saved, _step, _a, _m, d = _trained()
    template = init_train_state(cfg, ict_jax.init_model(MODEL, seed=5))
    for a, c in zip(jax.tree.leaves(abstract_train_state(cfg, MODEL)), jax.tree.leaves(template), strict=True):
        assert (a.shape, a.dtype, a.sharding) == (c.shape, c.dtype, c.sharding)
    with Checkpointer(d, read_only=True) as ckpt:
        state, _ = ckpt.restore(template, step=1)
        assert ckpt.restore_meta(1)["data"]["position"] == 7
    _assert_bitwise(_pytree(state), saved)
    for where in (d.parent, d, d / "1"):  # run dir, its checkpoints folder, one step's dir
        source = resolve_model(where, checkpoint=True)
        model, meta = source.load(), source.meta
        assert meta["step"] == source.step == 1 and model.config == MODEL == source.config
        _assert_bitwise(nnx.state(model, nnx.Param), saved[0])


def test_restore_onto_an_eight_device_mesh(devices8):
    cfg, saved, _step, _a, _m, d = _trained()
    mesh = ict_jax.make_mesh(2, 2, 2)
    concrete = init_train_state(cfg, ict_jax.init_model(MODEL, seed=3, mesh=mesh))
    abstract = abstract_train_state(cfg, MODEL, mesh=mesh)  # what init_train_state would build, unallocated
    assert jax.tree.structure(abstract) == jax.tree.structure(concrete)
    for a, c in zip(jax.tree.leaves(abstract), jax.tree.leaves(concrete)):
        assert (a.shape, a.dtype, a.sharding) == (c.shape, c.dtype, c.sharding)
    for template in (abstract, concrete):
        with Checkpointer(d, read_only=True) as ckpt:
            state, _ = ckpt.restore(template)
        _assert_bitwise(_pytree(state), saved)
        sharded = 0
        for leaf, t in zip(jax.tree.leaves(_pytree(state)), jax.tree.leaves(_pytree(template))):
            assert leaf.sharding == t.sharding, (leaf.sharding, t.sharding)
            sharded += len(leaf.sharding.device_set) == 8 and not leaf.sharding.is_fully_replicated
        assert sharded >= 10  # the weights and Adam moments really are split over the mesh
    model = resolve_model(d, checkpoint=True).load(mesh=mesh)
    wq = model.layers.wq[...]
    assert wq.sharding == concrete.params["layers"]["wq"][...].sharding and not wq.sharding.is_fully_replicated


def _small_state(seed: int):
    cfg = _config()
    return cfg, init_train_state(cfg, ict_jax.init_model(MODEL.replace(num_layers=1), seed=seed))


def test_keep_last_k(tmp_path):
    _cfg, state = _small_state(0)
    with Checkpointer(tmp_path, keep=2) as ckpt:
        for s in (1, 2, 5, 9):
            ckpt.save(s, state, {"i": s})
        ckpt.wait()
        assert ckpt.all_steps() == [5, 9] and ckpt.latest_step() == 9
        assert ckpt.restore_meta()["i"] == 9 and ckpt.restore_meta(5)["i"] == 5
        with pytest.raises(FileNotFoundError, match="finished steps: 5, 9"):
            ckpt.restore_meta(2)
        with pytest.raises(FileExistsError, match="step 9 already exists"):
            ckpt.save(9, state, {})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["5", "9"]


def test_unfinished_save_is_ignored_and_cleaned(tmp_path):
    cfg, state = _small_state(0)
    with Checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.save(1, state, {"i": 1})
    # what a crash in the middle of saving step 3 leaves: orbax's temporary directory, part-written
    tmp = tmp_path / "3.orbax-checkpoint-tmp"
    (tmp / "params").mkdir(parents=True)
    (tmp / "params" / "partial").write_bytes(b"\0" * 100)
    template = abstract_train_state(cfg, MODEL.replace(num_layers=1))
    with Checkpointer(tmp_path, read_only=True) as ckpt:
        assert ckpt.latest_step() == 1 and ckpt.all_steps() == [1]
        restored, meta = ckpt.restore(template)
        with pytest.raises(FileNotFoundError, match="no finished checkpoint of step 3"):
            ckpt.restore(template, step=3)
    _assert_bitwise(_pytree(restored), _pytree(state))
    assert meta["i"] == 1 and tmp.exists()  # read-only touches nothing
    with Checkpointer(tmp_path) as ckpt:  # opened for writing: stale temporaries are removed
        ckpt.save(2, state, {"i": 2})
        ckpt.wait()
        assert ckpt.all_steps() == [1, 2] and not tmp.exists()


def test_empty_and_mismatched(tmp_path):
    cfg, state = _small_state(0)
    with Checkpointer(tmp_path / "c") as ckpt:
        assert ckpt.latest_step() is None and ckpt.all_steps() == []
        with pytest.raises(FileNotFoundError, match="no finished checkpoint"):
            ckpt.restore(state)
        ckpt.save(0, state, {})
        ckpt.wait()
        with pytest.raises(ValueError, match="does not fit the restore template.*params/embed/value has shape"):
            ckpt.restore(abstract_train_state(cfg, MODEL.replace(num_layers=1, hidden_size=32)))
        with pytest.raises(TypeError, match="not JSON-able"):
            ckpt.save(1, state, {"x": object()})
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Checkpointer(tmp_path / "missing", read_only=True)
    with pytest.raises(ValueError, match="keep"):
        Checkpointer(tmp_path / "k", keep=0)


_CHILD = r"""
import os, sys
# one device, and the test process's other XLA flags (tests/conftest.py: its optimisation level), so the
# child's random init has the bits of the `fresh` state the test builds in its own process
os.environ["XLA_FLAGS"] = " ".join([f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
                                   + ["--xla_force_host_platform_device_count=1"])
os.environ["JAX_PLATFORMS"] = "cpu"
import jax.numpy as jnp
import ict_jax
from ict_jax.train.checkpoints import Checkpointer
from ict_jax.config_load import load_config
from ict_jax.rl.state import init_train_state
cfg = load_config(None, [])
mc = ict_jax.ModelConfig.tiny(vocab_size=32768, hidden_size=256, intermediate_size=512, num_layers=2)
state = init_train_state(cfg, ict_jax.init_model(mc, seed=0))
ckpt = Checkpointer(sys.argv[1], keep=2, async_save=True)
ckpt.save(1, state.replace(step=jnp.int32(1)), {"model_config": mc})
ckpt.wait()
print("saved", flush=True)
for s in range(2, 10_000):
    ckpt.save(s, state.replace(step=jnp.int32(s)), {"model_config": mc})
"""


@pytest.mark.slow
def test_sigkill_during_a_save_leaves_the_previous_checkpoint_usable(tmp_path):
    d = tmp_path / "ckpt"
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(d)], stdout=subprocess.PIPE, env=env)
    try:
        assert proc.stdout.readline().strip() == b"saved"
        deadline = time.time() + 120
        while not any(".orbax-checkpoint-tmp" in p.name for p in d.iterdir()):
            assert time.time() < deadline and proc.poll() is None
            time.sleep(0.001)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    tmps = [p for p in d.iterdir() if ".orbax-checkpoint-tmp" in p.name]
    assert tmps, "the kill did not land in the middle of a save"
    unfinished = {int(p.name.split(".")[0]) for p in tmps}
    mc = ict_jax.ModelConfig.tiny(vocab_size=32768, hidden_size=256, intermediate_size=512, num_layers=2)
    cfg = load_config(None, [])
    with Checkpointer(d, read_only=True) as ckpt:
        latest = ckpt.latest_step()
        assert latest is not None and latest < min(unfinished)
        state, meta = ckpt.restore(abstract_train_state(cfg, mc))
    assert int(state.step) == latest == meta["step"]
    fresh = init_train_state(cfg, ict_jax.init_model(mc, seed=0))
    _assert_bitwise((state.params, state.opt_state, state.rng), (fresh.params, fresh.opt_state, fresh.rng))


@pytest.mark.torch
def test_export_reloads_in_transformers_with_the_same_logits(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg, saved, _step, _a, _m, d = _trained()
    out = ict_jax.export_checkpoint(d.parent, tmp_path / "hf")
    hf = transformers.Qwen2ForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    model = resolve_model(d, checkpoint=True).load()
    ids = np.random.default_rng(1).integers(0, MODEL.vocab_size, (2, 9))
    ours = np.asarray(model(jnp.asarray(ids)))
    with torch.no_grad():
        ref = hf(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)
    trained = np.asarray(saved[0]["embed"][...])
    np.testing.assert_array_equal(hf.model.embed_tokens.weight.detach().numpy(), trained)


def test_cli_export(tmp_path, capsys):
    from ict_jax.cli.main import main

    code = main(["export", "--checkpoint", str(tmp_path / "nope"), "--out", str(tmp_path / "hf")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "does not exist" in err and "Traceback" not in err
    assert not (tmp_path / "hf").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["export", "--checkpoint", str(empty), "--out", str(tmp_path / "hf")]) == 2
    assert "no finished checkpoint" in capsys.readouterr().err
    _cfg, saved, _step, _a, _m, d = _trained()
    args = ["export", "--checkpoint", str(d.parent), "--out", str(tmp_path / "hf"), "--dtype", "bfloat16"]
    assert main(args) == 0
    assert "exported step 1" in capsys.readouterr().out
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert written["torch_dtype"] == "bfloat16" and written["hidden_size"] == MODEL.hidden_size
    assert main(["export", "--checkpoint", str(d), "--out", str(tmp_path / "hf")]) == 2  # not over a written dir
    assert "not empty" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------
# A full disk. Orbax wrote ~380 lines of tracebacks and the failed background save
# surfaced at the next save, steps later. Now: one line naming the step, the reason, the checkpoint that
# is intact and a log with the details; at the first check after the failure; earlier checkpoints intact.
# ------------------------------------------------------------------------------------------------
class _FailingCommit:
    """A commit future whose background write fails as a full disk does."""

    def result(self, timeout=None):
        raise OSError(28, "No space left on device")


@pytest.fixture
def enospc_on_save(monkeypatch):
    """From now on every ``params`` write of orbax fails in the background with ENOSPC."""
    import orbax.checkpoint as ocp

    real = ocp.StandardCheckpointHandler.async_save

    async def failing(self, *args, **kwargs):
        futures = await real(self, *args, **kwargs) or []
        return [*futures, _FailingCommit()]

    def arm():
        monkeypatch.setattr(ocp.StandardCheckpointHandler, "async_save", failing)

    return arm


def test_a_failed_background_save_is_one_line_with_a_log_and_keeps_the_earlier_checkpoint(
        tmp_path, enospc_on_save, capfd):
    from ict_jax.train.checkpoint_errors import CheckpointWriteError

    state = init_train_state(_config(), ict_jax.init_model(MODEL, seed=3))
    before = _host(state.params)
    ckpt = Checkpointer(tmp_path / "run" / "checkpoints", keep=3)
    ckpt.save(1, state, {"step": 1})
    ckpt.wait()
    enospc_on_save()
    ckpt.save(2, state, {"step": 2})  # returns: the write fails in the background
    with pytest.raises(CheckpointWriteError) as err:
        deadline = time.monotonic() + 300  # a guard against a hang, not a timing: a loaded machine writes slowly
        while time.monotonic() < deadline:  # what the trainer does after every step; raises at the first call after
            ckpt.check()  # the failure
            time.sleep(0.05)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("the checkpoint of step 2 could not be written")
    assert "No space left on device" in msg and "the last finished checkpoint (step 1) is intact" in msg
    assert err.value.errno == 28 and isinstance(err.value, OSError)
    log = Path(err.value.log_path)
    assert log == tmp_path / "run" / "checkpoint_errors.log" and f"details in {log}" in msg
    assert "No space left on device" in log.read_text() and "Traceback" in log.read_text()
    printed = capfd.readouterr().err
    assert "Traceback" not in printed and "ERROR:absl" not in printed  # orbax's records went to the log
    ckpt.close()
    with Checkpointer(tmp_path / "run" / "checkpoints", read_only=True) as again:
        assert again.all_steps() == [1]
        restored, meta = again.restore(state)
    assert meta["step"] == 1
    _assert_bitwise(_host(restored.params), before)


def test_a_disk_without_room_for_the_next_checkpoint_is_refused_before_writing(tmp_path, monkeypatch):
    import shutil as sh

    from ict_jax.train.checkpoint_errors import CheckpointWriteError

    state = init_train_state(_config(), ict_jax.init_model(MODEL, seed=3))
    folder = tmp_path / "checkpoints"
    with Checkpointer(folder, keep=3) as ckpt:
        ckpt.save(1, state, {})
        ckpt.wait()
        real = sh.disk_usage
        monkeypatch.setattr(sh, "disk_usage", lambda p: real(p)._replace(free=1000))
        with pytest.raises(CheckpointWriteError, match=r"step 2 .*No space left on device \(0\.0 MiB free, about "
                                                       r"[0-9.]+ MiB needed; nothing was written\)"):
            ckpt.save(2, state, {})
        assert sorted(p.name for p in folder.iterdir()) == ["1"]  # not even a temporary folder


@pytest.mark.e2e
def test_the_command_line_prints_a_full_disk_as_one_line(tmp_path, enospc_on_save, capsys, monkeypatch):
    """The trainer stops at the first step after the failed save (not at the next save) and the command
    prints one line (exit 2); the earlier checkpoint stays."""
    from ict_jax.cli.main import main

    run = tmp_path / "run"
    args = ["train", "--config", str(Path(__file__).resolve().parents[2] / "configs" / "demo.yaml"),
            "model.preset=tiny", "rollout.num_samples=4", "train.prompts_per_step=4", "rollout.max_new_tokens=4",
            "rollout.max_prompt_len=8", "train.sft_steps=0", 'data.train=["arith?digits=1&size=16"]', "data.eval=[]",
            "stats.chunk=4", "rl.reward.workers=1", "train.steps=40", "train.save_every=2", f"run_dir={run}",
            "mesh.data=4", "mesh.tensor=2",
            "--no-progress"]
    from ict_jax.train import checkpoints as ck_module

    real_save = ck_module.Checkpointer.save

    def save(self, step, *a, **k):  # the disk fills up after the first checkpoint
        if step == 4:
            enospc_on_save()
        return real_save(self, step, *a, **k)

    monkeypatch.setattr(ck_module.Checkpointer, "save", save)
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("ict-jax train: error: the checkpoint of step 4 could not be written")
    assert "Traceback" not in "\n".join(err)
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert max(steps) < 39  # stopped right after the failure, not at the end of the run
    with Checkpointer(run / "checkpoints", read_only=True) as again:
        assert again.all_steps() == [2]


def test_tensorstores_event_loop_tracebacks_are_kept_out_of_the_console():
    """After a failed save, tensorstore prints "RuntimeError: Event loop is closed" tracebacks (from C,
    through sys.stderr) for the save's other writes. They go to the details log; everything else passes
    through unchanged and at once."""
    import io

    from ict_jax.train.checkpoint_errors import OrbaxLogCapture, QuietEventLoopTracebacks

    out = io.StringIO()
    capture = OrbaxLogCapture("/x")
    quiet = QuietEventLoopTracebacks(out, capture)
    quiet.write("rl 4/8  reward 0.1\n")
    assert out.getvalue() == "rl 4/8  reward 0.1\n"  # at once
    noise = ("Traceback (most recent call last):\n", '  File "base_events.py", line 806, in call_soon_threadsafe\n',
             "    self._check_closed()\n", "RuntimeError", ": ", "Event loop is closed", "\n")
    for piece in noise:  # as PyErr_Display writes it: in pieces
        quiet.write(piece)
    quiet.write("\rpartial bar")
    assert out.getvalue() == "rl 4/8  reward 0.1\n\rpartial bar"
    assert len(capture.records) == 1 and "Event loop is closed" in capture.records[0].getMessage()
    other = "Traceback (most recent call last):\n  File \"x.py\", line 1, in f\nValueError: a real error\n"
    quiet.write("before " + other + "after\n")
    assert out.getvalue().endswith("before " + other + "after\n")
    quiet.write("Traceback (most recent call last):\n  File")
    quiet.flush()  # held while it may still be being printed ...
    assert not out.getvalue().endswith("  File")
    quiet.remove()  # ... but an unfinished traceback is not swallowed
    assert out.getvalue().endswith("Traceback (most recent call last):\n  File")


def test_event_loop_tracebacks_of_two_threads_at_once_are_kept_out_too():
    import io
    import threading

    from ict_jax.train.checkpoint_errors import OrbaxLogCapture, QuietEventLoopTracebacks

    out = io.StringIO()
    quiet = QuietEventLoopTracebacks(out, OrbaxLogCapture("/x"))
    lines = ["Traceback (most recent call last):\n", '  File "base_events.py", line 806, in call_soon_threadsafe\n',
             "    self._check_closed()\n", "RuntimeError: Event loop is closed\n"]
    barrier = threading.Barrier(2)

    def printer():
        for line in lines:  # the two threads' lines interleave
            barrier.wait()
            quiet.write(line)

    threads = [threading.Thread(target=printer) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert out.getvalue() == "" and len(quiet.capture.records) == 2
