"""One parse of a GGUF file's header per process: ``gguf.GGUFReader`` reads every metadata field when it
opens a file (the Qwen tokenizer's 151k tokens and merges: ~5-13 s and ~0.5 GB of Python objects on the
project's 2-core machines), and loading a model reads the same file three times (its architecture, its
weights, its tokenizer). :func:`open_gguf` keeps the last reader (keyed by the file's path, size and
modification time, so a replaced file is read again); :func:`release_gguf` drops it once the model and
tokenizer are built, so its memory is not held for the rest of a run.

A truncated file (a download or copy that stopped early) fails before that parse: :func:`gguf_extent`
walks the header alone (no field is decoded: ~0.2 s for the Qwen tokenizer's 300k strings) to the tensor
table and computes the bytes it describes, and :func:`open_gguf` compares them with the file's size:
``truncated: 10 MB of the 491 MB its header describes``."""

from __future__ import annotations

import functools
import math
import mmap
import os
import struct
from typing import Any

#: bytes of each GGUF scalar value type (gguf.GGUFValueType: uint8 ... float64); 8 = string, 9 = array
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9


class TruncatedGGUF(ValueError):
    """A GGUF file shorter than its own header says; ``str(err)`` is one line with both sizes."""


def _mb(n: int) -> str:
    return f"{n / 1e6:,.0f} MB" if n >= 10**6 else f"{n:,} bytes"


def gguf_extent(path: str | os.PathLike) -> int | None:
    """The bytes GGUF file ``path`` must have by its header: where its tensor data starts (the header's end,
    aligned to ``general.alignment``) plus the end of the furthest tensor (``offset + n_bytes``, from each
    tensor's shape and ``gguf.GGML_QUANT_SIZES``). Reads only the header, decoding nothing but lengths.
    None for a GGUF version or tensor type this walk does not know (the full reader then decides).
    :class:`TruncatedGGUF` when the header itself runs past the end of the file; ``ValueError`` when the
    file does not start with the GGUF magic."""
    from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT  # gguf: optional, only for .gguf files

    size = os.path.getsize(path)
    with open(path, "rb") as f:
        if size < 24:
            if size >= 4 and f.read(4) != b"GGUF":
                raise ValueError("no GGUF magic: not a GGUF file")
            raise TruncatedGGUF(f"truncated: {_mb(size)}, shorter than a GGUF header")
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    with m:
        if m[:4] != b"GGUF":
            raise ValueError("no GGUF magic: not a GGUF file")
        order = "<" if struct.unpack_from("<I", m, 4)[0] & 0xFFFF else ">"
        if struct.unpack_from(order + "I", m, 4)[0] not in (2, 3):
            return None
        u32, u64 = struct.Struct(order + "I"), struct.Struct(order + "Q")
        pos = 24

        def skip(kind: int, at: int) -> int:  # the end of a value of type ``kind`` at ``at``
            if kind in _SCALAR_BYTES:
                return at + _SCALAR_BYTES[kind]
            if kind == _STRING:
                return at + 8 + u64.unpack_from(m, at)[0]
            if kind != _ARRAY:
                raise KeyError(kind)
            item, count = u32.unpack_from(m, at)[0], u64.unpack_from(m, at + 4)[0]
            at += 12
            if item in _SCALAR_BYTES:
                return at + count * _SCALAR_BYTES[item]
            for _ in range(count):
                at = skip(item, at)
            return at

        try:
            tensors, fields = u64.unpack_from(m, 8)[0], u64.unpack_from(m, 16)[0]
            alignment = GGUF_DEFAULT_ALIGNMENT
            for _ in range(fields):
                key_end = skip(_STRING, pos)
                kind = u32.unpack_from(m, key_end)[0]
                if m[pos + 8:key_end] == b"general.alignment" and kind == 4:
                    alignment = u32.unpack_from(m, key_end + 4)[0] or GGUF_DEFAULT_ALIGNMENT
                pos = skip(kind, key_end + 4)
            end = 0
            for _ in range(tensors):
                pos = skip(_STRING, pos)
                dims = u32.unpack_from(m, pos)[0]
                shape = struct.unpack_from(f"{order}{dims}Q", m, pos + 4)
                pos += 4 + 8 * dims
                kind, offset = u32.unpack_from(m, pos)[0], u64.unpack_from(m, pos + 4)[0]
                pos += 12
                block, type_bytes = GGML_QUANT_SIZES[kind]
                end = max(end, offset + math.prod(shape) // block * type_bytes)
        except (struct.error, OverflowError):
            raise TruncatedGGUF(f"truncated: {_mb(size)}, and its header runs past that end") from None
        except KeyError:
            return None
        if pos > size:
            raise TruncatedGGUF(f"truncated: {_mb(size)}, and its header runs past that end")
        return pos + (-pos) % alignment + end


def check_gguf_size(path: str | os.PathLike) -> None:
    """:class:`TruncatedGGUF` when file ``path`` is shorter than its header describes
    (``<path>: truncated: 10 MB of the 491 MB its header describes``), before any slow parse."""
    size = os.path.getsize(path)
    try:
        extent = gguf_extent(path)
    except TruncatedGGUF as e:
        raise TruncatedGGUF(f"{os.fspath(path)}: {e} (an interrupted download or copy?)") from None
    if extent is not None and size < extent:
        raise TruncatedGGUF(f"{os.fspath(path)}: truncated: {_mb(size)} of the {_mb(extent)} its header describes "
                            "(an interrupted download or copy?)")


@functools.lru_cache(maxsize=1)
def _reader(path: str, size: int, mtime_ns: int) -> Any:
    from gguf import GGUFReader  # gguf: optional, only for .gguf files

    check_gguf_size(path)  # seconds before GGUFReader would fail on a cut file (a reshape error)
    return GGUFReader(path)


def open_gguf(path: str | os.PathLike) -> Any:
    """The ``gguf.GGUFReader`` of ``path`` (parsed once while it is the last one opened). Raises
    ``FileNotFoundError`` when it is not a file, ``ValueError`` (one line) when it is not a readable GGUF,
    :class:`TruncatedGGUF` (a ``ValueError``) at once when it is shorter than its header describes."""
    real = os.path.realpath(os.fspath(path))
    try:
        st = os.stat(real)
    except OSError:
        raise FileNotFoundError(f"{os.fspath(path)!r} is not a file") from None
    if not os.path.isfile(real):
        raise FileNotFoundError(f"{os.fspath(path)!r} is not a file")
    try:
        return _reader(real, st.st_size, st.st_mtime_ns)
    except TruncatedGGUF as e:
        raise TruncatedGGUF(str(e).replace(real, os.fspath(path), 1)) from None
    except (ValueError, OSError, IndexError) as e:
        raise ValueError(f"{os.fspath(path)}: not a readable GGUF file ({e})") from None


def release_gguf() -> None:
    """Forget the kept reader (its parsed fields and memory map)."""
    _reader.cache_clear()
