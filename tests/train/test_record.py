"""A run's record is never lost or mislabelled (summary sections, config on resume, one row per
step, SFT checkpoints and resume), and the logs a person reads (compact lines, the before/after table,
TensorBoard tags and steps, W&B).

The default suite checks the pieces without training (the resume rules on a recorded run directory,
metrics truncation, the table, the lines); the runs themselves (tiny models trained in this process
through the command line, and the SIGINT + bitwise SFT resume in subprocesses) are `slow`."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from ict_jax.cli.main import main as cli_main
from ict_jax.train.logs import read_metrics, summary_table, truncate_metrics
from ict_jax.train.record import read_resumes

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "configs" / "demo.yaml"
BENCH = "split?digits=1&size=4&seed=5"
EVAL_METRICS = ("pass@1", "pass@2", "no_answer_frac", "truncated_frac")  # per benchmark, at every evaluation
TINY = ["model.preset=tiny", "rollout.num_samples=4", "train.prompts_per_step=4", "rollout.max_new_tokens=6",
        "rollout.max_prompt_len=16", "train.sft_steps=3", "train.sft_batch_size=8", "rl.selector.warmup_steps=1",
        "data.train=[\"arith?digits=1&size=64\"]", f"data.eval=[\"{BENCH}\"]", "data.eval_n=2", "data.eval_k=[1,2]",
        "stats.chunk=8", "rl.reward.workers=1", "optim.lr_warmup_steps=0", "train.save_every=1",
        "rl.loss.kl_coef=0.01"]
MESH = ["mesh.data=-1", "mesh.tensor=2"]  # 4 x 1 x 2 on the 8 test devices (subprocesses have one device)


def run_cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()  # not a terminal: compact lines, no bar
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli_main(list(args))
    return rc, out.getvalue(), err.getvalue()


def train(run: Path, *extra: str) -> tuple[int, str, str]:
    return run_cli("train", "--config", str(DEMO), *TINY, *MESH, f"run_dir={run}", *extra)


def snapshot(run: Path) -> dict[str, bytes]:
    """Every file of a run directory but the hold's lock file (the Trainer holds the directory, docs/checkpoints.md)."""
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file() and p.name != ".lock"}


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished tiny run: 3 SFT steps, eval after SFT, 2 RL steps, final eval; and its console output."""
    run = tmp_path_factory.mktemp("record") / "run"
    rc, out, err = train(run, "train.steps=2")
    assert rc == 0, err
    return run, out, err


# ------------------------------------------------------------------------------------------------
# What a person reads; the summary's sections
# ------------------------------------------------------------------------------------------------
_HEARTBEAT = re.compile(r"^ict-jax train: .*: still running, .* so far \(.* in all\)$")


@pytest.mark.slow
def test_non_tty_output_is_compact_and_ends_with_the_before_after_table(finished):
    run, out, err = finished
    # the heartbeat's "still running" lines come whenever a phase passes its interval (a loaded machine: even
    # before the header, while the weights load); what is checked here is every other line
    lines = [ln for ln in err.splitlines() if not _HEARTBEAT.match(ln)]
    assert lines[0].startswith(f"run {run}: SFT 3 steps, then 2 RL steps (ict)")
    assert any(ln.startswith("sft 3/3  loss ") for ln in lines)
    assert any(ln.startswith("rl 2/2  reward ") and " acc " in ln and " H1 " in ln and " sel " in ln
               and " tok/s" in ln for ln in lines)
    assert any(ln.startswith("sft 2/3 ") and "ETA " in ln for ln in lines)  # no ETA at the first step (compile)
    assert any(ln.startswith("eval after SFT: split P@1 ") for ln in lines)
    assert "{" not in out  # no JSON dump on the console: it is in summary.json
    summary = json.loads((run / "summary.json").read_text())
    table = summary_table(summary)
    assert out.rstrip("\n").splitlines()[-3:-1] == table.splitlines()
    assert table.splitlines()[0].split()[:3] == ["benchmark", "P@1", "after"]
    before, after = summary["eval_after_sft"][f"eval/{BENCH}/pass@1"], summary["eval_final"][f"eval/{BENCH}/pass@1"]
    assert table.splitlines()[1].split()[:4] == ["split", f"{before:.3f}", f"{after:.3f}", f"{after - before:+.3f}"]
    assert len(out.splitlines()) + len(lines) <= 24  # one screen


@pytest.mark.slow
def test_summary_sections_and_status(finished):
    run, _, _ = finished
    s = json.loads((run / "summary.json").read_text())
    assert s["status"] == "finished" and s["steps"] == 2 and s["resumes"] == []
    assert set(s["sft"]) == {"sft/loss", "sft/tokens", "sft/grad_norm"}
    assert set(s["eval_after_sft"]) == set(s["eval_final"]) == {f"eval/{BENCH}/{m}" for m in EVAL_METRICS}
    assert s["final"]["reward/mean"] == read_metrics(run / "metrics.jsonl")[-1]["reward/mean"]


def _tb_events(directory: Path) -> list:
    """Every Event of the TensorBoard files in ``directory`` (the TFRecord framing read by hand)."""
    from tensorboardX.proto.event_pb2 import Event

    events = []
    for f in sorted(directory.glob("events.out.tfevents.*")):
        data = f.read_bytes()
        i = 0
        while i < len(data):
            (n,) = struct.unpack("<Q", data[i:i + 8])
            ev = Event()
            ev.ParseFromString(data[i + 12:i + 12 + n])
            events.append(ev)
            i += 12 + n + 4
    return events


def _tb_scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list] = {}
    for ev in _tb_events(directory):
        for v in ev.summary.value:
            out.setdefault(v.tag, []).append((ev.step, v.simple_value))
    return out


@pytest.mark.slow
def test_tensorboard_has_sft_and_every_evaluation_with_single_tags_at_the_right_steps(finished):
    run, _, _ = finished
    sft, rl, ev = (_tb_scalars(run / "tb" / p) for p in ("sft", "rl", "eval"))
    assert [s for s, _ in sft["sft/loss"]] == [0, 1, 2]
    assert [s for s, _ in rl["reward/mean"]] == [0, 1]
    from tensorboardX.summary import _clean_tag  # TensorBoard's tag alphabet: "?", "=", "&", "@" become "_"

    name = f"eval/{BENCH}/pass@1"
    tag = _clean_tag(name)
    assert set(ev) == {_clean_tag(f"eval/{BENCH}/{m}") for m in EVAL_METRICS}  # the names: no eval/eval/...
    assert not any(t.startswith("eval/eval/") or t.startswith("sft/sft/") for t in [*sft, *rl, *ev])
    summary = json.loads((run / "summary.json").read_text())
    # after SFT at step 0, the end at step 2 (= rollout batches done): not one step early
    assert ev[tag] == [(0, pytest.approx(summary["eval_after_sft"][name])),
                       (2, pytest.approx(summary["eval_final"][name]))]
    rows = read_metrics(run / "metrics.jsonl", "eval")
    assert [r["step"] for r in rows] == [0, 2]


@pytest.mark.slow
def test_metrics_png_has_the_eval_curve_and_smoothed_panels(finished):
    from ict_jax.train.logs import metric_curves, moving_average

    run, _, _ = finished
    assert (run / "metrics.png").is_file()
    curves = metric_curves(read_metrics(run / "metrics.jsonl"), read_metrics(run / "metrics.jsonl", "eval"))
    assert [c.title for c in curves][-1] == "P@1 split" and curves[-1].steps == [0, 2] and curves[-1].smooth is None
    assert curves[0].title == "reward/mean" and len(curves[0].smooth) == len(curves[0].raw)
    # the moving average against float64 NumPy
    x = np.random.default_rng(0).normal(size=50)
    want = np.array([x[max(0, i - 4):i + 1].mean() for i in range(50)])
    np.testing.assert_allclose(moving_average(x, 5), want, rtol=1e-12)


# ------------------------------------------------------------------------------------------------
# Resume of a finished run, with changed settings, of a missing directory
# ------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_resume_of_a_finished_run_is_a_no_op(finished):
    run, _, _ = finished
    before = snapshot(run)
    rc, out, err = train(run, "train.steps=2", "--resume")
    assert rc == 0 and out == "" and err.strip().splitlines() == [
        f"{run}: finished at step 2; nothing to do (raise train.steps to train it further)"]
    assert snapshot(run) == before  # summary, config, metrics: untouched


@pytest.mark.slow
@pytest.mark.parametrize("override,keys", [
    ("rl.selector.method=grpo", "rl.selector.method ('ict' -> 'grpo')"),
    ("optim.lr=0.001", "optim.lr (0.0002 -> 0.001)"),
    ("train.steps=1", "train.steps (only upward)"),
])
def test_resume_refuses_settings_that_change_the_trajectory(finished, override, keys):
    run, _, _ = finished
    before = snapshot(run)
    rc, out, err = train(run, "train.steps=2", override, "--resume")
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"ict-jax train: error: --resume: {keys}") and "would change how the run trains" in err
    assert snapshot(run) == before  # config.json still says what trained


@pytest.mark.slow
def test_resume_with_more_steps_keeps_every_section_and_records_the_resume(finished, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(finished[0], run)
    first = json.loads((run / "summary.json").read_text())
    rc, _, err = train(run, "train.steps=3", "train.eval_every=3", "logging.print_every=1", "--resume")
    assert rc == 0, err
    s = json.loads((run / "summary.json").read_text())
    assert s["status"] == "finished" and s["steps"] == 3
    assert s["sft"] == first["sft"] and s["eval_after_sft"] == first["eval_after_sft"]  # kept
    assert s["earlier"] == [{"final": first["final"], "eval_final": first["eval_final"], "steps": 2}]
    assert [r["changes"] for r in s["resumes"]] == [{"train.eval_every": [0, 3], "train.steps": [2, 3],
                                                     "logging.print_every": [None, 1]}]
    assert s["resumes"][0]["phase"] == "rl" and s["resumes"][0]["step"] == 2
    assert json.loads((run / "config.json").read_text())["train"]["steps"] == 3
    assert "resuming RL at step 2/3" in err


@pytest.mark.slow
def test_resumed_run_has_one_row_per_step(finished, tmp_path):
    """A crash after a step was logged but before its checkpoint: the resumed run logs the step again,
    and metrics.jsonl keeps one row of it (the new one)."""
    run = tmp_path / "run"
    shutil.copytree(finished[0], run)
    shutil.rmtree(run / "checkpoints" / "2")
    (run / "summary.json").write_text(json.dumps({**json.loads((run / "summary.json").read_text()),
                                                  "status": "running"}))
    rows_before = (run / "metrics.jsonl").read_text().splitlines()
    rc, _, err = train(run, "train.steps=2", "--resume")
    assert rc == 0, err
    keys = [(r["phase"], r["step"]) for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())]
    assert len(keys) == len(set(keys)) == len(rows_before)
    assert sorted(keys) == sorted([("sft", 0), ("sft", 1), ("sft", 2), ("eval", 0), ("rl", 0), ("rl", 1), ("eval", 2)])
    # TensorBoard: the resumed writers hide what is logged again (a purge at the resumed step)
    purges = [ev.step for ev in _tb_events(run / "tb" / "rl") if ev.HasField("session_log")]
    assert 1 in purges


def test_truncate_metrics_keeps_the_rows_below_each_phase_limit(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [("sft", 0), ("sft", 1), ("eval", 0), ("rl", 0), ("rl", 1), ("rl", 2), ("rl", 1), ("eval", 2)]
    path.write_text("".join(json.dumps({"step": s, "phase": p, "x": i}) + "\n" for i, (p, s) in enumerate(rows)))
    dropped = truncate_metrics(path, {"rl": 2, "eval": 1})
    kept = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["phase"], r["step"], r["x"]) for r in kept] == [("sft", 0, 0), ("sft", 1, 1), ("eval", 0, 2),
                                                               ("rl", 0, 3), ("rl", 1, 6)]
    assert dropped == 3


# ------------------------------------------------------------------------------------------------
# SFT checkpoints; `ict-jax sft --resume`; `train --resume` continues SFT, then RL
# ------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_sft_saves_checkpoints_and_sft_resume_continues(tmp_path):
    from ict_jax.train.trainer import Trainer

    run = tmp_path / "run"
    rc, _, err = run_cli("sft", "--config", str(DEMO), *TINY, *MESH, "train.sft_steps=4", "train.sft_save_every=2",
                         f"run_dir={run}", "data.eval=[]")
    assert rc == 0, err
    assert (run / "sft_model" / "config.json").is_file() and not (run / "checkpoints_sft").exists()
    s = json.loads((run / "summary.json").read_text())
    assert s["status"] == "sft finished" and "sft/loss" in s["sft"]
    rc, _, err = run_cli("sft", "--config", str(DEMO), *TINY, *MESH, "train.sft_steps=4", f"run_dir={run}",
                         "data.eval=[]", "--resume")
    assert rc == 0 and "the SFT warm start is finished" in err
    rc, _, err = run_cli("sft", "--config", str(DEMO), *TINY, *MESH, f"run_dir={run}")
    assert rc == 2 and "pass --resume" in err  # the flag the message suggests exists
    # an interrupted SFT (a checkpoint at step 2 of 4, no sft_model): `train --resume` continues it, then RL
    cut = tmp_path / "cut"
    from ict_jax.config_load import load_config

    cfg = load_config(DEMO, TINY + MESH + ["train.sft_steps=4", "train.sft_save_every=2", f"run_dir={cut}", "data.eval=[]",
                                    "train.steps=1"])
    with Trainer(cfg, progress=False) as t:
        real = t.logger

        def stop_at_3(phase, total, initial=0):  # the SFT loop stops (as on Ctrl-C) after its 3rd step
            lg = real(phase, total, initial)
            log = lg.log

            def logged(step, metrics, **kw):
                log(step, metrics, **kw)
                if kw.get("phase") == "sft" and step == 2:
                    raise KeyboardInterrupt
            lg.log = logged
            return lg
        t.logger = stop_at_3
        with pytest.raises(KeyboardInterrupt):
            t.sft()
    assert sorted(os.listdir(cut / "checkpoints_sft")) == ["2"] and not (cut / "sft_model").exists()
    rc, _, err = train(cut, "train.sft_steps=4", "train.sft_save_every=2", "data.eval=[]", "train.steps=1", "--resume")
    assert rc == 0, err
    assert "resuming the SFT warm start at step 2/4" in err
    sft_rows = read_metrics(cut / "metrics.jsonl", "sft")
    assert [r["step"] for r in sft_rows] == [0, 1, 2, 3]
    assert [r["step"] for r in read_metrics(cut / "metrics.jsonl")] == [0]
    # bitwise: the resumed warm start equals an uninterrupted one (same seed, same data order)
    full = tmp_path / "full"
    rc, _, err = run_cli("sft", "--config", str(DEMO), *TINY, *MESH, "train.sft_steps=4", f"run_dir={full}", "data.eval=[]")
    assert rc == 0, err
    from safetensors.numpy import load_file

    a, b = load_file(full / "sft_model" / "model.safetensors"), load_file(cut / "sft_model" / "model.safetensors")
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    full_rows = read_metrics(full / "metrics.jsonl", "sft")
    assert [r["sft/loss"] for r in full_rows] == [r["sft/loss"] for r in sft_rows]


def _cli_proc(run: Path, *extra: str) -> subprocess.Popen:
    # XLA's defaults: the LoRA case's tiny random model gives RL groups of unequal rewards with them (the
    # tests' compile flags sample other tokens, and its adapters' update was then zero)
    env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu")
    args = [sys.executable, "-m", "ict_jax.cli", "train", "--config", str(DEMO), *TINY, "data.eval=[]",
            "train.sft_steps=8", "train.sft_save_every=3", "train.steps=3", f"run_dir={run}", *extra]
    return subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_ctrl_c_during_sft_then_resume_is_bitwise_identical(tmp_path, lora):
    """Ctrl-C (SIGINT) during SFT saves an SFT checkpoint (exit 130); `train --resume` continues SFT and
    then RL, and the final RL checkpoint and every logged row equal an uninterrupted run's. With LoRA
    the SFT checkpoints hold the adapters on the preset base, then RL trains fresh adapters
    on the merged warm start."""
    from flax import nnx

    from ict_jax.train.model_source import resolve_model

    full, cut = tmp_path / "full", tmp_path / "cut"
    # with LoRA a format penalty gives the random model's RL groups nonzero advantages, so RL moves the fresh
    # adapters (all-zero rewards would leave their B = 0 and the RL half of the check empty)
    extra = ["model.lora.enabled=true", "model.lora.rank=4", "model.lora.alpha=8", "rl.reward.no_answer=-1"] if lora else []
    p = _cli_proc(full, *extra)
    out, _ = p.communicate(timeout=900)
    assert p.returncode == 0, out
    p = _cli_proc(cut, *extra)
    deadline = time.time() + 900
    while time.time() < deadline and p.poll() is None:
        try:
            n = sum('"phase": "sft"' in line for line in open(cut / "metrics.jsonl"))
        except FileNotFoundError:
            n = 0
        if n >= 4:
            p.send_signal(signal.SIGINT)
            break
        time.sleep(0.1)
    out, _ = p.communicate(timeout=900)
    assert p.returncode == 130, out
    assert "continue with --resume" in out and not (cut / "sft_model").exists()
    saved = sorted(int(d) for d in os.listdir(cut / "checkpoints_sft"))
    assert saved and 4 <= saved[-1] < 8  # saved at the step where Ctrl-C stopped it
    p = _cli_proc(cut, "--resume", *extra)
    out, _ = p.communicate(timeout=900)
    assert p.returncode == 0, out
    ma, mb = ((s.load(), s.meta) for s in (resolve_model(r / "checkpoints", checkpoint=True) for r in (full, cut)))
    assert ma[1]["step"] == mb[1]["step"] == 3
    for x, y in zip(jax.tree.leaves(nnx.state(ma[0], nnx.Param)), jax.tree.leaves(nnx.state(mb[0], nnx.Param))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    if lora:  # RL trained the fresh adapters on the merged warm start
        b = [np.asarray(x) for k, x in jax.tree_util.tree_flatten_with_path(nnx.state(ma[0], nnx.LoRAParam))[0]
             if "lora_b" in str(k)]
        assert b and all(np.abs(x).max() > 0 for x in b)
    keep = lambda r: {k: v for k, v in r.items() if not k.startswith(("time/", "throughput/"))}  # noqa: E731
    ra, rb = read_metrics(full / "metrics.jsonl", None), read_metrics(cut / "metrics.jsonl", None)
    assert [(r["phase"], r["step"]) for r in ra] == [(r["phase"], r["step"]) for r in rb]
    assert [keep(r) for r in ra] == [keep(r) for r in rb]
    lines = (cut / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == len({(json.loads(x)["phase"], json.loads(x)["step"]) for x in lines})


# ------------------------------------------------------------------------------------------------
# A custom reward in the trainer: rl.reward.fn scores every training response, in the workers
# ------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_training_with_a_custom_reward_function_and_a_file_task(tmp_path, monkeypatch):
    (tmp_path / "t17_reward.py").write_text(
        "import os\n"
        "def score(response, gold, meta):\n"
        "    open(os.path.join(meta['out'], f'pid_{os.getpid()}'), 'a').write(repr(response) + '\\n')\n"
        "    return 1.0 if response.startswith(meta['lead']) else 0.0\n")
    rows = [{"q": f"{i}+1=", "a": str(i + 1), "lead": str(i)[0], "out": str(tmp_path)} for i in range(8)]
    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    rc, _, err = run_cli("train", "--config", str(DEMO), *TINY, *MESH, "train.sft_steps=0", "data.eval=[]", "train.steps=1",
                         "data.train=[\"file:tasks.jsonl?prompt=q&answer=a&reward=custom\"]",
                         "rl.reward.fn=t17_reward:score", f"run_dir={run}")
    assert rc == 0, err
    pids = {int(p.name[4:]) for p in tmp_path.glob("pid_*")}
    assert pids and os.getpid() not in pids and "t17_reward" not in sys.modules
    scored = sum(len(p.read_text().splitlines()) for p in tmp_path.glob("pid_*"))
    assert scored == 4 * 4  # P x G responses, each scored by the function
    # the function's name must resolve in the workers before anything is written
    rc, _, err = run_cli("train", "--config", str(DEMO), *TINY, *MESH, "train.sft_steps=0", "data.eval=[]",
                         "rl.reward.fn=t17_reward:nope", f"run_dir={tmp_path / 'r2'}")
    assert rc == 2 and "has no function 'nope'" in err and not (tmp_path / "r2").exists()
    rc, _, err = run_cli("train", "--config", str(DEMO), *TINY, *MESH, "train.sft_steps=0", "data.eval=[]",
                         "data.train=[\"file:tasks.jsonl?prompt=q&answer=a&reward=custom\"]", f"run_dir={tmp_path / 'r3'}")
    assert rc == 2 and "rl.reward.fn is not set" in err


# ------------------------------------------------------------------------------------------------
# Weights & Biases, offline (no network), the same metric names as metrics.jsonl
# ------------------------------------------------------------------------------------------------
def _wandb_history(run_file: Path) -> list[dict]:
    """The history rows of a W&B offline run file (its LevelDB-log framing read by hand)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = run_file.read_bytes()
    assert data[:4] == b":W&B"
    i, block, records, pending = 7, 32768, [], b""
    while i + 7 <= len(data):
        left = block - (i % block)
        if left < 7:
            i += left
            continue
        length, kind = struct.unpack("<H", data[i + 4:i + 6])[0], data[i + 6]
        chunk = data[i + 7:i + 7 + length]
        i += 7 + length
        if kind == 0 and length == 0:
            continue
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            records.append(pending)
            pending = b""
    rows = []
    for raw in records:
        r = pb.Record()
        r.ParseFromString(raw)
        if r.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item})
    return rows


@pytest.mark.slow
def test_wandb_offline_logs_the_same_metric_names(finished, tmp_path, monkeypatch):
    pytest.importorskip("wandb")  # the optional extra; the test extra installs it
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")
    run = tmp_path / "run"
    shutil.copytree(finished[0], run)
    rc, _, err = train(run, "train.steps=3", "logging.wandb=true", "--resume")
    assert rc == 0, err
    files = list((run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1 and (run / "wandb_id").read_text().strip() in files[0].name
    history = _wandb_history(files[0])
    logged = read_metrics(run / "metrics.jsonl", None)
    rl_row = next(r for r in logged if r["phase"] == "rl" and r["step"] == 2)
    wb_row = next(h for h in history if h.get("rl/step") == 2)
    names = {k for k in rl_row if k not in ("step", "phase")}
    assert names <= set(wb_row)
    assert all(wb_row[k] == pytest.approx(rl_row[k]) for k in names if isinstance(rl_row[k], float))
    ev = next(h for h in history if "eval/step" in h)
    assert ev["eval/step"] == 3 and f"eval/{BENCH}/pass@1" in ev


def test_wandb_missing_is_a_one_line_error(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_wandb(name, *a, **k):
        if name == "wandb":
            raise ImportError("no wandb")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    rc, _, err = train(tmp_path / "r", "logging.wandb=true")
    assert rc == 2 and "pip install -e '.[wandb]' in the ict_jax checkout" in err and not (tmp_path / "r").exists()


# ------------------------------------------------------------------------------------------------
# The same rules without training (default suite)
# ------------------------------------------------------------------------------------------------
def _recorded_run(tmp_path: Path, *overrides: str) -> tuple[Path, list[str]]:
    """A run directory as a finished run leaves it (config, summary, metrics), without weights."""
    from ict_jax.config_load import load_config

    run = tmp_path / "run"
    args = [*TINY, *MESH, "train.steps=2", f"run_dir={run}", *overrides]
    cfg = load_config(DEMO, args)
    run.mkdir()
    (run / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
    (run / "summary.json").write_text(json.dumps({"status": "finished", "steps": 2, "sft": {"sft/loss": 1.0},
                                                  "eval_after_sft": {}, "final": {"reward/mean": 0.5}}))
    (run / "metrics.jsonl").write_text(json.dumps({"step": 0, "phase": "rl", "reward/mean": 0.5}) + "\n")
    return run, args


def test_resume_alone_continues_the_run_from_its_recorded_config(tmp_path):
    """`ict-jax train --resume run_dir=R` (no --config) continues R from its config.json: only the overrides
    on that command line count as changes, checked by the resume rules; with --config C as well, C's
    values count too, as before."""
    run, _ = _recorded_run(tmp_path)
    before = snapshot(run)
    rc, out, err = run_cli("train", "--resume", f"run_dir={run}")
    assert (rc, out) == (0, "") and err.strip() == f"{run}: finished at step 2; nothing to do (raise train.steps to train it further)"
    rc, _, err = run_cli("train", "--resume", f"run_dir={run}", "rl.selector.method=grpo")
    assert rc == 2 and err.startswith("ict-jax train: error: --resume: rl.selector.method ('ict' -> 'grpo') would "
                                      "change how the run trains; a resumed run keeps those settings"), err
    rc, out, err = run_cli("train", "--resume", f"run_dir={run}", "train.eval_every=7", "--print-config")
    import yaml

    printed = yaml.safe_load(out)
    assert rc == 0 and printed["train"]["eval_every"] == 7 and printed["model"]["preset"] == "tiny"
    assert printed["rollout"]["max_new_tokens"] == 6 and printed["run_dir"] == str(run)
    rc, _, err = run_cli("sft", "--resume", f"run_dir={run}", "--print-config")
    assert rc == 0
    # --config as well: the config file's values are changes too (the demo's model and lengths here)
    rc, _, err = run_cli("train", "--config", str(DEMO), "--resume", f"run_dir={run}")
    assert rc == 2 and "would change how the run trains" in err and "model.preset ('tiny' -> 'demo')" in err, err
    # what a config-less command needs
    rc, _, err = run_cli("train", "--resume", "train.steps=3")
    assert rc == 2 and err.strip() == "ict-jax train: error: --resume without --config: name the run to continue with run_dir=DIR"
    rc, _, err = run_cli("train", f"run_dir={run}")
    assert rc == 2 and "--config is required (only --resume may leave it out" in err
    rc, _, err = run_cli("train", "--resume", f"run_dir={tmp_path / 'none'}")
    assert rc == 2 and "config.json' does not exist: no run is recorded in run_dir" in err
    assert snapshot(run) == before


@pytest.mark.e2e  # two short trainings (~1 min on 2 cores)
def test_resume_alone_trains_on_from_the_recorded_config(tmp_path):
    run = tmp_path / "run"
    rc, _, err = train(run, "train.steps=1", "train.sft_steps=0", "data.eval=[]")
    assert rc == 0, err
    rc, _, err = run_cli("train", "--resume", f"run_dir={run}", "train.steps=2", "--no-progress")
    assert rc == 0, err
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl", "rl")] == [0, 1]
    assert read_resumes(run)[-1]["changes"] == {"train.steps": [1, 2]}


def test_finished_run_resumed_is_a_no_op_and_changes_are_refused_first(tmp_path):
    run, args = _recorded_run(tmp_path)
    before = snapshot(run)
    rc, out, err = run_cli("train", "--config", str(DEMO), *args, "--resume")
    assert (rc, out) == (0, "") and err.strip() == f"{run}: finished at step 2; nothing to do (raise train.steps to train it further)"
    rc, _, err = run_cli("train", "--config", str(DEMO), *args, "rl.selector.method=grpo", "--resume")
    assert rc == 2 and err.strip() == (
        "ict-jax train: error: --resume: rl.selector.method ('ict' -> 'grpo') would change how the run trains; a "
        "resumed run keeps those settings (may change: train.eval_every, train.save_every, train.keep, "
        "train.sft_save_every, train.memory_check, rl.reward.workers, rollout.min_response_bucket, "
        "rollout.gather_weights, data.eval_batch, logging.*, train.steps upward). Start a new run_dir for other settings")
    rc, _, err = run_cli("train", "--config", str(DEMO), *args, "train.steps=1", "--resume")
    assert rc == 2 and "train.steps (only upward)" in err
    assert snapshot(run) == before


def test_check_resume_allows_only_what_cannot_change_the_trajectory():
    from ict_jax.config import ConfigError
    from ict_jax.config_load import load_config
    from ict_jax.train.record import check_resume

    old = load_config(DEMO, ["optim.lr_warmup_steps=0"])
    ok = old.replace(**{"train.steps": 900, "train.eval_every": 5, "train.save_every": 7, "train.keep": 1,
                        "train.sft_save_every": 3, "rl.reward.workers": 4, "logging.print_every": 9,
                        "logging.wandb": True, "run_dir": "/elsewhere/demo", "rollout.min_response_bucket": 64,
                        "rollout.gather_weights": True})
    changes = check_resume(old, ok)
    assert changes["train.steps"] == (400, 900) and set(changes) == {
        "train.steps", "train.eval_every", "train.save_every", "train.keep", "train.sft_save_every",
        "rl.reward.workers", "logging.print_every", "logging.wandb", "run_dir", "rollout.min_response_bucket",
        "rollout.gather_weights"}
    for key, value in [("rl.selector.method", "grpo"), ("seed", 1), ("mesh.tensor", 2), ("train.sft_steps", 10),
                       ("data.train", ("arith",)), ("rl.reward.time_limit", 1.0), ("stats.chunk", 3),
                       ("rl.reward.fn", "a:b"), ("train.steps", 10)]:
        with pytest.raises(ConfigError, match=f"--resume: {key.replace('.', '[.]')}"):
            check_resume(old, old.replace(**{key: value}))
    cosine = load_config(DEMO, ["optim.schedule=cosine"])
    with pytest.raises(ConfigError, match="cosine learning-rate schedule depends on it"):
        check_resume(cosine, cosine.replace(**{"train.steps": 800}))
    warm = load_config(DEMO, ["optim.lr_warmup_steps=50", "train.steps=10"])
    with pytest.raises(ConfigError, match="lr_warmup_steps=50, is longer than the 10 updates"):
        check_resume(warm, warm.replace(**{"train.steps": 20}))


def test_resume_of_a_missing_run_dir_writes_nothing(tmp_path):
    rc, _, err = train(tmp_path / "nope", "--resume")
    assert rc == 2 and err.strip() == (f"ict-jax train: error: --resume: run_dir '{tmp_path / 'nope'}' does not exist, "
                                       "so there is nothing to resume (drop --resume to start a new run there)")
    assert not (tmp_path / "nope").exists()


def test_resume_point_of_each_phase(tmp_path):
    from ict_jax.config_load import load_config
    from ict_jax.train.resume import resume_point

    cfg = load_config(DEMO, ["train.sft_steps=10"])
    run = tmp_path / "r"
    run.mkdir()
    assert resume_point(cfg, run, None).keep_below == {"sft": 0, "rl": 0, "eval": 0}  # nothing: from the start
    assert resume_point(cfg, run, 7) == type(resume_point(cfg, run, 7))("rl", 7, {"rl": 7, "eval": 8})
    (run / "sft_model").mkdir()
    p = resume_point(cfg, run, None)
    assert (p.phase, p.step, p.keep_below) == ("rl", 0, {"rl": 0, "eval": 0})
    (run / "summary.json").write_text(json.dumps({"eval_after_sft": {"eval/x/pass@1": 0.5}}))
    assert resume_point(cfg, run, None).keep_below == {"rl": 0, "eval": 1}  # the recorded eval after SFT stays


def test_compact_lines_and_the_table():
    from ict_jax.train.logs import compact_line, format_eval, short_benchmark_name

    m = {"reward/mean": 0.4123, "reward/accuracy": 0.398, "stats/H1_mean": 1.2305, "mask/selected_frac": 0.1,
         "throughput/tokens_per_s": 2460.4, "loss/policy": 0.0}
    assert compact_line("rl", 40, 400, m, 192.0) == \
        "rl 40/400  reward 0.412  acc 0.398  H1 1.230  sel 0.100  2460 tok/s  ETA 3m12s"
    assert compact_line("sft", 5, 5, {"sft/loss": 1.23456}, 0.0) == "sft 5/5  loss 1.2346"
    ev = {"eval/split?digits=2&size=256&seed=12345/pass@1": 0.289, "eval/split?digits=2&size=256&seed=12345/pass@4": 0.684}
    assert format_eval(ev) == "split P@1 0.289  P@4 0.684"
    summary = {"sft": {"sft/loss": 1.0}, "eval_after_sft": ev,
               "eval_final": {"eval/split?digits=2&size=256&seed=12345/pass@1": 0.526,
                              "eval/split?digits=2&size=256&seed=12345/pass@4": 0.883}}
    assert summary_table(summary).splitlines() == [
        "benchmark    P@1 after SFT  final  change    P@4 after SFT  final  change",
        "split                0.289  0.526  +0.237            0.684  0.883  +0.199"]
    assert summary_table({"eval_final": {}}) == ""
    assert short_benchmark_name("gym:chain_sum?size=5", ["gym:chain_sum?size=5", "gym:chain_sum?size=9"]) == \
        "gym:chain_sum?size=5"  # two benchmarks of one base keep their options
    assert short_benchmark_name("file:/data/x/test.jsonl?reward=math") == "file:test.jsonl"


def test_compact_lines_get_a_heartbeat_while_a_step_runs(tmp_path, monkeypatch, capsys):
    """A step of a real model on a CPU takes minutes: between compact lines a heartbeat line comes whenever
    $ICT_JAX_HEARTBEAT_S seconds pass without one (here 0.05 s), with the steps done and the time."""
    from ict_jax.train.logs import RunLogger

    monkeypatch.setenv("ICT_JAX_HEARTBEAT_S", "0.05")
    log = RunLogger(tmp_path / "run", total_steps=2, progress=False, print_every=None, tensorboard=False, desc="rl")
    time.sleep(0.3)  # the first step (compiling)
    log.log(0, {"reward/mean": 0.5})
    time.sleep(0.3)
    log.close()
    lines = capsys.readouterr().err.splitlines()
    assert any(ln.startswith("rl 0/2 steps  ") and "since the start  (" in ln and ln.endswith(" in rl)")
               for ln in lines), lines
    assert "rl 1/2  reward 0.500" in lines
    assert any(ln.startswith("rl 1/2 steps  ") and "since the last step" in ln for ln in lines), lines
    n = len(lines)
    time.sleep(0.2)
    assert capsys.readouterr().err == "" and n == len(lines)  # closed: no more lines


def test_the_heartbeat_names_the_work_between_steps(tmp_path, monkeypatch, capsys):
    """An evaluation after the last step takes as long as many steps: the heartbeat says what runs
    (RunLogger.working_on) and, once that is cleared, no longer."""
    from ict_jax.train.logs import RunLogger

    monkeypatch.setenv("ICT_JAX_HEARTBEAT_S", "0.05")
    log = RunLogger(tmp_path / "run", total_steps=1, progress=False, print_every=None, tensorboard=False, desc="rl")
    log.log(0, {"reward/mean": 0.5})
    log.working_on("evaluating, 16/128 problems done")
    time.sleep(0.3)
    during = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("rl 1/1 steps  ")]
    log.working_on(None)
    time.sleep(0.3)
    log.close()
    after = capsys.readouterr().err.splitlines()
    assert during and all(ln.endswith(" in rl): evaluating, 16/128 problems done") for ln in during), during
    assert after and all(ln.endswith(" in rl)") for ln in after), after


def test_an_evaluations_metrics_carry_the_shares_of_each_benchmark():
    """An evaluation's row: pass@k, and docs/method.md §5's eval/<benchmark>/no_answer_frac and
    truncated_frac from evaluate()'s per-benchmark no_answer and truncated (no metric where a share is None)."""
    from ict_jax.train.evaluation import pass_at_k_metrics

    results = {"benchmarks": {
        "gsm8k_test": {"problems": 3, "samples": 12, "pass@1": 0.25, "pass@4": 0.5, "se": {"pass@1": 0.1},
                       "no_answer": 4 / 12, "truncated": 5 / 12, "timeouts": 0, "seconds": 1.5},
        "math500": {"problems": 2, "samples": 8, "pass@1": 0.0, "pass@4": 0.0, "no_answer": 1.0, "truncated": None,
                    "timeouts": 2},
    }, "average": {"pass@1": 0.125}, "n": 4}
    assert pass_at_k_metrics(results) == {
        "eval/gsm8k_test/pass@1": 0.25, "eval/gsm8k_test/pass@4": 0.5, "eval/gsm8k_test/no_answer_frac": 4 / 12,
        "eval/gsm8k_test/truncated_frac": 5 / 12,
        "eval/math500/pass@1": 0.0, "eval/math500/pass@4": 0.0, "eval/math500/no_answer_frac": 1.0,
    }


def test_a_runs_evaluation_feeds_its_heartbeat_and_clears_it_even_when_it_fails(tmp_path, monkeypatch):
    """The Evaluator hands evaluate() a listener that names the evaluation in the run's heartbeat
    (the benchmarks loading, the problems done, the batch being sampled) and clears it afterwards, also when
    the evaluation fails."""
    from types import SimpleNamespace

    import ict_jax.train.evaluation as evaluation

    work = []
    logger = SimpleNamespace(working_on=work.append)
    data = SimpleNamespace(eval=["three"], eval_n=2, eval_k=[1], eval_limit=None, eval_batch=None)
    parts = SimpleNamespace(config=SimpleNamespace(data=data), run_dir=tmp_path, pool=None, logger=logger)
    ev = evaluation.Evaluator(parts)
    monkeypatch.setattr(ev, "generator", lambda state: None)
    monkeypatch.setattr(ev, "datasets", lambda: {})

    def fake(*args, listener, **kw):
        listener(0, 3, "three: sampling problems 1-2 of 3, 2 responses each")
        listener(2, 3, None)
        if kw["json_path"].name == "step_000002.json":
            raise RuntimeError("sampler failed")
        return {"benchmarks": {"three": {"pass@1": 0.5}}}

    monkeypatch.setattr(evaluation, "evaluate", fake)
    assert ev.evaluate(None, 1) == {"eval/three/pass@1": 0.5}
    assert work == ["evaluating: loading the benchmarks (three)",  # not loaded yet (the stand-in never keeps them)
                    "evaluating, 0/3 problems done (three: sampling problems 1-2 of 3, 2 responses each)",
                    "evaluating, 2/3 problems done", None]
    with pytest.raises(RuntimeError, match="sampler failed"):
        ev.evaluate(None, 2)
    assert work[-1] is None and len(work) == 8

def test_first_ctrl_c_asks_to_stop_after_the_step_the_second_stops_at_once():
    from ict_jax.train.stopping import stop_after_step

    said = []
    before = signal.getsignal(signal.SIGINT)  # default_int_handler; SIG_IGN in a background job (nohup ... &)
    with stop_after_step(said.append) as stop:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
        assert stop.requested and said and "saving a checkpoint" in said[0]
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.5)
    assert signal.getsignal(signal.SIGINT) is before  # the handler of before is back


def test_an_extension_that_crashed_is_not_taken_for_finished(tmp_path, monkeypatch):
    """A finished run extended (train.steps 2 -> 3) records the new train.steps in config.json at once;
    if that invocation dies, --resume with train.steps=3 must train, not report 'finished' (the
    summary's own step count decides)."""
    import ict_jax.train.trainer as trainer_mod
    from ict_jax.config_load import load_config

    run, args = _recorded_run(tmp_path, "train.steps=3")  # config.json already says 3; summary says 2 done

    class Built(Exception):
        pass

    def fake_build(*a, **k):
        raise Built

    monkeypatch.setattr(trainer_mod, "build_parts", fake_build)
    with pytest.raises(Built):
        trainer_mod.Trainer(load_config(DEMO, args), resume=True)
    summary = json.loads((run / "summary.json").read_text())
    (run / "summary.json").write_text(json.dumps({**summary, "steps": 3}))  # the extension finished
    t = trainer_mod.Trainer(load_config(DEMO, args), resume=True)
    assert t.finished is not None and t.finished["steps"] == 3


def test_a_tensorboard_writer_that_died_on_a_full_disk_is_an_error_not_a_hang(tmp_path, monkeypatch, capfd):
    """tensorboardX writes events from a thread; when a write fails (a full disk) the
    thread ends and the next events block forever on its full queue: the run hung. Now the next log
    raises the write's OSError naming the folder, and the dying thread prints no traceback."""
    import errno
    import threading

    from tensorboardX import record_writer

    from ict_jax.train.logs import RunLogger

    log = RunLogger(tmp_path / "run", total_steps=100, progress=False)
    log.log(0, {"reward/mean": 0.5})

    def full(self, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(record_writer.RecordWriter, "write", full)
    monkeypatch.setattr(record_writer.RecordWriter, "flush", full)
    outcome = {}

    def many_steps():
        try:
            for step in range(1, 100):
                log.log(step, {f"m/{i}": float(i) for i in range(20)})
        except OSError as e:
            outcome["error"] = e

    worker = threading.Thread(target=many_steps, daemon=True)
    worker.start()
    worker.join(timeout=60)
    assert not worker.is_alive(), "RunLogger.log blocked on a dead TensorBoard writer"
    err = outcome["error"]
    assert err.errno == errno.ENOSPC and err.filename == str(tmp_path / "run" / "tb" / "rl")
    assert "Exception in thread" not in capfd.readouterr().err
    closing = threading.Thread(target=log.close, daemon=True)  # closing does not block on the dead writer
    closing.start()
    closing.join(timeout=30)
    assert not closing.is_alive()


@pytest.mark.slow  # two trainers built and compiled, as a whole run is: in the slow stage
def test_wall_s_counts_an_interrupted_invocation(tmp_path):
    """summary.json's wall_s is documented "over all invocations" but left out an
    invocation that was interrupted (Ctrl-C) or stopped by an error. Both now count."""
    from ict_jax.config_load import load_config
    from ict_jax.train.record import read_summary
    from ict_jax.train.stopping import Interrupted
    from ict_jax.train.trainer import Trainer

    cfg = load_config(DEMO, TINY + ["train.sft_steps=0", "data.eval=[]", "train.steps=2", "mesh.data=-1",
                                     "mesh.tensor=2", f"run_dir={tmp_path / 'run'}"])

    def interrupted(*_):
        time.sleep(0.3)
        raise Interrupted("interrupted at RL step 1/2")

    with pytest.raises(Interrupted):
        with Trainer(cfg, progress=False) as t:
            t.run_loop = interrupted
            t.train()
    first = read_summary(tmp_path / "run")
    assert first["status"] == "running" and first["wall_s"] >= 0.3

    def failed(*_):
        time.sleep(0.2)
        raise RuntimeError("a bug")

    with pytest.raises(RuntimeError):
        with Trainer(cfg, resume=True, progress=False) as t:
            t.run_loop = failed
            t.train()
    assert read_summary(tmp_path / "run")["wall_s"] >= first["wall_s"] + 0.2  # added up over invocations


def test_a_row_is_written_whole_or_not_at_all_and_a_half_row_is_not_read(tmp_path):
    """A full disk loses nothing: on a full disk metrics.jsonl got half a row, and the resumed run
    then failed on it (JSONDecodeError, exit 1). A failed write is cut back to where the row began, and a
    half row at the end of a file (from a crash mid-write) is skipped by the readers."""
    import errno

    from ict_jax.train.logs import append_row, complete_lines

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0, "phase": "rl"}\n')
    real = open(path, "ab", buffering=0)

    class FullDisk:  # writes part of the row, then the disk is full
        def fileno(self):
            return real.fileno()

        def write(self, data):
            os.write(real.fileno(), data[:10])
            raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError) as err:
        append_row(FullDisk(), json.dumps({"step": 1, "phase": "rl", "x": 1.5}) + "\n", path)
    real.close()
    assert err.value.errno == errno.ENOSPC and err.value.filename == str(path)
    assert path.read_text() == '{"step": 0, "phase": "rl"}\n'  # the half row is gone

    assert complete_lines('{"a": 1}\n{"b": 2}\n') == ['{"a": 1}', '{"b": 2}']
    assert complete_lines('{"a": 1}\n{"b": 2') == ['{"a": 1}']  # cut short: skipped
    assert complete_lines('{"a": 1}\n{"b": 2}') == ['{"a": 1}', '{"b": 2}']  # whole, only the newline missing
    path.write_text('{"step": 0, "phase": "rl", "m": 1.0}\n{"step": 1, "phase": "rl", "m": 2.0}\n{"step": 2, "ph')
    assert [r["step"] for r in read_metrics(path)] == [0, 1]
    assert truncate_metrics(path, {"rl": 1}) == 1 and path.read_text() == '{"step": 0, "phase": "rl", "m": 1.0}\n'


def test_an_evaluations_results_and_samples_paths(tmp_path):
    from ict_jax.train.evaluation import eval_results

    assert eval_results(tmp_path, 3) == tmp_path / "eval" / "step_000003.json"
    assert eval_results(tmp_path, 3).with_suffix(".jsonl") == tmp_path / "eval" / "step_000003.jsonl"
