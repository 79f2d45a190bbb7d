"""The notebooks: their sources (notebooks/*.py, jupytext percent format, the reviewed source of truth) run
as plain Python on the tiny model and write their figures; they import only ict_jax, numpy, matplotlib, jax
and the standard library. The committed notebooks (notebooks/*.ipynb, built by notebooks/build.py) carry
their outputs, are current with their sources and stay small; the build itself runs in the e2e stage."""

from __future__ import annotations

import ast
import hashlib
import json
import math
import os
import runpy
import subprocess
import sys
from pathlib import Path

import matplotlib
import pytest

ROOT = Path(__file__).resolve().parent.parent
NB = ROOT / "notebooks"
NOTEBOOKS = ("01_token_selection.py", "02_training_dynamics.py", "03_experiment_record.py")
FIGURES = {"01_token_selection": 3, "02_training_dynamics": 2, "03_experiment_record": 3}  # inline figures each shows
MAX_BYTES = 2_000_000
ALLOWED = {"ict_jax", "numpy", "matplotlib", "jax"}


def _png_ok(path: Path) -> None:
    assert path.is_file(), path
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5_000, path


def _run(name: str, monkeypatch, env: dict[str, str]) -> dict:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    matplotlib.use("Agg")
    try:
        return runpy.run_path(str(NB / name), run_name="__main__")
    finally:
        import matplotlib.pyplot as plt

        plt.close("all")


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebooks_are_percent_scripts_importing_only_the_allowed_packages(name):
    src = (NB / name).read_text()
    assert src.count("\n# %%") >= 4 and "format_name: percent" in src
    mods = set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Import):
            mods |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            mods.add((node.module or "").split(".")[0])
    third_party = {m for m in mods if m not in sys.stdlib_module_names}
    assert third_party <= ALLOWED, third_party - ALLOWED
    assert "ict_jax" in mods


@pytest.mark.e2e
def test_01_token_selection_on_the_tiny_model(tmp_path, monkeypatch):
    out = tmp_path / "nb01"
    ns = _run("01_token_selection.py", monkeypatch,
              {"ICT_NB_MODEL": "", "ICT_NB_G": "4", "ICT_NB_MAX_NEW_TOKENS": "12", "ICT_NB_OUT": str(out)})
    for png in ("distributions.png", "js_vs_h1.png", "masks.png"):
        _png_ok(out / png)
    assert (out / "inspector.html").read_text().startswith("<!DOCTYPE html>")
    masks, valid = ns["masks"], ns["v"]
    assert set(masks) == {"ict", "entropy", "stapo"}
    for m in masks.values():
        assert m.shape == (4, 12) and not (m & ~valid).any()
    assert masks["ict"].sum() == sum(max(1, -(-int(r.sum()) // 10)) for r in valid)  # ceil(0.1 n) per response


@pytest.mark.slow
@pytest.mark.real_model
def test_01_token_selection_on_the_real_qwen(tmp_path, monkeypatch):
    """Notebook 01's default when the real Qwen2.5-Coder-0.5B-Instruct is installed: a word problem through
    its chat template, rewards from the stated answer, ICT's tokens marked in the answers."""
    from ict_jax.model.packaged import parts_missing

    missing = parts_missing("qwen2.5-coder-0.5b-instruct")
    if missing:
        pytest.skip(f"real Qwen2.5 parts: {missing}")
    out = tmp_path / "nb01_real"
    monkeypatch.delenv("ICT_NB_MODEL", raising=False)
    # a smaller group and budget than the notebook's defaults (8 x 192): the same path, a third of the time
    ns = _run("01_token_selection.py", monkeypatch, {"ICT_NB_OUT": str(out), "ICT_NB_G": "4",
                                                     "ICT_NB_MAX_NEW_TOKENS": "64"})
    assert ns["MODEL"] == "qwen2.5-coder-0.5b-instruct" and ns["TEMPLATE"] == "qwen_chat"
    assert ns["model"].config.vocab_size == 151936
    G, N = ns["G"], ns["MAX_NEW_TOKENS"]
    masks, valid, rewards = ns["masks"], ns["v"], ns["rewards"]
    assert rewards is not None and rewards.shape == (G,) and set(rewards.tolist()) <= {0.0, 1.0}
    for m in masks.values():
        assert m.shape == (G, N) and not (m & ~valid).any()
    assert masks["ict"].sum() == sum(max(1, -(-int(r.sum()) // 10)) for r in valid)
    assert "⟦" in ns["marked"](0)
    for png in ("distributions.png", "js_vs_h1.png", "masks.png"):
        _png_ok(out / png)


def _fake_run(run_dir: Path, steps: int = 6) -> None:
    """A metrics.jsonl written by the trainer's own logger: SFT rows, then RL rows (warm-up, then ICT)."""
    from ict_jax.train.logs import RunLogger

    log = RunLogger(run_dir, total_steps=steps, progress=False, tensorboard=False)
    log.log(0, {"sft/loss": 2.0}, phase="sft")
    for s in range(steps):
        log.log(s, {"stats/H1_mean": 2.0 - 0.1 * s, "stats/H2_mean": 1.5 - 0.1 * s,
                    "stats/H1_selected_mean": 2.5 - 0.1 * s, "stats/js_mean": 0.01, "stats/js_selected_mean": 0.05,
                    "mask/selected_frac": 1.0 if s < 2 else 0.1, "reward/mean": 0.1 * s,
                    "reward/accuracy": 0.1 * s})
    log.close()


def test_02_training_dynamics_reads_a_run(tmp_path, monkeypatch):
    run, out = tmp_path / "run", tmp_path / "nb02"
    _fake_run(run)
    ns = _run("02_training_dynamics.py", monkeypatch, {"ICT_NB_RUN_DIR": str(run), "ICT_NB_OUT": str(out)})
    _png_ok(out / "h1_h2_selected.png")
    _png_ok(out / "selected_vs_all.png")
    assert len(ns["rows"]) == 6 and len(ns["sft_rows"]) == 1
    steps, sel = ns["series"]("mask/selected_frac")
    assert steps.tolist() == list(range(6)) and sel.tolist() == [1.0, 1.0] + [0.1] * 4


EXPERIMENT = """\
name: nb
config: {config}
overrides: {{model.preset: tiny}}
arms:
  ict: {{method: ict}}
  grpo: {{method: grpo}}
seeds: [0, 1, 2]
steps: 3
reference_arms: [grpo]
primary_outcome: {{metric: reward/mean, steps: [2, 3]}}
design: {{assumed_sd: 0.05}}
stopping_rule: every run trains all 3 steps
out: {out}
"""


def _fake_record(tmp_path: Path) -> Path:
    """An experiment.json built by the record's own builder from hand-written run directories: 2 arms x 3
    seeds, ict above grpo by 0.1, 0.12 and 0.3 at every step of seeds 0, 1, 2; grpo seed 2 stopped after 2 steps."""
    from ict_jax.experiments.plan import load_plan
    from ict_jax.experiments.record import build_record

    path = tmp_path / "nb.yaml"
    path.write_text(EXPERIMENT.format(config=ROOT / "configs" / "demo.yaml", out=tmp_path / "nb"))
    plan = load_plan(path)
    for arm in ("ict", "grpo"):
        for seed in (0, 1, 2):
            d = plan.out / "runs" / f"{arm}_s{seed}"
            d.mkdir(parents=True)
            n = 2 if (arm, seed) == ("grpo", 2) else 3
            lift = (0.1, 0.12, 0.3)[seed] if arm == "ict" else 0.0
            d.joinpath("metrics.jsonl").write_text("".join(
                json.dumps({"phase": "rl", "step": s, "reward/mean": 0.1 * s + 0.05 * seed + lift,
                            "time/sample_s": 2.0, "time/rewards_s": 0.5, "time/update_s": 4.0}) + "\n"
                for s in range(n)))
            if n == 3:  # an unfinished run's rows count up to its checkpoint, here none
                d.joinpath("summary.json").write_text(json.dumps({"status": "finished", "steps": 3}))
    rec = build_record(plan, plan_info={"sha256": plan.sha256, "text": plan.text})
    out = tmp_path / "experiment.json"
    out.write_text(json.dumps(rec))
    return out


def test_03_experiment_record_recomputes_the_outcomes_it_reads(tmp_path, monkeypatch, capsys):
    record, out = _fake_record(tmp_path), tmp_path / "nb03"
    ns = _run("03_experiment_record.py", monkeypatch, {"ICT_NB_RECORD": str(record), "ICT_NB_OUT": str(out)})
    for png in ("metric_by_arm.png", "step_time.png", "mde_by_seeds.png"):
        _png_ok(out / png)
    # mean reward over steps 2-3 (rows 1, 2): 0.15 + 0.05 seed (+ ict's lift); grpo seed 2 has no step 3
    assert ns["values"]["grpo"] == pytest.approx({"0": 0.15, "1": 0.2, "2": None})
    assert ns["values"]["ict"] == pytest.approx({"0": 0.25, "1": 0.32, "2": 0.55})
    printed = capsys.readouterr().out
    # diffs 0.10, 0.12 (seed 2 unpaired): mean 0.11, sd 0.0141, se 0.01, t 11, df 1, p 1 - 2 atan(11) / pi
    p = 1 - 2 * math.atan(11.0) / math.pi
    assert f"ict - grpo: +0.1100 ± 0.0141 (sd of the differences), t 11.00, df 1, p {p:.3f} over 2 seeds" in printed
    assert "      ict_s0      2.0s      0.5s      4.0s      6.5s" in printed, printed
    # a record whose stored outcome disagrees with its rows is caught
    rec = json.loads(record.read_text())
    rec["outcomes"][0]["per_arm"]["ict"]["values"]["1"] = 0.33
    record.write_text(json.dumps(rec))
    with pytest.raises(AssertionError, match="ict"):
        _run("03_experiment_record.py", monkeypatch, {"ICT_NB_RECORD": str(record), "ICT_NB_OUT": str(out)})


# ------------------------------------------------------------------------------------------------
# The .ipynb files with outputs (notebooks/build.py)
# ------------------------------------------------------------------------------------------------
def _check_executed(path: Path, source: Path) -> dict:
    """An executed notebook built from `source` as it is now: every code cell ran, none raised, the
    figures are there, and the file stays small enough to read on the web."""
    assert path.is_file(), f"{path} is missing: python notebooks/build.py"
    assert path.stat().st_size < MAX_BYTES, f"{path}: {path.stat().st_size} bytes"
    nb = json.loads(path.read_text())
    meta = nb["metadata"]["ict_jax"]
    assert meta["source"] == source.name
    assert meta["source_sha256"] == hashlib.sha256(source.read_bytes()).hexdigest(), (
        f"{path.name} was built from another version of {source.name}: run python notebooks/build.py")
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert len(code) >= 4 and all(c["execution_count"] for c in code), "a code cell did not run"
    outputs = [o for c in code for o in c["outputs"]]
    errors = [o for o in outputs if o["output_type"] == "error"]
    assert not errors, [(o["ename"], o["evalue"]) for o in errors]
    pngs = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(pngs) >= FIGURES[path.stem], f"{path.name}: {len(pngs)} figures"
    assert any(o["output_type"] == "stream" and o["text"] for o in outputs)  # printed tables / numbers
    return nb


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_committed_notebooks_are_current_executed_and_small(name):
    _check_executed((NB / name).with_suffix(".ipynb"), NB / name)


@pytest.mark.e2e
def test_build_executes_every_notebook(tmp_path):
    """`notebooks/build.py --fast`: jupytext converts each source, a Jupyter kernel executes it, the
    .ipynb is written with its outputs (notebook 02 trains its own few-step demo)."""
    out, work = tmp_path / "out", tmp_path / "work"
    # one CPU device, like a user's machine; the tests' compilation cache comes with os.environ (tests/conftest.py)
    env = dict(os.environ, XLA_FLAGS=os.environ["ICT_JAX_TEST_SUBPROCESS_XLA_FLAGS"], JAX_PLATFORMS="cpu")
    p = subprocess.run([sys.executable, str(NB / "build.py"), "--fast", "--out", str(out), "--work", str(work)],
                       env=env, capture_output=True, text=True, timeout=1200)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    for name in NOTEBOOKS:
        nb = _check_executed(out / Path(name).with_suffix(".ipynb").name, NB / name)
        assert nb["metadata"]["ict_jax"]["mode"] == "fast"
    for png in ("distributions.png", "js_vs_h1.png", "masks.png"):
        _png_ok(work / "01_token_selection" / png)
    _png_ok(work / "02_training_dynamics" / "h1_h2_selected.png")
    from ict_jax.train.logs import read_metrics

    # notebook 02 without a run directory trains its own few-step demo: the warm-up (2 steps) with every
    # token, then ICT's ~10 %
    rows = read_metrics(work / "02_training_dynamics" / "demo_run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(6))  # ICT_NB_DEMO_STEPS' default
    sel = [r["mask/selected_frac"] for r in rows]
    assert sel[0] == 1.0 and sel[-1] < 0.5, sel
