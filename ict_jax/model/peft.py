"""LoRA adapters in the format Hugging Face PEFT reads and writes, and export (merged or adapter).

A PEFT LoRA adapter directory holds ``adapter_config.json`` (``peft_type: LORA``, ``r``, ``lora_alpha``,
``target_modules``, ...) and ``adapter_model.safetensors`` with, per adapted ``nn.Linear`` of the base
model (``[out, in]`` weights, ``y = x W^T``)::

    base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight   [r, in]
    base_model.model.model.layers.{i}.self_attn.q_proj.lora_B.weight   [out, r]

and ``y = base(x) + (lora_alpha / r) lora_B(lora_A(x))``. Ours are ``A [in.., r]`` and ``B [r, out..]`` per
layer (``model.lora``), so ``lora_A = A.reshape(-1, r).T`` and ``lora_B = B.reshape(r, -1).T``.
``peft.PeftModel.from_pretrained(Qwen2ForCausalLM(...), dir)`` loads what :func:`save_peft_adapter`
writes and gives our model's logits (tests/model/test_lora.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal

import jax
import numpy as np
from flax import nnx

from ict_jax.model.adapters import add_adapters, merge_adapters, split_adapters
from ict_jax.model.config import LORA_MODULES, LoraSpec
from ict_jax.model.lora import adapter_keys, peft_module_name, regex_targets
from ict_jax.model.qwen2 import Qwen2
from ict_jax.model.weights import WeightError, save_hf, written_aside

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
_PREFIX = "base_model.model."


def peft_tensor_names(target: str, layer: int) -> tuple[str, str]:
    """The safetensors keys of ``target``'s ``(lora_A, lora_B)`` in ``layer``."""
    module = _PREFIX + peft_module_name(target, layer)
    return f"{module}.lora_A.weight", f"{module}.lora_B.weight"


def peft_state_dict(model: Qwen2, dtype: str | None = None) -> dict[str, np.ndarray]:
    """The model's adapters as PEFT-named numpy arrays (``lora_A [r, in]``, ``lora_B [out, r]`` per layer)."""
    spec = _spec_of(model)
    lora = model.layers.lora
    out: dict[str, np.ndarray] = {}
    for target in spec.targets:
        a_key, b_key = adapter_keys(LORA_MODULES[target][0])
        a = np.asarray(jax.device_get(getattr(lora, a_key)[...]))  # [L, *in, r]
        b = np.asarray(jax.device_get(getattr(lora, b_key)[...]))  # [L, r, *out]
        if dtype is not None:
            a, b = a.astype(jax.numpy.dtype(dtype)), b.astype(jax.numpy.dtype(dtype))
        for i in range(model.config.num_layers):
            name_a, name_b = peft_tensor_names(target, i)
            out[name_a] = np.ascontiguousarray(a[i].reshape(-1, spec.rank).T)
            out[name_b] = np.ascontiguousarray(b[i].reshape(spec.rank, -1).T)
    return out


def peft_config(model: Qwen2, base_model_name_or_path: str | None = None) -> dict[str, Any]:
    """The ``adapter_config.json`` of the model's adapters (PEFT's ``LoraConfig`` fields; plain LoRA)."""
    spec = _spec_of(model)
    arch = model.config.to_hf()["architectures"][0]
    module = "qwen2" if arch == "Qwen2ForCausalLM" else "llama"
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model_name_or_path,
        "r": spec.rank, "lora_alpha": spec.alpha, "lora_dropout": 0.0, "target_modules": list(spec.targets),
        "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "init_lora_weights": True,
        "inference_mode": True, "modules_to_save": None, "layers_to_transform": None, "layers_pattern": None,
        "rank_pattern": {}, "alpha_pattern": {}, "revision": None,
        "auto_mapping": {"base_model_class": arch, "parent_library": f"transformers.models.{module}.modeling_{module}"},
    }


def save_peft_adapter(model: Qwen2, path: str | os.PathLike, *, dtype: str | None = None,
                      base_model_name_or_path: str | None = None) -> Path:
    """Write the model's adapters as a PEFT adapter directory (``adapter_config.json`` +
    ``adapter_model.safetensors``) at ``path``, which must not exist or be empty; written aside and
    renamed, like :func:`~ict_jax.model.weights.save_hf`. ``dtype``: of the written tensors (default: as
    held). ``base_model_name_or_path`` is recorded for ``PeftModel``/``AutoPeftModel`` (optional)."""
    from safetensors.numpy import save_file  # safetensors: imported where weight files are written

    path = Path(path)
    with written_aside(path, "save_peft_adapter") as tmp:  # refuses a non-empty path first
        tensors = peft_state_dict(model, dtype)
        config = peft_config(model, base_model_name_or_path)
        save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2))
    return path


def read_peft_spec(path: str | os.PathLike, num_layers: int, base_dtype: str | None = None) -> LoraSpec:
    """The :class:`LoraSpec` of a PEFT adapter directory; a ``ValueError`` (one line) for what this model
    cannot hold: another ``peft_type``, DoRA, rsLoRA, biases, per-module ranks or alphas, layer subsets,
    ``modules_to_save``, or target modules other than the attention and MLP projections."""
    path = Path(path)
    cfg_path = path / CONFIG_NAME
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{str(path)!r}: no {CONFIG_NAME} (not a PEFT adapter directory)")
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_path}: not valid JSON ({e})") from None
    where = str(cfg_path)
    if cfg.get("peft_type") != "LORA":
        raise ValueError(f"{where}: peft_type {cfg.get('peft_type')!r}; only LORA adapters are supported")
    for key, ok in (("use_dora", False), ("use_rslora", False), ("bias", "none"), ("fan_in_fan_out", False)):
        if cfg.get(key, ok) not in (ok, None):
            raise ValueError(f"{where}: {key}={cfg[key]!r} is not supported (only plain LoRA: {key}={ok!r})")
    for key in ("rank_pattern", "alpha_pattern", "layers_to_transform", "modules_to_save"):
        if cfg.get(key):
            raise ValueError(f"{where}: {key} is not supported (one rank and alpha for every adapted projection "
                             "of every layer, no extra trained modules)")
    targets = cfg.get("target_modules")
    if isinstance(targets, str):
        targets = regex_targets(targets, num_layers)
    elif isinstance(targets, list) and targets:
        bad = [t for t in targets if t not in LORA_MODULES]
        if bad:
            raise ValueError(f"{where}: target module(s) {bad} are not supported; supported: {', '.join(LORA_MODULES)}")
    else:
        raise ValueError(f"{where}: target_modules {targets!r} names no module")
    try:
        return LoraSpec(rank=int(cfg["r"]), alpha=float(cfg["lora_alpha"]), targets=tuple(targets),
                        base_dtype=base_dtype)
    except KeyError as e:
        raise ValueError(f"{where}: missing {e.args[0]!r}") from None


def load_peft_adapter(model: Qwen2, path: str | os.PathLike) -> Qwen2:
    """``model`` (without adapters) with the PEFT LoRA adapter at ``path`` attached (placed like the model).
    A missing tensor, a wrong shape or a tensor without a place is a :class:`WeightError` naming it."""
    from safetensors.numpy import load_file  # safetensors: imported where weight files are read

    path = Path(path)
    spec = read_peft_spec(path, model.config.num_layers)
    file = path / WEIGHTS_NAME
    if not file.is_file():
        raise FileNotFoundError(f"{str(path)!r}: no {WEIGHTS_NAME} (adapters in .bin files: convert them first)")
    try:
        tensors = load_file(str(file))
    except Exception as e:  # noqa: BLE001 - safetensors' SafetensorError (a Rust error), OSError
        raise WeightError(f"{file}: not a readable safetensors file ({str(e).splitlines()[0]})") from None
    tensors = {k.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B."): v
               for k, v in tensors.items()}
    adapted = add_adapters(model, spec)
    graphdef, adapters, base = split_adapters(adapted)
    used: set[str] = set()

    def fill(path_: tuple, var: Any) -> Any:
        key = str(getattr(path_[-1], "key", path_[-1]))
        weight, part = key.rsplit("_lora_", 1)
        target = next(t for t in spec.targets if LORA_MODULES[t][0] == weight)
        shape = var.shape  # [L, *in, r] for A, [L, r, *out] for B
        per_layer = []
        for i in range(model.config.num_layers):
            name = peft_tensor_names(target, i)[0 if part == "a" else 1]
            if name not in tensors:
                raise WeightError(f"{file}: tensor {name!r} is missing")
            t = tensors[name]
            want = (spec.rank, int(np.prod(shape[1:-1]))) if part == "a" else (int(np.prod(shape[2:])), spec.rank)
            if tuple(t.shape) != want:
                raise WeightError(f"{file}: tensor {name!r} has shape {tuple(t.shape)}, expected {want}")
            per_layer.append(t.T.reshape(shape[1:]))
            used.add(name)
        host = np.stack(per_layer).astype(var.dtype)
        return var.replace(jax.device_put(host, var[...].sharding))

    adapters = nnx.map_state(fill, adapters)
    unknown = sorted(set(tensors) - used)
    if unknown:
        raise WeightError(f"{file}: {len(unknown)} tensor(s) have no place in the model, e.g. {unknown[0]!r}")
    return nnx.merge(graphdef, adapters, base)


def export_model(model: Qwen2, out_dir: str | os.PathLike, *, format: Literal["merged", "peft"] = "merged",
                 dtype: str | None = None, base_model_name_or_path: str | None = None) -> Path:
    """Write ``model`` for Hugging Face tools: ``merged`` = a transformers directory (``config.json`` +
    safetensors) with any adapters merged into the weights; ``peft`` = the adapters alone as a PEFT adapter
    directory (the model must have adapters). ``out_dir`` must not exist or be empty."""
    if format == "merged":
        return save_hf(merge_adapters(model), out_dir, dtype=dtype)
    if format == "peft":
        return save_peft_adapter(model, out_dir, dtype=dtype, base_model_name_or_path=base_model_name_or_path)
    raise ValueError(f"export format {format!r}: use merged or peft")


def _spec_of(model: Qwen2) -> LoraSpec:
    if model.config.lora is None:
        raise ValueError("the model has no LoRA adapters (model.lora is off): export it merged, as a "
                         "Hugging Face directory")
    return model.config.lora
