"""A model named by a spec, resolved into one value, :class:`ModelSource`: its architecture (``.config``,
read without the weights), its tokenizer (``.tokenizer()``) and how its weights load (``.load(mesh=,
dtype=)``), with fresh LoRA adapters when asked for (docs/models.md).

This module builds the sources the model layer reads itself:

- :meth:`ModelSource.from_files`: a Hugging Face directory (``config.json`` + safetensors), a ``.gguf``
  file, ``pkg:<package>/<file>`` or a model split over packages (by name or ``pkg:<prefix>``,
  :mod:`ict_jax.model.packaged`);
- :meth:`ModelSource.from_preset`: a preset of :meth:`ModelConfig.presets` (``preset:<name>``) with random
  weights from a seed's init stream, its vocabulary sized to its tokenizer for the small presets.

The one function the commands call, :func:`ict_jax.train.model_source.resolve_model`, takes any spec: it
adds a training run directory (its last checkpoint, or its SFT warm start), which only ``train/`` can read
(orbax checkpoints, the base of a LoRA run), as values of this same type, and the config's ``model``
section. The layer rule keeps that function in ``train/``: nothing below it resolves a spec.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Callable

import jax

from ict_jax.config import ConfigError, LoraSection
from ict_jax.model.adapters import attach_lora
from ict_jax.model.config import ModelConfig
from ict_jax.model.gguf import config_from_gguf, load_gguf
from ict_jax.model.gguf_reader import open_gguf, release_gguf
from ict_jax.model.lora import lora_spec
from ict_jax.model.packaged import resolve_path
from ict_jax.model.qwen2 import Qwen2, init_model
from ict_jax.model.tokenizers import Tokenizer, load_tokenizer
from ict_jax.model.weights import load_hf
from ict_jax.rng import INIT_STREAM, root_key, stream_key

#: presets sized for their tokenizer: their vocabulary is the tokenizer's (the CharTokenizer's 100 ids)
TOKENIZER_SIZED_PRESETS = ("tiny", "demo")
#: the spec prefix of a preset: ``preset:tiny``
PRESET_PREFIX = "preset:"
#: In a Hugging Face directory written by ``ict-jax export``: the config tree of the run the weights come
#: from (its template, lengths and evaluation settings travel with the model).
RUN_CONFIG_FILE = "ict_jax_config.json"
#: the files that make a Hugging Face directory carry its own tokenizer
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "tokenizer_config.json")
#: every kind of spec, for the error that names none of them
SPEC_KINDS = ("a Hugging Face checkpoint directory, a .gguf file, pkg:<package>/<file>, a model split over packages "
              "(ict-jax info lists them), a training run directory or preset:<name>")

#: ``(mesh, dtype) -> Qwen2``: how a source's weights load (``dtype``: the parameter dtype, None = its own)
Loader = Callable[[Any, "str | None"], Qwen2]


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """A resolved model spec: what it is, its architecture and tokenizer, and how its weights load.

    - ``spec``: as given; ``kind``: ``hf``, ``gguf``, ``preset``, ``checkpoint`` (a training run's
      checkpoint) or ``sft_model`` (a run's SFT warm start);
    - ``config``: the :class:`ModelConfig` :meth:`load` builds (with ``dtype=None``), its LoRA adapters
      included: what the memory pre-flight and ``ict-jax compile`` compile before any weight is read;
    - ``tokenizer_spec``: how its tokenizer loads again (``char``, a path or a ``pkg:`` spec; recorded
      with each checkpoint); None when it has none of its own (:meth:`tokenizer` says what to pass);
    - ``where``: what was found, for messages (``runs/x (checkpoint of step 4)``); ``path``: the file or
      directory it reads (None for a preset);
    - ``run_config``: (the config tree it was trained with, where that was read) when one was recorded (a
      run's checkpoint or config, an exported directory's :data:`RUN_CONFIG_FILE`); ``meta`` and ``step``:
      a checkpoint's metadata and step;
    - ``lora`` / ``seed``: fresh adapters :meth:`load` attaches (the config's ``model.lora``; A from the init
      stream of ``seed``, which also draws a preset's weights); None = none.
    """

    spec: str
    kind: str
    config: ModelConfig
    tokenizer_spec: str | None
    where: str
    loader: Loader = dataclasses.field(repr=False, compare=False)
    path: str | None = None
    run_config: tuple[dict[str, Any], str] | None = None
    meta: dict[str, Any] | None = dataclasses.field(default=None, repr=False)
    step: int | None = None
    lora: LoraSection | None = None
    seed: int = 0

    # -- what it is ------------------------------------------------------------------------------
    def tokenizer(self) -> Tokenizer:
        """The tokenizer (loaded once), checked against the model's vocabulary: ValueError when it can
        produce ids the model does not have; FileNotFoundError (one line, saying what to pass) when the
        model carries none."""
        cached = self.__dict__.get("_tokenizer")
        if cached is not None:
            return cached
        if self.tokenizer_spec is None:  # a checkpoint that names none is a ValueError, as it always was
            raise (ValueError if self.kind == "checkpoint" else FileNotFoundError)(self._no_tokenizer())
        tok = load_tokenizer(self.tokenizer_spec)
        if tok.vocab_size > self.config.vocab_size:
            raise ValueError(f"{self.spec}: the tokenizer has {tok.vocab_size} ids but the model's vocabulary only "
                             f"{self.config.vocab_size}: wrong tokenizer for this model?")
        object.__setattr__(self, "_tokenizer", tok)  # frozen: a cache, not a field
        return tok

    def _no_tokenizer(self) -> str:
        if self.kind == "checkpoint":
            return f"{self.spec!r}: the checkpoint names no tokenizer; pass --tokenizer char|PATH"
        if self.kind == "preset":
            return (f"{self.spec}: a preset has no tokenizer of its own; name one (tokenizer='char' or a path), "
                    "which also sizes the tiny and demo presets' vocabulary")
        return (f"{self.spec}: no tokenizer files (tokenizer.json, vocab.json) in the model directory; name one "
                "(tokenizer=PATH, --tokenizer PATH), or 'char' for the built-in CharTokenizer")

    # -- its weights -----------------------------------------------------------------------------
    def load(self, *, mesh: jax.sharding.Mesh | None = None, dtype: str | None = None) -> Qwen2:
        """The :class:`Qwen2` with its weights: each parameter placed directly in its rule-table sharding
        on ``mesh`` (else on the default device); ``dtype``: the parameter dtype (default the config's:
        float32 for a file, as trained for a checkpoint). With ``lora`` the model carries fresh adapters
        (:func:`ict_jax.model.adapters.attach_lora`)."""
        model = self.loader(mesh, dtype)
        return attach_lora(model, self.lora, self.seed) if self.lora is not None else model

    # -- the model layer's own sources ---------------------------------------------------------------
    @classmethod
    def from_files(cls, spec: str | os.PathLike, *, tokenizer: str | os.PathLike | None = None,
                   run_config: tuple[dict[str, Any], str] | None = None, lora: LoraSection | None = None,
                   seed: int = 0, **settings: Any) -> "ModelSource":
        """A Hugging Face directory, a ``.gguf`` file, ``pkg:<package>/<file>`` or a model split over
        packages (resolved by :func:`ict_jax.model.packaged.resolve_path`; a split model is assembled
        into the cache the first time). Its architecture is read now (``config.json``, or the GGUF's
        metadata and tensor list), the weights by :meth:`load`.

        ``tokenizer``: None = the model's own (the directory's tokenizer files, the GGUF's embedded one;
        for a directory without tokenizer files whose recorded run used ``char``, the
        :class:`CharTokenizer`), else ``char`` or a tokenizer path. ``run_config``: the recorded config
        tree when the caller knows it (default: the directory's :data:`RUN_CONFIG_FILE`). ``settings`` go
        to the :class:`ModelConfig` (``param_dtype``, ``compute_dtype``, ``remat``, ``scan_layers``).
        FileNotFoundError when there is no model; ValueError for a training run directory (it says what to
        pass instead)."""
        shown, path = os.fspath(spec), resolve_path(spec)
        hint = run_directory_hint(path)
        if hint is not None:
            raise ValueError(hint)
        if os.path.isfile(path) and path.endswith(".gguf"):
            kind, config = "gguf", config_from_gguf(open_gguf(path), path, **settings)
            own: str | None = shown
        elif os.path.isfile(os.path.join(path, "config.json")):
            kind, config = "hf", ModelConfig.from_hf(path).replace(**settings)
            run_config = run_config or _read_run_config(Path(path) / RUN_CONFIG_FILE)
            own = shown if any(os.path.exists(os.path.join(path, f)) for f in TOKENIZER_FILES) else \
                _recorded_char(run_config)
        else:
            raise FileNotFoundError(f"no model at {shown!r}: expected {SPEC_KINDS}")
        return cls(spec=shown, kind=kind, config=_with_lora(config, lora), where=shown, path=path,
                   tokenizer_spec=os.fspath(tokenizer) if tokenizer is not None else own, run_config=run_config,
                   loader=_file_loader(kind, path, settings), lora=lora, seed=seed)

    @classmethod
    def from_preset(cls, name: str, *, tokenizer: str | os.PathLike | None = "char", lora: LoraSection | None = None,
                    seed: int = 0, **settings: Any) -> "ModelSource":
        """The preset ``name`` (:meth:`ModelConfig.presets`) with random weights from the init stream of
        ``seed`` (``fold_in(PRNGKey(seed), INIT_STREAM)``, ``ict_jax.rng``). ``tokenizer``: its tokenizer
        (``char`` or a path); the small presets (:data:`TOKENIZER_SIZED_PRESETS`) take its vocabulary;
        None: no tokenizer, the preset's own vocabulary. ConfigError when the tokenizer has more ids than
        the preset; ``settings`` as :meth:`from_files`."""
        if name.startswith(PRESET_PREFIX):
            name = name[len(PRESET_PREFIX):]
        kw = dict(settings)
        spec = os.fspath(tokenizer) if tokenizer is not None else None
        tok = load_tokenizer(spec) if spec is not None else None
        if tok is not None and name in TOKENIZER_SIZED_PRESETS:
            kw["vocab_size"] = tok.vocab_size
        config = ModelConfig.preset(name, **kw)
        if tok is not None and tok.vocab_size > config.vocab_size:
            raise ConfigError(f"model.preset: {name} has {config.vocab_size} token ids but the tokenizer needs "
                              f"{tok.vocab_size}")

        def load(mesh: Any, dtype: str | None) -> Qwen2:
            base = config if dtype is None else config.replace(param_dtype=dtype)
            return init_model(base, seed=stream_key(root_key(seed), INIT_STREAM), mesh=mesh)

        source = cls(spec=PRESET_PREFIX + name, kind="preset", config=_with_lora(config, lora), tokenizer_spec=spec,
                     where=f"preset {name}", loader=load, lora=lora, seed=seed)
        if tok is not None:
            object.__setattr__(source, "_tokenizer", tok)  # loaded once: it sized the preset
        return source


def _with_lora(config: ModelConfig, lora: LoraSection | None) -> ModelConfig:
    """``config`` with the adapters of ``lora`` (unchanged when it is None or off)."""
    spec = lora_spec(lora, config.num_layers) if lora is not None else None
    return config if spec is None else config.replace(lora=spec)


def _file_loader(kind: str, path: str, settings: dict[str, Any]) -> Loader:
    """The loader of a Hugging Face directory or a ``.gguf`` file with ``settings``."""
    def load(mesh: Any, dtype: str | None) -> Qwen2:
        kw = dict(settings, **({"param_dtype": dtype} if dtype is not None else {}))
        if kind == "hf":
            return load_hf(path, mesh=mesh, **kw)
        model = load_gguf(path, mesh=mesh, **kw)[0]
        release_gguf()  # the model is built: the parsed header is not needed any more
        return model

    return load


def _read_run_config(file: Path) -> tuple[dict[str, Any], str] | None:
    """(the config tree in ``file``, ``file``) when it holds a JSON object; None otherwise."""
    try:
        tree = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return (tree, str(file)) if isinstance(tree, dict) else None


def _recorded_char(run_config: tuple[dict[str, Any], str] | None) -> str | None:
    """``char`` when the recorded run used the built-in CharTokenizer (an exported directory of such a run
    carries no tokenizer files), else None."""
    model = run_config[0].get("model") if run_config is not None else None
    return "char" if isinstance(model, dict) and model.get("tokenizer") == "char" else None


def run_directory_hint(path: str | os.PathLike) -> str | None:
    """For a training run directory (or its ``checkpoints/`` folder) given where a model's files are
    expected: what to pass instead. None for anything else."""
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
    return (f"{str(p)!r} is an ict_jax training run directory, not a model's files: ict_jax.resolve_model (which "
            f"every command calls) reads its last checkpoint{alt}; or export one: ict-jax export --checkpoint "
            f"{p} --out DIR")
