"""A training checkpoint written as a model others load: a Hugging Face directory (LoRA adapters merged) or a
PEFT adapter directory (docs/checkpoints.md, docs/lora.md). ``ict-jax export`` calls it."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ict_jax.model.peft import export_model
from ict_jax.model.source import RUN_CONFIG_FILE, ModelSource
from ict_jax.train.checkpoints import checkpoint_run_dir
from ict_jax.train.lora_base import peft_base_name
from ict_jax.train.model_source import resolve_model


def export_checkpoint(ckpt_dir: str | os.PathLike | ModelSource, out_dir: str | Path, *, step: int | None = None,
                      dtype: str | None = None, format: str = "merged") -> Path:
    """Write checkpoint ``step`` (default: the latest) of ``ckpt_dir`` (a run directory, its ``checkpoints/``
    folder or one ``<step>/`` directory, or its source already resolved by
    :func:`~ict_jax.train.model_source.resolve_model`) at ``out_dir``, which must not exist or be empty:
    ``format="merged"`` a Hugging Face directory (``config.json`` + safetensors; LoRA adapters merged into
    the weights), ``"peft"`` the LoRA adapters alone as a PEFT adapter directory
    (:func:`ict_jax.model.peft.export_model`). The run's config tree goes beside it as
    :data:`~ict_jax.model.source.RUN_CONFIG_FILE`, so that the commands that read the exported model
    (``ict-jax eval``, ``inspect``) use the run's template, lengths and evaluation settings."""
    source = ckpt_dir if isinstance(ckpt_dir, ModelSource) else resolve_model(ckpt_dir, step=step, checkpoint=True)
    if source.kind != "checkpoint":
        raise FileNotFoundError(f"{source.spec!r} is not a training checkpoint")
    model, meta = source.load(), source.meta or {}
    # base_model_name_or_path only for a transformers directory (not a .gguf or pkg: spec, not a preset)
    base = peft_base_name(meta, checkpoint_run_dir(Path(source.path).parent))
    out = export_model(model, out_dir, format=format, dtype=dtype, base_model_name_or_path=base)
    if isinstance(meta.get("config"), dict):
        (Path(out) / RUN_CONFIG_FILE).write_text(json.dumps(meta["config"], indent=2))
    return out
