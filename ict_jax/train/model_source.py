"""The one resolver of a model spec, :func:`resolve_model`: any spec -> one
:class:`~ict_jax.model.source.ModelSource` that knows its architecture (``.config``), its tokenizer
(``.tokenizer()``) and how its weights load (``.load(mesh=, dtype=)``). Every command goes through it
(``train``, ``sft`` and ``compare`` through the run's parts, ``eval``, ``sample``, ``inspect``,
``diagnose``, ``export``, and ``compile`` through ``aot.compile``); docs/models.md lists the specs.

A spec is

- a training run directory, its ``checkpoints/`` folder or one ``<step>/`` directory: its latest finished
  checkpoint (or ``step``), rebuilt from the ``model_config`` of its metadata (a LoRA run's base rebuilt
  from its recorded identity and checked, ``train.lora_base``), with the tokenizer the run recorded; a run
  with no finished checkpoint but a finished SFT warm start: its ``sft_model``;
- ``preset:<name>``: a preset with random weights (no tokenizer unless one is named);
- anything else the model layer reads (:meth:`~ict_jax.model.source.ModelSource.from_files`): a Hugging
  Face directory (``<run_dir>/sft_model`` with its run's recorded config), a ``.gguf`` file,
  ``pkg:<package>/<file>``, a model split over packages by name or ``pkg:<prefix>``;
- a :class:`~ict_jax.config.Config`: the run's model, ``model.path`` or ``model.preset`` (sized to
  ``model.tokenizer``), with the ``model`` section's dtypes, remat, layer scan, attention and LoRA adapters (fresh,
  from the run's init stream): what training builds and ``ict-jax compile`` compiles.

The resolver lives in ``train/`` because a run directory is train's: its checkpoints are orbax items
this layer writes (``train.checkpoints``) and a LoRA run's base is rebuilt by ``train.lora_base``; the
model layer must not import them (docs/architecture.md, the layer rule), and nothing below ``train/``
resolves a spec.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Literal

import jax
from flax import nnx

from ict_jax.config import Config
from ict_jax.model.config import ModelConfig, resolve_attention, resolve_compute_dtype, run_settings
from ict_jax.model.qwen2 import Qwen2
from ict_jax.model.source import PRESET_PREFIX, ModelSource
from ict_jax.rl.state import split_trainable
from ict_jax.train.checkpoints import (
    Checkpointer,
    abstract_params,
    abstract_tree,
    checkpoint_run_dir,
    resolve_checkpoint_dir,
)
from ict_jax.train.lora_base import load_base
from ict_jax.train.record import SFT_MODEL

__all__ = ["resolve_model"]


def resolve_model(spec: str | os.PathLike | Config, *, tokenizer: str | os.PathLike | None = None,
                  step: int | None = None, checkpoint: bool = False, weights: str | os.PathLike | None = None,
                  adapters: bool = True, platform: str | None = None,
                  missing: Literal["error", "preset"] = "error") -> ModelSource:
    """The :class:`~ict_jax.model.source.ModelSource` of ``spec`` (module docstring: every kind).

    ``tokenizer``: None = the model's own (a run's recorded one), else ``char`` or a tokenizer path.
    ``step``: a checkpoint's step (default: the latest finished one); ``checkpoint``: only a training
    checkpoint is accepted (FileNotFoundError otherwise).

    With a :class:`~ict_jax.config.Config` only: ``weights``, a model directory whose parameters load
    instead of ``model.path``'s or the preset's (the tokenizer stays the run's: a LoRA run resumed after its
    warm start, the warm start's model); ``adapters=False`` leaves ``model.lora``'s fresh adapters off;
    ``platform`` resolves ``model.compute_dtype: auto`` and ``model.attention: auto`` for a target platform
    (:func:`~ict_jax.model.config.resolve_compute_dtype`, :func:`~ict_jax.model.config.resolve_attention`)
    instead of at trace time; ``missing="preset"``:
    a ``model.path`` or tokenizer that is not on this machine gives ``model.preset``'s architecture at its
    own vocabulary (``ict-jax compile`` of a recipe for another machine).

    FileNotFoundError (one line) when there is no model, ValueError for a spec that names one wrongly."""
    if isinstance(spec, Config):
        return _config_source(spec, weights=weights, adapters=adapters, platform=platform, missing=missing)
    if weights is not None or platform is not None or missing != "error" or not adapters:
        raise TypeError("resolve_model: weights, adapters, platform and missing go with a Config")
    text = os.fspath(spec)
    run = _run_source(Path(text), step, tokenizer)
    if run is not None and (run.kind == "checkpoint" or not checkpoint):
        return run
    if checkpoint:
        resolve_checkpoint_dir(text)  # a missing directory: "does not exist"
        raise FileNotFoundError(f"no finished checkpoint in {text!r} (expected a training run directory, its "
                                "checkpoints/ folder or one <step>/ directory)")
    if step is not None:
        raise ValueError(f"step {step}: {text!r} is not a training run or checkpoint directory")
    if text.startswith(PRESET_PREFIX):
        return ModelSource.from_preset(text, tokenizer=tokenizer)
    return ModelSource.from_files(text, tokenizer=tokenizer, run_config=_sft_model_config(Path(text)))


# ------------------------------------------------------------------------------------------------
# A run's model section
# ------------------------------------------------------------------------------------------------
def _config_source(cfg: Config, *, weights: str | os.PathLike | None, adapters: bool, platform: str | None,
                   missing: str) -> ModelSource:
    """The model a run of ``cfg`` builds (:func:`resolve_model` with a Config)."""
    m = cfg.model
    settings = dict(param_dtype=m.param_dtype, **run_settings(m),
                    compute_dtype=m.compute_dtype if platform is None else resolve_compute_dtype(m.compute_dtype,
                                                                                                 platform))
    if platform is not None:  # model.attention: auto, for the target platform too
        settings["attention"] = resolve_attention(m.attention, platform, settings["compute_dtype"])
    kw = dict(lora=m.lora if adapters else None, seed=cfg.seed, **settings)
    if weights is not None:  # the run's tokenizer, recorded as the run records it
        source = ModelSource.from_files(weights, tokenizer=m.tokenizer or m.path or "char", **kw)
        return dataclasses.replace(source, where=f"{weights} (the weights of the run's model)")
    try:
        if m.path:
            return ModelSource.from_files(m.path, tokenizer=m.tokenizer, **kw)
        return ModelSource.from_preset(m.preset, tokenizer=m.tokenizer or "char", **kw)
    except (OSError, ValueError):
        if missing != "preset":
            raise
    source = ModelSource.from_preset(m.preset, tokenizer=None, **kw)
    where = f"preset {m.preset}" + (f" (model.path {m.path!r} is not here)" if m.path else "")
    return dataclasses.replace(source, where=where)


# ------------------------------------------------------------------------------------------------
# A training run directory as a model
# ------------------------------------------------------------------------------------------------
def _run_source(p: Path, step: int | None, tokenizer: str | os.PathLike | None) -> ModelSource | None:
    """A run directory's checkpoint or SFT warm start; None when ``p`` is not a run directory."""
    found = _run_model(p)
    if found is None:
        return None
    kind, where = found
    if kind == "checkpoint":
        return _checkpoint_source(p, where, step, tokenizer)
    if step is not None:
        raise ValueError(f"step {step}: {str(p)!r} has no RL checkpoint, only its SFT warm start")
    run_config = _read_json(where.parent / "config.json")
    spec = tokenizer or _run_tokenizer(run_config) or "char"
    source = ModelSource.from_files(where, tokenizer=spec, run_config=run_config)
    return dataclasses.replace(source, spec=str(p), kind="sft_model", where=f"{where} (the SFT warm start of the run)")


def _run_model(p: Path) -> tuple[str, Path] | None:
    """What a training run directory offers as a model: ``("checkpoint", p)`` when ``p`` is a run directory
    with a finished RL checkpoint (or its ``checkpoints/`` folder, or one ``<step>/`` directory),
    ``("sft_model", <run_dir>/sft_model)`` when it has only its finished SFT warm start; None for anything
    else. A run directory with neither is a FileNotFoundError."""
    if not p.is_dir():
        return None
    if p.name.isdigit() and (p / "params").is_dir():
        return "checkpoint", p
    folder = p / "checkpoints" if (p / "checkpoints").is_dir() else p
    if any(c.name.isdigit() and (c / "params").is_dir() for c in folder.iterdir() if c.is_dir()):
        with Checkpointer(folder, read_only=True) as ck:
            if ck.latest_step() is not None:
                return "checkpoint", p
    if (p / SFT_MODEL / "config.json").is_file():
        return "sft_model", p / SFT_MODEL
    if (p / "checkpoints").is_dir() or (p / "checkpoints_sft").is_dir() or \
            _read_json(p / "config.json") is not None and (p / "metrics.jsonl").is_file():
        raise FileNotFoundError(f"{str(p)!r} is a training run directory without a finished checkpoint or "
                                "sft_model yet: nothing to load")
    return None


def _checkpoint_source(p: Path, where: Path, step: int | None, tokenizer: str | os.PathLike | None) -> ModelSource:
    """Checkpoint ``step`` (default: the latest finished one) of the run at ``where``, read lazily: its
    metadata now, the ``params`` item (no optimizer state) by ``load``."""
    directory, step = resolve_checkpoint_dir(where, step)
    with Checkpointer(directory, read_only=True) as ckpt:
        meta = ckpt.restore_meta(step)
        step = int(meta.get("step", step if step is not None else ckpt.latest_step()))
    if not isinstance(meta.get("model_config"), dict):
        raise ValueError(f"checkpoint of step {step} in {directory} has no model_config in its metadata")
    try:
        config = ModelConfig(**meta["model_config"])
    except TypeError as e:
        raise ValueError(f"checkpoint of step {step} in {directory}: bad model_config in its metadata ({e})") from None
    tree = meta.get("config")
    run_config = (tree, f"the checkpoint of step {step} in {directory}") if isinstance(tree, dict) else \
        _read_json(checkpoint_run_dir(directory) / "config.json")

    def load(mesh: jax.sharding.Mesh | None, dtype: str | None) -> Qwen2:
        with Checkpointer(directory, read_only=True) as ck:
            if config.lora is not None:
                return _lora_checkpoint_model(ck, step, meta, mesh, dtype)
            graphdef, template, _ = abstract_params(config if dtype is None else config.replace(param_dtype=dtype),
                                                    mesh)
            return nnx.merge(graphdef, ck.restore_params(template, step))

    return ModelSource(spec=str(p), kind="checkpoint", config=config, where=f"{p} (checkpoint of step {step})",
                       tokenizer_spec=os.fspath(tokenizer) if tokenizer else meta.get("tokenizer") or None,
                       loader=load, path=str(directory / str(step)), run_config=run_config, meta=meta, step=step)


def _lora_checkpoint_model(ckpt: Checkpointer, step: int, meta: dict[str, Any], mesh: jax.sharding.Mesh | None,
                           dtype: str | None) -> Qwen2:
    """The base of a LoRA checkpoint (rebuilt and checked) with the checkpoint's adapters, cast to ``dtype``."""
    model = load_base(meta, checkpoint_run_dir(ckpt.directory), mesh=mesh)
    graphdef, lora, base = split_trainable(model)
    model = nnx.merge(graphdef, ckpt.restore_params(abstract_tree(lora), step), base)
    if dtype is None:
        return model
    graphdef, state = nnx.split(model)
    return nnx.merge(graphdef, jax.jit(lambda s: jax.tree.map(lambda x: x.astype(dtype), s))(state))


def _sft_model_config(p: Path) -> tuple[dict[str, Any], str] | None:
    """The run's recorded config for ``<run_dir>/sft_model`` given itself; None for anything else (the model
    layer reads an exported directory's own)."""
    return _read_json(p.parent / "config.json") if p.name == SFT_MODEL and p.is_dir() else None


def _read_json(file: Path) -> tuple[dict[str, Any], str] | None:
    try:
        tree = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return (tree, str(file)) if isinstance(tree, dict) else None


def _run_tokenizer(run_config: tuple[dict[str, Any], str] | None) -> str | None:
    """The tokenizer a run used, from its recorded config (``model.tokenizer``, else ``model.path``, else the
    built-in ``char``); None when no config is recorded."""
    model = run_config[0].get("model") if run_config is not None else None
    if not isinstance(model, dict):
        return None
    return model.get("tokenizer") or model.get("path") or "char"
