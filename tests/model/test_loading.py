"""ict_jax.model.loading: the former names of model loading still work, each with a DeprecationWarning that
names what replaces it, and give what the model source gives (the same weights, dtypes and tokenizers)."""

import re

import jax
import numpy as np
import pytest
from flax import nnx

import ict_jax
from ict_jax.model import loading, packaged
from ict_jax.model.source import ModelSource
from ict_jax.model.tokenizers import CharTokenizer, load_tokenizer


def _warns(name: str):
    return pytest.warns(DeprecationWarning, match=re.escape(f"ict_jax.model.loading.{name} is deprecated and will be "
                                                             "removed in ict_jax 0.3.0: use "))


def _same_weights(a, b):
    for x, y in zip(jax.tree.leaves(nnx.state(a, nnx.Param)), jax.tree.leaves(nnx.state(b, nnx.Param)), strict=True):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_the_former_names_warn_and_give_what_the_source_gives(tiny_hf_dir, tmp_path):
    source = ModelSource.from_files(tiny_hf_dir, tokenizer="char")
    want = source.load(dtype="bfloat16")
    with _warns("load_model_and_tokenizer"):
        model, tok = loading.load_model_and_tokenizer(tiny_hf_dir, tokenizer="char", dtype="bfloat16")
    _same_weights(model, want)
    assert model.config == want.config and isinstance(tok, CharTokenizer)
    with _warns("load_model_and_tokenizer"):  # the facade's name is the same function
        ict_jax.load_model_and_tokenizer(tiny_hf_dir, tokenizer="char")
    assert "load_model_and_tokenizer" not in ict_jax.__all__ and "resolve_model" in ict_jax.__all__
    with _warns("load_model_weights"):
        _same_weights(loading.load_model_weights(tiny_hf_dir, dtype="bfloat16"), want)
    with _warns("load_model_config"):
        assert loading.load_model_config(tiny_hf_dir, dtype="bfloat16", scan_layers=False) == \
            ModelSource.from_files(tiny_hf_dir, param_dtype="bfloat16", scan_layers=False).config
    with _warns("load_model_tokenizer"):
        assert isinstance(loading.load_model_tokenizer(tiny_hf_dir, "char"), CharTokenizer)
    with _warns("load_tokenizer_spec"):  # moved names: the objects at their new homes, warned when read
        assert loading.load_tokenizer_spec is load_tokenizer
    assert isinstance(load_tokenizer("char"), CharTokenizer)
    with _warns("resolve_path"):
        assert loading.resolve_path is packaged.resolve_path
    assert packaged.resolve_path("plain/path") == "plain/path"
    with pytest.raises(AttributeError, match="has no attribute 'load_everything'"):
        loading.load_everything  # noqa: B018
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    with _warns("training_run_hint"):
        assert "is an ict_jax training run directory" in loading.training_run_hint(str(run))
    with _warns("load_model_and_tokenizer"), pytest.raises(ValueError, match="training run directory"):
        loading.load_model_and_tokenizer(run)
