"""One parse of a GGUF file's header per process: ``gguf.GGUFReader`` reads every metadata field when it
opens a file (the Qwen tokenizer's 151k tokens and merges: ~5-13 s and ~0.5 GB of Python objects on the
project's 2-core machines), and loading a model reads the same file three times (its architecture, its
weights, its tokenizer). :func:`open_gguf` keeps the last reader (keyed by the file's path, size and
modification time, so a replaced file is read again); :func:`release_gguf` drops it once the model and
tokenizer are built, so its memory is not held for the rest of a run."""

from __future__ import annotations

import functools
import os
from typing import Any


@functools.lru_cache(maxsize=1)
def _reader(path: str, size: int, mtime_ns: int) -> Any:
    from gguf import GGUFReader  # gguf: optional, only for .gguf files

    return GGUFReader(path)


def open_gguf(path: str | os.PathLike) -> Any:
    """The ``gguf.GGUFReader`` of ``path`` (parsed once while it is the last one opened). Raises
    ``FileNotFoundError`` when it is not a file, ``ValueError`` (one line) when it is not a readable GGUF."""
    real = os.path.realpath(os.fspath(path))
    try:
        st = os.stat(real)
    except OSError:
        raise FileNotFoundError(f"{os.fspath(path)!r} is not a file") from None
    if not os.path.isfile(real):
        raise FileNotFoundError(f"{os.fspath(path)!r} is not a file")
    try:
        return _reader(real, st.st_size, st.st_mtime_ns)
    except (ValueError, OSError, IndexError) as e:
        raise ValueError(f"{os.fspath(path)}: not a readable GGUF file ({e})") from None


def release_gguf() -> None:
    """Forget the kept reader (its parsed fields and memory map)."""
    _reader.cache_clear()
