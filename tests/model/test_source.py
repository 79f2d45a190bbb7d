"""ict_jax.model.source: the model layer's sources (a Hugging Face directory, a .gguf file, a preset) as one
value that knows its architecture, its tokenizer and how its weights load; the one rule for ``auto``
compute dtype; a tokenizer from any spec. Tiny random models written to temporary folders."""

import json

import jax
import numpy as np
import pytest
from flax import nnx

from ict_jax.config import LoraSection
from ict_jax.model.adapters import attach_lora
from ict_jax.model.config import ModelConfig, resolve_compute_dtype
from ict_jax.model.qwen2 import init_model
from ict_jax.model.source import RUN_CONFIG_FILE, ModelSource
from ict_jax.model.tokenizers import CharTokenizer, load_tokenizer
from ict_jax.model.weights import load_hf, save_hf
from ict_jax.rng import INIT_STREAM, root_key, stream_key


def _same_weights(a, b):
    for x, y in zip(jax.tree.leaves(nnx.state(a, nnx.Param)), jax.tree.leaves(nnx.state(b, nnx.Param)), strict=True):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_a_hugging_face_directory(tiny_hf_dir, tiny_model):
    source = ModelSource.from_files(tiny_hf_dir)
    assert source.kind == "hf" and source.spec == source.path == source.where == str(tiny_hf_dir)
    assert source.config == tiny_model.config and source.run_config is None
    with pytest.raises(FileNotFoundError, match="no tokenizer files .* or 'char' for the built-in CharTokenizer"):
        source.tokenizer()  # the session's directory carries no tokenizer files
    model = source.load()
    assert model.config == source.config
    _same_weights(model, tiny_model)
    _same_weights(model, load_hf(tiny_hf_dir))  # the format reader it wraps, bitwise
    assert isinstance(ModelSource.from_files(tiny_hf_dir, tokenizer="char").tokenizer(), CharTokenizer)


def test_settings_and_dtype_go_to_the_architecture_and_the_weights(tiny_hf_dir):
    source = ModelSource.from_files(tiny_hf_dir, param_dtype="bfloat16", scan_layers=False, compute_dtype="float32")
    assert (source.config.param_dtype, source.config.scan_layers, source.config.compute_dtype) == \
        ("bfloat16", False, "float32")
    model = source.load()
    assert model.config == source.config and model.embed[...].dtype == jax.numpy.bfloat16
    _same_weights(model, load_hf(tiny_hf_dir, dtype="bfloat16", scan_layers=False, compute_dtype="float32"))
    assert source.load(dtype="float32").embed[...].dtype == jax.numpy.float32  # load's dtype wins


def test_an_exported_directory_brings_its_runs_config_and_char_tokenizer(tmp_path, tiny_model):
    out = save_hf(tiny_model, tmp_path / "export")
    (out / RUN_CONFIG_FILE).write_text(json.dumps({"model": {"tokenizer": "char"}, "rollout": {"max_new_tokens": 5}}))
    source = ModelSource.from_files(out)
    assert source.run_config == ({"model": {"tokenizer": "char"}, "rollout": {"max_new_tokens": 5}},
                                 str(out / RUN_CONFIG_FILE))
    assert source.tokenizer_spec == "char" and isinstance(source.tokenizer(), CharTokenizer)


def test_a_gguf_file(tmp_path):
    pytest.importorskip("gguf")
    from ict_jax.model.gguf import load_gguf

    from test_packaged import V, _tiny_gguf  # the same folder (pytest puts a test file's folder on sys.path)

    path = tmp_path / "tiny.gguf"
    _tiny_gguf(path)
    source = ModelSource.from_files(path)
    assert source.kind == "gguf" and source.tokenizer_spec == str(path) and source.config.vocab_size == V
    tok = source.tokenizer()
    model = source.load()
    want, want_tok = load_gguf(path)
    assert model.config == want.config == source.config
    _same_weights(model, want)
    assert tok.vocab_size == want_tok.vocab_size and tok.encode("abcd") == want_tok.encode("abcd") == [256, 257]
    assert ModelSource.from_files(path, scan_layers=False).load().config.scan_layers is False


def test_a_preset_sized_to_its_tokenizer_with_random_weights_from_the_init_stream():
    source = ModelSource.from_preset("tiny", tokenizer="char", seed=3)
    assert (source.kind, source.spec, source.tokenizer_spec, source.where) == ("preset", "preset:tiny", "char",
                                                                              "preset tiny")
    assert source.config == ModelConfig.tiny(vocab_size=100) and source.tokenizer().vocab_size == 100
    model = source.load()
    _same_weights(model, init_model(source.config, seed=stream_key(root_key(3), INIT_STREAM)))
    bare = ModelSource.from_preset("preset:tiny", tokenizer=None)  # no tokenizer: the preset's own vocabulary
    assert bare.config == ModelConfig.tiny() and bare.tokenizer_spec is None
    with pytest.raises(FileNotFoundError, match="a preset has no tokenizer of its own"):
        bare.tokenizer()
    big = ModelSource.from_preset("qwen2p5_0p5b", tokenizer=None)  # the architecture only: nothing allocated
    assert big.config == ModelConfig.qwen2p5_0p5b()
    with pytest.raises(ValueError, match="unknown model preset 'nope'"):
        ModelSource.from_preset("nope")


def test_fresh_lora_adapters_are_part_of_the_architecture_and_of_the_loaded_model():
    lora = LoraSection(enabled=True, rank=2, alpha=4)
    source = ModelSource.from_preset("tiny", tokenizer="char", lora=lora, seed=1)
    assert source.config.lora is not None and source.config.lora.rank == 2
    model = source.load()
    assert model.config == source.config
    plain = init_model(ModelConfig.tiny(vocab_size=100), seed=stream_key(root_key(1), INIT_STREAM))
    _same_weights(model, attach_lora(plain, lora, 1))
    off = ModelSource.from_preset("tiny", tokenizer="char", lora=LoraSection())  # enabled: false
    assert off.config.lora is None


def test_no_model_and_a_run_directory_are_one_line_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"^no model at 'no/such/model': expected a Hugging Face checkpoint "
                                                r"directory, a .gguf file, .* a training run directory or "
                                                r"preset:<name>$"):
        ModelSource.from_files("no/such/model")
    run = tmp_path / "run"
    (run / "checkpoints" / "1").mkdir(parents=True)
    with pytest.raises(ValueError, match="is an ict_jax training run directory, not a model's files: "
                                         "ict_jax.resolve_model"):
        ModelSource.from_files(run)


def test_a_tokenizer_with_more_ids_than_the_model_is_refused(tiny_hf_dir, tmp_path):
    small = save_hf(init_model(ModelConfig.tiny(vocab_size=50), seed=0), tmp_path / "small")
    with pytest.raises(ValueError, match="the tokenizer has 100 ids but the model's vocabulary only 50"):
        ModelSource.from_files(small, tokenizer="char").tokenizer()
    assert ModelSource.from_files(tiny_hf_dir, tokenizer="char").tokenizer().vocab_size == 100


def test_auto_compute_dtype_is_resolved_by_one_rule():
    assert resolve_compute_dtype("auto", "cpu") == "float32"
    assert resolve_compute_dtype("auto", "tpu") == resolve_compute_dtype("auto", "gpu") == "bfloat16"
    assert resolve_compute_dtype("bfloat16", "cpu") == "bfloat16" and resolve_compute_dtype("float32", "tpu") == "float32"
    assert resolve_compute_dtype("auto") == resolve_compute_dtype("auto", jax.default_backend())
    assert ModelConfig.tiny().resolved_compute_dtype("tpu") == "bfloat16"


def test_a_tokenizer_from_any_spec():
    assert isinstance(load_tokenizer("char"), CharTokenizer)
    with pytest.raises(FileNotFoundError, match="not installed"):
        load_tokenizer("pkg:no_such_package_xyz/tokenizer.gguf")
    with pytest.raises(FileNotFoundError, match="no tokenizer at"):
        load_tokenizer("no/such/tokenizer")
