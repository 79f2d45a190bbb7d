"""A run's model and tokenizer from its ``model`` section: loaded from ``model.path`` (a Hugging Face
directory, a ``.gguf`` file or ``pkg:<package>/<file>``) or a randomly initialised ``model.preset``, with
LoRA adapters when ``model.lora.enabled`` (:func:`with_adapters`). Training loads them; ``ict-jax compile``
reads the same architecture and token ids without the weights."""

from __future__ import annotations

import os
from typing import Any

import jax

from ict_jax.config import Config, ConfigError
from ict_jax.model.adapters import add_adapters
from ict_jax.model.config import ModelConfig
from ict_jax.model.loading import load_model_and_tokenizer, load_model_config, load_model_tokenizer, load_tokenizer_spec
from ict_jax.model.lora import lora_spec
from ict_jax.model.qwen2 import Qwen2, init_model
from ict_jax.model.tokenizers import Tokenizer
from ict_jax.model.weights import load_hf
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


def init_key(cfg: Config) -> jax.Array:
    """The run's init stream, ``fold_in(PRNGKey(seed), INIT_STREAM)``: a preset's weights and the LoRA
    adapters' A (``ict_jax.rng``)."""
    return stream_key(root_key(cfg.seed), INIT_STREAM)


def with_lora(cfg: Config, model_config: ModelConfig) -> ModelConfig:
    """``model_config`` with the adapters of ``model.lora`` (unchanged when LoRA is off): the architecture
    a run of ``cfg`` trains, for compiling it without the weights."""
    spec = lora_spec(cfg.model.lora, model_config.num_layers)
    return model_config if spec is None else model_config.replace(lora=spec)


def with_adapters(cfg: Config, model: Qwen2) -> Qwen2:
    """``model`` with fresh LoRA adapters of ``model.lora`` (A from the run's init stream, B = 0: the
    outputs do not change); ``model`` itself when LoRA is off or it has adapters already. For a preset
    this is the model ``init_model(config with the adapters, init key)`` builds in one go."""
    spec = lora_spec(cfg.model.lora, model.config.num_layers)
    if spec is None or model.config.lora is not None:
        return model
    return add_adapters(model, spec, seed=init_key(cfg))


def build_model_and_tokenizer(cfg: Config, mesh: jax.sharding.Mesh, *, weights: str | os.PathLike | None = None
                              ) -> tuple[Qwen2, Tokenizer, str]:
    """(model, tokenizer, tokenizer spec). ``model.path``: an HF directory or a ``.gguf`` file (or
    ``pkg:<package>/<file>``, or a real model split over packages, docs/models.md); otherwise a
    ``model.preset`` initialised from the run's init stream (:func:`init_key`), its vocabulary sized to the
    tokenizer for the small presets (``model.tokenizer``: ``char`` = the built-in CharTokenizer).
    ``weights``: a Hugging Face directory whose parameters are loaded instead (a resumed LoRA run's warm
    start, its base); the tokenizer stays the run's. With ``model.lora.enabled`` the model carries fresh
    adapters (:func:`with_adapters`)."""
    m = cfg.model
    if weights is not None:
        spec = m.tokenizer or m.path or "char"
        tok = load_model_tokenizer(m.path, m.tokenizer) if m.path else load_tokenizer_spec(spec)
        model = load_hf(weights, mesh=mesh, dtype=m.param_dtype, **model_overrides(cfg))
        return with_adapters(cfg, model), tok, spec
    if m.path:
        model, tok = load_model_and_tokenizer(m.path, mesh=mesh, dtype=m.param_dtype, tokenizer=m.tokenizer,
                                              **model_overrides(cfg))
        return with_adapters(cfg, model), tok, m.tokenizer or m.path
    mc, tok, spec = preset_architecture(cfg)
    return with_adapters(cfg, init_model(mc, seed=init_key(cfg), mesh=mesh)), tok, spec


def preset_architecture(cfg: Config) -> tuple[ModelConfig, Tokenizer, str]:
    """(``model.preset`` sized to the run's tokenizer, the tokenizer, its spec); ConfigError when the
    tokenizer has more ids than the preset."""
    m = cfg.model
    spec = m.tokenizer or "char"
    tok = load_tokenizer_spec(spec)
    mc = preset_config(cfg, vocab_size=tok.vocab_size)
    if tok.vocab_size > mc.vocab_size:
        raise ConfigError(f"model.preset: {m.preset} has {mc.vocab_size} token ids but the tokenizer needs "
                          f"{tok.vocab_size}")
    return mc, tok, spec


def run_architecture(cfg: Config) -> tuple[ModelConfig, Tokenizer, str]:
    """(model config, tokenizer, tokenizer spec) of a run, without the weights: the architecture
    :func:`build_model_and_tokenizer` will build (``model.path``'s config.json or GGUF metadata, or the
    preset sized to the tokenizer), so that the run's programs can be compiled and checked (the memory
    pre-flight) before the weights load; with ``model.lora.enabled`` it carries the adapters
    (:func:`with_lora`), so that the pre-flight counts the LoRA train state. Raises as loading would (a
    missing path, a tokenizer with more ids than the model)."""
    m = cfg.model
    if not m.path:
        mc, tok, spec = preset_architecture(cfg)
        return with_lora(cfg, mc), tok, spec
    tok = load_model_tokenizer(m.path, m.tokenizer)
    mc = load_model_config(m.path, dtype=m.param_dtype, **model_overrides(cfg))
    if tok.vocab_size > mc.vocab_size:
        raise ValueError(f"{m.path}: the tokenizer has {tok.vocab_size} ids but the model's vocabulary only "
                         f"{mc.vocab_size}: wrong tokenizer for this model?")
    return with_lora(cfg, mc), tok, m.tokenizer or m.path


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
