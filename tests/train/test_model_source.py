"""ict_jax.train.model_source.resolve_model: every kind of model spec (a Hugging Face directory, a .gguf file,
pkg:, a packaged name (tests/model/test_packaged.py), a training run directory, its checkpoints/ folder and
a <step>/ directory, a run's SFT warm start, preset:<name>, a run's config) resolved into one ModelSource on
tiny random models written to temporary folders; an unknown spec is one clear error."""

import dataclasses
import warnings
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from ict_jax.config_load import load_config
from ict_jax.model.config import ModelConfig
from ict_jax.model.qwen2 import init_model
from ict_jax.model.tokenizers import CharTokenizer
from ict_jax.rng import INIT_STREAM, root_key, stream_key
from ict_jax.train.model_source import resolve_model

from fake_run import make_run_dir, run_model  # tests/ is on sys.path under pytest

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "configs" / "demo.yaml"


def _same_weights(a, b):
    for x, y in zip(jax.tree.leaves(nnx.state(a, nnx.Param)), jax.tree.leaves(nnx.state(b, nnx.Param)), strict=True):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """What `ict-jax train` leaves: config.json, metrics.jsonl, checkpoints/1 (tokenizer 'char'), sft_model."""
    return make_run_dir(tmp_path_factory.mktemp("model_source") / "run")


def test_a_run_directory_its_checkpoints_folder_and_a_step_directory(run_dir):
    want = run_model()
    for spec in (run_dir, run_dir / "checkpoints", run_dir / "checkpoints" / "1"):
        source = resolve_model(spec)
        assert (source.kind, source.step, source.tokenizer_spec) == ("checkpoint", 1, "char")
        assert source.spec == str(spec) and source.where == f"{spec} (checkpoint of step 1)"
        assert source.path == str(run_dir / "checkpoints" / "1") and source.meta["step"] == 1
        assert source.config == want.config and source.run_config[1].startswith("the checkpoint of step 1 in ")
        assert source.run_config[0]["model"]["preset"] == "tiny"
        assert isinstance(source.tokenizer(), CharTokenizer)
    _same_weights(source.load(), want)  # the params item only, bitwise
    assert source.load(dtype="bfloat16").embed[...].dtype == jax.numpy.bfloat16
    assert resolve_model(run_dir, tokenizer="char").tokenizer_spec == "char"
    with pytest.raises(FileNotFoundError, match=r"no finished checkpoint of step 7 .* \(finished steps: 1\)"):
        resolve_model(run_dir, step=7)
    assert resolve_model(run_dir, step=1, checkpoint=True).step == 1


def test_a_runs_sft_warm_start_and_its_sft_model_given_itself(run_dir, tmp_path):
    sft_only = tmp_path / "sft_run"
    sft_only.mkdir()
    (sft_only / "sft_model").symlink_to(run_dir / "sft_model")
    (sft_only / "config.json").write_text((run_dir / "config.json").read_text())
    source = resolve_model(sft_only)
    assert (source.kind, source.spec, source.tokenizer_spec) == ("sft_model", str(sft_only), "char")
    assert source.where == f"{sft_only / 'sft_model'} (the SFT warm start of the run)"
    assert source.run_config[1] == str(sft_only / "config.json")
    _same_weights(source.load(), run_model())
    with pytest.raises(ValueError, match="has no RL checkpoint, only its SFT warm start"):
        resolve_model(sft_only, step=1)
    with pytest.raises(FileNotFoundError, match="no finished checkpoint in"):
        resolve_model(sft_only, checkpoint=True)
    # the warm start's directory itself: a Hugging Face directory with its run's settings (a char tokenizer)
    itself = resolve_model(run_dir / "sft_model")
    assert itself.kind == "hf" and itself.tokenizer_spec == "char"
    assert itself.run_config[1] == str(run_dir / "config.json")
    empty = tmp_path / "empty_run"
    (empty / "checkpoints").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="without a finished checkpoint or sft_model yet"):
        resolve_model(empty)


def test_files_and_presets_by_spec(run_dir):
    hf = run_dir / "sft_model"
    source = resolve_model(str(hf), tokenizer="char")
    assert source.kind == "hf" and source.config == run_model().config
    with pytest.raises(FileNotFoundError, match="no finished checkpoint in"):
        resolve_model(hf, checkpoint=True)
    with pytest.raises(ValueError, match="step 1: .* is not a training run or checkpoint directory"):
        resolve_model(hf, step=1)
    preset = resolve_model("preset:tiny", tokenizer="char")
    assert preset.kind == "preset" and preset.config.vocab_size == 100
    assert resolve_model("preset:tiny").config.vocab_size == ModelConfig.tiny().vocab_size  # no tokenizer named


def test_an_unknown_spec_is_one_clear_error():
    with pytest.raises(FileNotFoundError, match=r"^no model at 'nothing/here': expected a Hugging Face checkpoint "
                                                r"directory, a .gguf file, pkg:<package>/<file>, a model split over "
                                                r"packages \(ict-jax info lists them\), a training run directory or "
                                                r"preset:<name>$"):
        resolve_model("nothing/here")
    with pytest.raises(FileNotFoundError, match="Python package 'no_such_package_t31' is not installed"):
        resolve_model("pkg:no_such_package_t31/model.gguf")
    with pytest.raises(ValueError, match="unknown model preset 'huge'"):
        resolve_model("preset:huge")
    with pytest.raises(TypeError, match="go with a Config"):
        resolve_model("preset:tiny", platform="tpu")


def test_a_runs_config(run_dir, tmp_path):
    cfg = load_config(DEMO, ["model.preset=tiny", f"run_dir={tmp_path / 'r'}", "model.remat=none"])
    source = resolve_model(cfg)
    assert (source.kind, source.tokenizer_spec, source.where) == ("preset", "char", "preset tiny")
    assert source.config == ModelConfig.tiny(vocab_size=100, remat="none")
    _same_weights(source.load(), init_model(source.config, seed=stream_key(root_key(cfg.seed), INIT_STREAM)))
    # compile's view: auto resolved for the target platform; a placeholder model.path gives the preset
    assert resolve_model(cfg, platform="tpu").config.compute_dtype == "bfloat16"
    assert resolve_model(cfg, platform="cpu").config.compute_dtype == "float32"
    away = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path="/not/here/model"))
    with pytest.raises(FileNotFoundError, match="no model at '/not/here/model'"):
        resolve_model(away)
    placeholder = resolve_model(away, missing="preset")
    assert placeholder.where == "preset tiny (model.path '/not/here/model' is not here)"
    assert placeholder.config == ModelConfig.tiny(remat="none")  # the preset's own vocabulary
    # model.path and LoRA; weights from another directory with the run's settings
    lora = load_config(DEMO, [f"model.path={run_dir / 'sft_model'}", "model.tokenizer=char", "model.lora.enabled=true",
                              "model.lora.rank=2", f"run_dir={tmp_path / 'r2'}"])
    source = resolve_model(lora)
    assert source.config.lora.rank == 2 and source.tokenizer_spec == "char"
    model = source.load()
    assert model.config == source.config
    plain = resolve_model(lora, weights=run_dir / "sft_model", adapters=False)
    assert plain.config.lora is None and plain.tokenizer_spec == "char"
    _same_weights(plain.load(), run_model())
    with pytest.raises(ValueError, match="is an ict_jax training run directory"):
        resolve_model(dataclasses.replace(lora, model=dataclasses.replace(lora.model, path=str(run_dir))))
    # the attention setting reaches the model, from a preset and from files
    for extra in (["model.preset=tiny"], [f"model.path={run_dir / 'sft_model'}", "model.tokenizer=char"]):
        blocked = load_config(DEMO, [*extra, "model.attention=blocked", "model.attention_block=32",
                                     f"run_dir={tmp_path / 'r3'}"])
        source = resolve_model(blocked)
        assert (source.config.attention, source.config.attention_block) == ("blocked", 32), extra
        assert source.load().config.attention == "blocked"


def test_an_exported_run_resolves_to_the_same_model_and_carries_its_config(run_dir, tmp_path):
    from ict_jax.model.source import RUN_CONFIG_FILE
    from ict_jax.train.export import export_checkpoint

    want = resolve_model(run_dir).load()
    out = export_checkpoint(run_dir, tmp_path / "hf")
    _same_weights(resolve_model(out).load(), want)
    assert (out / RUN_CONFIG_FILE).is_file()


def test_resolving_a_runs_config_warns_nothing(tmp_path):
    cfg = load_config(DEMO, ["model.preset=tiny", f"run_dir={tmp_path / 'r'}"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resolve_model(cfg)
