"""The identity of a model's weights, as content hashes (sha256): of its weight files (a ``.gguf`` file, the
``*.safetensors`` of a Hugging Face directory) or of its arrays (a model initialised in memory).

A LoRA run's checkpoints hold only the adapters, so they record the base model they were trained on by
these hashes, and a resume or a load on another base is refused (``ict_jax.train.lora_base``,
docs/lora.md). A file's hash is ``sha256sum``'s: comparable with a published checksum. Hashing reads
every byte once (~2.8 s for the 0.5B GGUF's 491 MB on the project's 2-core CPU).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import jax
import numpy as np

from ict_jax.model.packaged import resolve_path

_BLOCK = 1 << 24  # bytes read at a time


def file_sha256(path: str | os.PathLike) -> str:
    """The sha256 of a file's bytes, as ``sha256sum`` prints it."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            h.update(block)
    return h.hexdigest()


def weight_files(spec: str | os.PathLike) -> list[Path]:
    """The files holding a model's weights: a ``.gguf`` file itself, or the ``*.safetensors`` files of a
    Hugging Face directory (sorted by name); ``spec`` may be ``pkg:<package>/<file>``. FileNotFoundError
    when there are none."""
    path = Path(resolve_path(spec))
    if path.is_file():
        return [path]
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if not files:
        raise FileNotFoundError(f"{os.fspath(spec)!r}: no weight files (a .gguf file or a directory with "
                                "*.safetensors)")
    return files


def weights_sha256(spec: str | os.PathLike) -> dict[str, str]:
    """``{file name: sha256}`` of the weight files of ``spec`` (:func:`weight_files`)."""
    return {f.name: file_sha256(f) for f in weight_files(spec)}


def arrays_sha256(state: Any) -> str:
    """The sha256 of a pytree of arrays: every leaf's key path, dtype, shape and bytes, in tree order.
    The arrays are copied to the host one at a time; on several processes only what each can address is
    hashed (ValueError for an array split over processes: hash its files instead)."""
    h = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
            raise ValueError("arrays_sha256: an array is split over several processes; hash the weight files")
        a = np.ascontiguousarray(np.asarray(jax.device_get(leaf)))
        h.update(f"{jax.tree_util.keystr(path)}:{a.dtype.str}:{a.shape};".encode())
        h.update(a.tobytes())
    return h.hexdigest()
