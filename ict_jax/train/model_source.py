"""A run's model and tokenizer from its ``model`` section: loaded from ``model.path`` (a Hugging Face
directory, a ``.gguf`` file or ``pkg:<package>/<file>``) or a randomly initialised ``model.preset``.
Training loads them; ``ict-jax compile`` reads the same architecture and token ids without the weights."""

from __future__ import annotations

from typing import Any

import jax

from ict_jax.config import Config, ConfigError
from ict_jax.model.config import ModelConfig
from ict_jax.model.loading import (load_model_and_tokenizer, load_model_config, load_model_tokenizer,
                                   load_tokenizer_spec)
from ict_jax.model.qwen2 import Qwen2, init_model
from ict_jax.model.tokenizers import Tokenizer
from ict_jax.rng import INIT_STREAM, root_key, stream_key

#: presets sized for the tokenizer of the run: their vocabulary is the tokenizer's (the demo's 100 ids)
TOKENIZER_SIZED_PRESETS = ("tiny", "demo")


def model_overrides(cfg: Config) -> dict[str, Any]:
    """The ``model`` section's settings a loaded checkpoint's :class:`ModelConfig` takes."""
    m = cfg.model
    return dict(compute_dtype=m.compute_dtype, remat=m.remat, scan_layers=m.scan_layers)


def preset_config(cfg: Config, *, vocab_size: int | None = None, compute_dtype: str | None = None) -> ModelConfig:
    """``model.preset``'s architecture with the ``model`` section's dtypes, remat and layer scan.
    ``vocab_size``: the tokenizer's, for a preset sized to it (:data:`TOKENIZER_SIZED_PRESETS`);
    ``compute_dtype``: resolved for a target platform (default ``model.compute_dtype``)."""
    m = cfg.model
    kw = dict(model_overrides(cfg), param_dtype=m.param_dtype)
    if compute_dtype is not None:
        kw["compute_dtype"] = compute_dtype
    if vocab_size is not None and m.preset in TOKENIZER_SIZED_PRESETS:
        kw["vocab_size"] = vocab_size
    return ModelConfig.preset(m.preset, **kw)


def build_model_and_tokenizer(cfg: Config, mesh: jax.sharding.Mesh) -> tuple[Qwen2, Tokenizer, str]:
    """(model, tokenizer, tokenizer spec). ``model.path``: an HF directory or a ``.gguf`` file (or
    ``pkg:<package>/<file>``, or a real model split over packages, docs/models.md); otherwise a
    ``model.preset`` initialised from the run's init stream
    (``fold_in(PRNGKey(seed), INIT_STREAM)``), its vocabulary sized to the tokenizer for the small
    presets (``model.tokenizer``: ``char`` = the built-in CharTokenizer)."""
    m = cfg.model
    if m.path:
        model, tok = load_model_and_tokenizer(m.path, mesh=mesh, dtype=m.param_dtype, tokenizer=m.tokenizer,
                                              **model_overrides(cfg))
        return model, tok, m.tokenizer or m.path
    spec = m.tokenizer or "char"
    tok = load_tokenizer_spec(spec)
    mc = preset_config(cfg, vocab_size=tok.vocab_size)
    if tok.vocab_size > mc.vocab_size:
        raise ConfigError(f"model.preset: {m.preset} has {mc.vocab_size} token ids but the tokenizer needs "
                          f"{tok.vocab_size}")
    return init_model(mc, seed=stream_key(root_key(cfg.seed), INIT_STREAM), mesh=mesh), tok, spec


def run_architecture(cfg: Config) -> tuple[ModelConfig, Tokenizer, str]:
    """(model config, tokenizer, tokenizer spec) of a run, without the weights: the architecture
    :func:`build_model_and_tokenizer` will build (``model.path``'s config.json or GGUF metadata, or the
    preset sized to the tokenizer), so that the run's programs can be compiled and checked (the memory
    pre-flight) before the weights load. Raises as loading would (a missing path, a tokenizer with more
    ids than the model)."""
    m = cfg.model
    if not m.path:
        spec = m.tokenizer or "char"
        tok = load_tokenizer_spec(spec)
        mc = preset_config(cfg, vocab_size=tok.vocab_size)
        if tok.vocab_size > mc.vocab_size:
            raise ConfigError(f"model.preset: {m.preset} has {mc.vocab_size} token ids but the tokenizer needs "
                              f"{tok.vocab_size}")
        return mc, tok, spec
    tok = load_model_tokenizer(m.path, m.tokenizer)
    mc = load_model_config(m.path, dtype=m.param_dtype, **model_overrides(cfg))
    if tok.vocab_size > mc.vocab_size:
        raise ValueError(f"{m.path}: the tokenizer has {tok.vocab_size} ids but the model's vocabulary only "
                         f"{mc.vocab_size}: wrong tokenizer for this model?")
    return mc, tok, m.tokenizer or m.path


def run_tokenizer(cfg: Config) -> Tokenizer | None:
    """The tokenizer a run of ``cfg`` would use, without its model's weights; None when ``model.path``
    is not on this machine (a recipe's placeholder) or names no tokenizer."""
    m = cfg.model
    try:
        if not m.path:
            return load_tokenizer_spec(m.tokenizer or "char")
        return load_model_tokenizer(m.path, m.tokenizer)
    except (OSError, ValueError):
        return None
