"""The frozen base model under a LoRA run's adapters (docs/lora.md "Runs").

A LoRA run's checkpoints hold only the adapters and their optimizer state; the base is recorded by its
identity, ``meta["base_model"]`` (:class:`LoraBase`):

- ``{"kind": "file", "source": model.path, "sha256": {file: sha256}}``: a ``.gguf`` file or a Hugging
  Face directory (``pkg:`` specs as written in the config), by the content of its weight files;
- ``{"kind": "preset", "source": model.preset, "seed": seed, "sha256": {"arrays": ...}}``: a preset
  initialised from the run's init stream, by the content of its arrays;
- ``{"kind": "warm_start", "source": "sft_model", "sha256": {...}}``: the RL phase of a run with an SFT
  warm start: the warm start's adapters were merged into the base (``<run_dir>/sft_model``, relative to
  the run directory) and RL trains fresh adapters on it, so the KL reference is the warm-started policy,
  as in a full-parameter run;
- ``{"kind": "given", ...}``: a model handed to the trainer in Python (recorded, not reloadable).

A resume (:func:`check_base`) and a load of the checkpoint (:func:`load_base`, for ``sample``, ``eval``,
``inspect`` and ``export``) recompute the base's identity and refuse, in one line, a base that differs.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path
from typing import Any

import jax
from flax import nnx

from ict_jax.config import Config, ConfigError
from ict_jax.model.adapters import add_adapters
from ict_jax.model.config import ModelConfig, run_settings
from ict_jax.model.identity import arrays_sha256, weights_sha256
from ict_jax.model.qwen2 import Qwen2, init_model
from ict_jax.model.source import ModelSource
from ict_jax.model.weights import load_hf
from ict_jax.rng import INIT_STREAM, root_key, stream_key
from ict_jax.train.record import SFT_MODEL

#: the checkpoint metadata key of the base's identity
META_KEY = "base_model"


def file_identity(source: str) -> dict[str, Any]:
    """The identity of the model at ``source`` (a path or ``pkg:`` spec) by its weight files."""
    return {"kind": "file", "source": source, "sha256": weights_sha256(source)}


def warm_start_identity(run_dir: str | os.PathLike) -> dict[str, Any]:
    """The identity of a run's SFT warm start, ``<run_dir>/sft_model``, by its weight files."""
    return {"kind": "warm_start", "source": SFT_MODEL, "sha256": weights_sha256(Path(run_dir) / SFT_MODEL)}


def base_state(model: Qwen2) -> Any:
    """The base's parameters: every ``nnx.Param`` that is not a LoRA adapter."""
    return nnx.split(model, nnx.LoRAParam, nnx.Param)[2]


def loaded_identity(cfg: Config, model: Qwen2, *, weights: str | os.PathLike | None = None,
                    given: bool = False) -> dict[str, Any]:
    """The identity of the base a run of ``cfg`` built ``model`` on: ``weights`` (its warm start), a model
    ``given`` in Python, ``model.path`` or ``model.preset``."""
    if weights is not None:
        return warm_start_identity(Path(weights).parent)
    if given:
        return {"kind": "given", "source": "a model given to the trainer",
                "sha256": {"arrays": arrays_sha256(base_state(model))}}
    if cfg.model.path:
        return file_identity(cfg.model.path)
    return {"kind": "preset", "source": cfg.model.preset, "seed": cfg.seed,
            "sha256": {"arrays": arrays_sha256(base_state(model))}}


@dataclasses.dataclass(frozen=True)
class LoraBase:
    """The base of a LoRA run: ``loaded``, the identity of the model its state was built on (what the SFT
    phase, and RL without a warm start, train adapters on); with a warm start (``warm_start``: RL follows
    ``train.sft_steps`` of SFT) the RL phase's base is ``<run_dir>/sft_model``, hashed when first asked for
    (it is written when the warm start finishes)."""

    loaded: dict[str, Any]
    run_dir: Path
    warm_start: bool

    def identity(self, phase: str) -> dict[str, Any]:
        """The identity recorded with a checkpoint of ``phase`` ("sft" or "rl")."""
        if phase == "rl" and self.warm_start:
            return self.warm_start_base
        return self.loaded

    def check(self, checkpointer: Any, step: int, phase: str) -> None:
        """ConfigError (one line) unless checkpoint ``step`` of ``phase`` in ``checkpointer`` (a
        ``train.checkpoints.Checkpointer``) holds adapters trained on this base (:func:`check_base`)."""
        what = "SFT checkpoint" if phase == "sft" else "checkpoint"
        check_base(checkpointer.restore_meta(step).get(META_KEY), self.identity(phase),
                   f"the {what} of step {step} in {checkpointer.directory}")

    @functools.cached_property
    def warm_start_base(self) -> dict[str, Any]:
        if self.loaded["kind"] == "warm_start":
            return self.loaded
        try:
            return warm_start_identity(self.run_dir)
        except FileNotFoundError:
            raise ConfigError(f"--resume: the run's SFT warm start {self.run_dir / SFT_MODEL} is missing: it is the "
                              "base of the run's LoRA adapters after the warm start; start a new run_dir") from None


def describe(identity: dict[str, Any]) -> str:
    """``/models/q.gguf (sha256 1d9614638d18...)``: an identity in a few words."""
    digests = ", ".join(f"{v[:12]}..." for v in (identity.get("sha256") or {}).values()) or "-"
    kind, source = identity.get("kind"), identity.get("source")
    if kind == "warm_start":
        return f"the run's SFT warm start {source} (sha256 {digests})"
    if kind == "preset":
        return f"preset {source} (seed {identity.get('seed')}, sha256 {digests})"
    return f"{source} (sha256 {digests})"


def same_base(recorded: dict[str, Any], current: dict[str, Any]) -> bool:
    """Whether two identities name the same weights (kind and content; a preset also its seed)."""
    keys = ("kind", "sha256", "seed")
    return all(recorded.get(k) == current.get(k) for k in keys)


def check_base(recorded: Any, current: dict[str, Any], where: str) -> None:
    """ConfigError (one line) unless the checkpoint's recorded base (``recorded``, its metadata's
    ``base_model``) is ``current``: its adapters would otherwise resume on other weights."""
    if not isinstance(recorded, dict):
        raise ConfigError(f"--resume: {where} holds LoRA adapters but records no base model (model.lora); "
                          "start a new run_dir")
    if not same_base(recorded, current):
        raise ConfigError(f"--resume: {where} holds LoRA adapters trained on {describe(recorded)}, but the base "
                          f"model is now {describe(current)}; resume with the same base model (model.path) or "
                          "start a new run_dir")


def load_base(meta: dict[str, Any], run_dir: Path, *, mesh: jax.sharding.Mesh | None = None) -> Qwen2:
    """The base of a LoRA checkpoint (its metadata ``meta``; ``run_dir``: the run directory it belongs to)
    with fresh adapters of the checkpoint's spec, the base's identity checked against the recorded one
    (ValueError, one line, when it differs or cannot be rebuilt). The adapters are then restored from the
    checkpoint (``train.model_source.resolve_model``)."""
    recorded, step = meta.get(META_KEY), meta.get("step")
    where = f"the checkpoint of step {step} in {run_dir}"
    if not isinstance(recorded, dict):
        raise ValueError(f"{where} holds LoRA adapters but records no base model")
    mc = ModelConfig(**meta["model_config"])
    settings = dict(compute_dtype=mc.compute_dtype, **run_settings(mc))
    kind, current = recorded.get("kind"), None
    try:
        if kind == "warm_start":
            current = warm_start_identity(run_dir)
            base = load_hf(run_dir / SFT_MODEL, mesh=mesh, dtype=mc.param_dtype, **settings)
        elif kind == "file":
            current = file_identity(str(recorded.get("source")))
            base = ModelSource.from_files(str(recorded.get("source")), **settings).load(mesh=mesh, dtype=mc.param_dtype)
        elif kind == "preset":
            seed = stream_key(root_key(int(recorded.get("seed", 0))), INIT_STREAM)
            base = init_model(mc.replace(lora=None), seed=seed, mesh=mesh)
        else:
            raise ValueError(f"{where} holds LoRA adapters on {describe(recorded)}, which cannot be loaded again "
                             "from the checkpoint: load that base and attach the exported adapter (ict-jax export "
                             "--format peft; ict_jax.load_peft_adapter)")
    except (FileNotFoundError, NotADirectoryError) as e:
        raise ValueError(f"{where} holds LoRA adapters on {describe(recorded)}, which cannot be found: "
                         f"{str(e).splitlines()[0]}") from None
    model = add_adapters(base, mc.lora, seed=0)
    if current is None:  # a preset: by its arrays, as the run hashed them (in the base's dtype)
        current = dict(recorded, sha256={"arrays": arrays_sha256(base_state(model))})
    if not same_base(recorded, current):
        raise ValueError(f"{where} holds LoRA adapters trained on {describe(recorded)}, but that base is now "
                         f"{describe(current)}")
    return model


def peft_base_name(meta: dict[str, Any], run_dir: Path) -> str | None:
    """``base_model_name_or_path`` of a PEFT export of a LoRA checkpoint: the transformers directory its
    adapters sit on (the run's warm start, or ``model.path`` when it is one); None for a ``.gguf`` file,
    a ``pkg:`` spec or a preset."""
    recorded = meta.get(META_KEY) or {}
    if recorded.get("kind") == "warm_start":
        return str((run_dir / SFT_MODEL).absolute())
    source = recorded.get("source") if recorded.get("kind") == "file" else \
        ((meta.get("config") or {}).get("model") or {}).get("path")
    if isinstance(source, str) and not source.startswith("pkg:") and (Path(source) / "config.json").is_file():
        return source
    return None
