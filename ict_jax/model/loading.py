"""Former names of model loading, each with a DeprecationWarning naming what replaces it (removed in
ict_jax 0.3.0, ``ict_jax.deprecation``). A model spec of any kind resolves through
:func:`ict_jax.resolve_model` (docs/models.md)::

    source = ict_jax.resolve_model("qwen2.5-coder-0.5b-instruct")   # or a directory, .gguf, pkg:, run, preset:
    tok = source.tokenizer()
    model = source.load(mesh=mesh, dtype="bfloat16")

The model layer's own kinds are :class:`ict_jax.model.source.ModelSource` values
(:meth:`~ict_jax.model.source.ModelSource.from_files`), a tokenizer spec loads with
:func:`ict_jax.model.tokenizers.load_tokenizer` (formerly ``load_tokenizer_spec`` here) and a ``pkg:``
spec's file is :func:`ict_jax.model.packaged.resolve_path` (formerly here too): those two former names are
the objects at their new homes (:class:`~ict_jax.deprecation.MovedNames`); the others are functions that
warn when called.
"""

from __future__ import annotations

import os
from typing import Any

from ict_jax.deprecation import REMOVED_IN, MovedNames, warn
from ict_jax.model.config import ModelConfig
from ict_jax.model.source import ModelSource, run_directory_hint

__all__ = ["load_model_and_tokenizer", "load_model_tokenizer", "load_model_weights", "training_run_hint",
           "load_model_config"]

# former names whose objects moved (the same function at its new home, warned when read)
_FORMER = MovedNames(__name__, {"resolve_path": "ict_jax.model.packaged.resolve_path",
                                "load_tokenizer_spec": "ict_jax.model.tokenizers.load_tokenizer"},
                     removed_in=REMOVED_IN)


def __getattr__(name: str) -> Any:
    return _FORMER.resolve(name)


def training_run_hint(path: str) -> str | None:
    """Deprecated: :func:`ict_jax.model.source.run_directory_hint` (:func:`ict_jax.resolve_model` reads a
    run directory)."""
    warn("ict_jax.model.loading.training_run_hint", "ict_jax.resolve_model, which reads a training run directory",
         removed_in=REMOVED_IN)
    return run_directory_hint(path)


def load_model_tokenizer(path: str | os.PathLike, tokenizer: str | os.PathLike | None = None) -> Any:
    """Deprecated: ``ict_jax.resolve_model(path, tokenizer=tokenizer).tokenizer()``."""
    warn("ict_jax.model.loading.load_model_tokenizer", "ict_jax.resolve_model(spec, tokenizer=...).tokenizer()",
         removed_in=REMOVED_IN)
    return ModelSource.from_files(path, tokenizer=tokenizer).tokenizer()


def load_model_weights(path: str | os.PathLike, *, mesh: Any = None, dtype: str | None = None,
                       **config_overrides: Any) -> Any:
    """Deprecated: ``ict_jax.resolve_model(path).load(mesh=mesh, dtype=dtype)``."""
    warn("ict_jax.model.loading.load_model_weights", "ict_jax.resolve_model(spec).load(mesh=..., dtype=...)",
         removed_in=REMOVED_IN)
    return ModelSource.from_files(path, **config_overrides).load(mesh=mesh, dtype=dtype)


def load_model_and_tokenizer(path: str | os.PathLike, *, mesh: Any = None, dtype: str | None = None,
                             tokenizer: str | os.PathLike | None = None, **config_overrides: Any) -> tuple[Any, Any]:
    """Deprecated: ``source = ict_jax.resolve_model(path, tokenizer=tokenizer)``, then ``source.load(mesh=,
    dtype=)`` and ``source.tokenizer()``. ``(Qwen2, Tokenizer)`` of a Hugging Face directory, a ``.gguf``
    file, ``pkg:<package>/<file>`` or a model split over packages."""
    warn("ict_jax.model.loading.load_model_and_tokenizer",
         "ict_jax.resolve_model(spec, tokenizer=...) and its .load() and .tokenizer()", removed_in=REMOVED_IN)
    source = ModelSource.from_files(path, tokenizer=tokenizer, **config_overrides)
    tok = source.tokenizer()  # fails before the weights load
    return source.load(mesh=mesh, dtype=dtype), tok


def load_model_config(path: str | os.PathLike, *, dtype: str | None = None, **config_overrides: Any) -> ModelConfig:
    """Deprecated: ``ict_jax.resolve_model(path).config``."""
    warn("ict_jax.model.loading.load_model_config", "ict_jax.resolve_model(spec).config", removed_in=REMOVED_IN)
    if dtype is not None:
        config_overrides["param_dtype"] = dtype
    return ModelSource.from_files(path, **config_overrides).config
