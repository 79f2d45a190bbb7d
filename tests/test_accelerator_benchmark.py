"""``benchmarks/accelerator.py``: the prepared GPU benchmark runs every stage at tiny shapes on the CPU
(``--smoke``) and records each; it imports nothing the lent GPU machine lacks."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "accelerator.py"
#: packages the lent GPU machine does not have (ENVIRONMENT.md)
ABSENT = ("gguf", "math_verify", "tensorboardX", "reasoning_gym")


def _load():
    spec = importlib.util.spec_from_file_location("accelerator_benchmark", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("accelerator")
    bench = _load()
    # torch's stage runs only where the test extra is installed; the rest always
    stages = [s for s in bench.STAGES if s != "torch" or importlib.util.find_spec("torch") is not None]
    code = bench.main(["--smoke", "--in-process", "--out", str(out), "--stages", ",".join(stages)])
    return bench, out, stages, code


# the whole benchmark at smoke sizes, every stage compiled and run (about a minute under load): an end-to-end
# run, in CI's second stage, which proves the GPU script before a lent device runs it (docs/benchmarks.md
# "Accelerator")
@pytest.mark.e2e
def test_smoke_runs_every_stage_and_writes_its_record(smoke, capsys):
    bench, out, stages, code = smoke
    summary = json.loads((out / "accelerator.json").read_text())
    assert summary["smoke"] is True and list(summary["stages"]) == stages
    assert summary["machine"]["cores"] >= 1 and summary["machine"]["cpu"]  # the host it ran on
    for name in stages:  # one record a stage, written as it finished, the same as the summary's
        rec = json.loads((out / f"{name}.json").read_text())
        assert "error" not in rec, rec
        assert rec == summary["stages"][name]
    assert code == 0
    train = summary["stages"]["train_0p5b"]
    assert train["shape"]["tokens"] == 2 * 4 * (8 + 16) and len(train["steps_s"]) >= 1
    assert train["tokens_per_s"] > 0 and train["hlo_flops"] > 0
    # the step's counted FLOPs against 6 N tokens: reference, old-policy and statistics passes and remat
    # block make them more than one forward and backward (docs/tpu.md "Roofline")
    assert 1.0 < train["hlo_flops"] / train["model_flops"] < 4.0
    assert train["mfu_6nd"] is None  # a CPU: no peak in the chip table
    roll = summary["stages"]["rollout"]
    assert roll["rows"] == 4 * 4 and roll["new_tokens"] == 16 and roll["tokens_per_s"] > 0
    assert roll["roofline"]["decode_steps"] and roll["decode_step_ratio"] > 1.0
    blocked = summary["stages"]["train_0p5b_blocked"]  # the same step with model.attention=blocked
    assert blocked["attention"] == "blocked" and train["attention"] == "dense"  # auto on a CPU: dense
    assert blocked["shape"] == train["shape"] and blocked["tokens_per_s"] > 0
    assert blocked["variant_of"] == "train_0p5b" and blocked["settings"] == {"model.attention": "blocked"}
    dense = summary["stages"]["train_0p5b_dense"]  # today's step: what auto replaces on a GPU
    assert dense["attention"] == "dense" and dense["settings"] == {"model.attention": "dense"}
    unrolled = summary["stages"]["rollout_unrolled"]  # per-layer caches; on a CPU the default decode is too
    assert unrolled["unrolled"] is True and roll["unrolled"] is True and unrolled["rows"] == roll["rows"]
    assert unrolled["variant_of"] == "rollout" and unrolled["settings"] == {"unroll_layers": True}
    assert summary["stages"]["rollout_dense"]["attention"] == "dense"
    # every compiled program's HLO text, in the output folder
    import gzip

    for name in ("train_0p5b", "train_1p5b", "rollout", "stats", "attention_dense", "attention_xla", *bench.VARIANTS):
        with gzip.open(out / "hlo" / f"{name}.hlo.txt.gz", "rt") as f:
            assert f.read(200).startswith("HloModule"), name
    stats = summary["stages"]["stats"]
    assert stats["tokens"] == 2 * 64 and stats["pass_ms"] > 0 and stats["temporaries"] > 0
    att = summary["stages"]["attention"]  # on a CPU: the xla path against dense, float32
    assert att["implementation"] == "xla" and att["positions"] == 8 + 16 - 1 and set(att["ms"]) == {"dense", "xla"}
    assert max(att["grad_max_diff"].values()) <= 1e-5 * max(1.0, max(att["grad_max"].values()))
    assert att["loss_diff"] <= 1e-5 * max(1.0, abs(att["loss"]))
    mem = summary["stages"]["memory"]
    assert mem["predicted_live"] > 0 and mem["measured_peak"] is None  # a CPU keeps no peak
    table = bench.render(summary["stages"])
    assert [line.split()[0] for line in table.splitlines()] == stages
    assert "tok/s" in table and "MFU" in table
    assert "x the speed of train_0p5b" in dict(bench.summary_rows(summary["stages"]))["train_0p5b_blocked"]


def test_bad_stage_is_refused(capsys):
    bench = _load()
    with pytest.raises(SystemExit) as e:
        bench.parse_args(["--stages", "train_0p5b,warp"])
    assert e.value.code == 2 and "unknown warp" in capsys.readouterr().err


def test_the_benchmark_imports_nothing_the_gpu_machine_lacks(tmp_path):
    """Importing the benchmark and running every stage's imports with gguf, math-verify, tensorboardX and
    reasoning-gym made unimportable (sys.modules[name] = None): nothing on its path needs them."""
    code = f"""
import sys
for name in {ABSENT!r}:
    sys.modules[name] = None
import importlib.util
spec = importlib.util.spec_from_file_location("b", {str(SCRIPT)!r})
b = importlib.util.module_from_spec(spec)
spec.loader.exec_module(b)
import ict_jax
import ict_jax.aot.compile, ict_jax.aot.roofline, ict_jax.rl.train_step, ict_jax.rl.state, ict_jax.sampling.sampler
import ict_jax.train.programs, ict_jax.rl.token_stats, ict_jax.model.weights
sys.path.insert(0, {str(ROOT / "benchmarks")!r})
import train_step
from ict_jax import save_hf
b.train_config("0p5b", True)
print("ok")
"""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]


def test_a_train_step_over_the_device_is_recompiled_with_more_micro_batches(monkeypatch, tmp_path):
    """Where the recipe's one micro-batch would not fit the device, the train stage compiles twice as many
    micro-batches until one fits, and records every try (here: 1 over a 50-byte limit, 2 under it)."""
    bench = _load()
    lives = iter([100, 10])
    monkeypatch.setattr(bench, "device_bytes_limit", lambda: 50)
    monkeypatch.setattr(bench, "compiled_live", lambda compiled: next(lives))
    monkeypatch.setattr(bench, "DUMP_DIR", tmp_path / "hlo")
    rec = bench.stage_train("0p5b", True, deadline=0.0)
    assert rec["micro_batches"] == 2 and [t["micro_batches"] for t in rec["fit"]] == [1, 2]
    assert [t["live"] for t in rec["fit"]] == [100, 10] and rec["device_bytes_limit"] == 50
    assert len(rec["steps_s"]) == 1 and rec["tokens_per_s"] > 0
    import gzip

    with gzip.open(tmp_path / "hlo" / "train_0p5b.hlo.txt.gz", "rt") as f:
        assert "HloModule" in f.read(200)
    assert "train.micro_batches 2" in bench.render({"train_0p5b": rec})


def test_a_train_step_that_fits_nowhere_is_an_error(monkeypatch):
    """Two rows: one micro-batch, then two (one row each) over the limit; no third try: an error."""
    bench = _load()
    tiny = bench.shapes(True)
    monkeypatch.setattr(bench, "shapes", lambda smoke: dict(tiny, P=1, G=2))
    monkeypatch.setattr(bench, "device_bytes_limit", lambda: 50)
    monkeypatch.setattr(bench, "compiled_live", lambda compiled: 100)
    with pytest.raises(MemoryError, match="even at train.micro_batches 2, over 95% of"):
        bench.stage_train("0p5b", True, deadline=0.0)


def test_the_hlo_goes_to_the_output_folder_unless_told_otherwise(tmp_path):
    bench = _load()
    assert bench.parse_args(["--out", str(tmp_path)]).dump_hlo == tmp_path / "hlo"
    assert bench.parse_args(["--out", str(tmp_path), "--dump-hlo", str(tmp_path / "x")]).dump_hlo == tmp_path / "x"
    assert bench.parse_args(["--out", str(tmp_path), "--no-hlo"]).dump_hlo is None
