"""Where the package writes: the one check that an output location can be written, made before any work
starts (every command that writes calls it: ``train`` / ``sft`` run_dir, ``eval --out``, ``inspect --out``,
``export --out``, ``compare --out``, ``diagnose --out``, ``compile --json`` / ``--dump-hlo``).

An output location that cannot be written (a read-only mount, a folder of another user, a path under a
file, ``/proc/x/run``) is an :class:`OutputLocationError`: one line naming the location, the folder that
refused and why (the command line prints it and exits with 2), instead of a traceback after minutes of
work. The check is made by trying: the nearest folder that exists must accept a new entry (a temporary
folder is created there and removed at once), which also holds for root, whom permission bits do not stop.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from pathlib import Path

__all__ = ["OutputLocationError", "check_output_dir", "check_output_file", "os_error_line", "USER_PATH_ERRNOS"]

#: errno values of an ``OSError`` that describe the user's paths or disk, not a bug: the command line
#: reports them as one line with exit code 2 (cli/main.py).
USER_PATH_ERRNOS = frozenset({errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.ENOTDIR,
                              errno.EISDIR, errno.ENAMETOOLONG, errno.ENOENT, errno.EEXIST, errno.ELOOP})


class OutputLocationError(ValueError):
    """An output location that cannot be written; ``str(err)`` is one line naming it and why."""


def os_error_line(err: OSError) -> str:
    """``[Errno 13] Permission denied: '/x'`` as ``Permission denied: '/x'`` (both paths when there are two)."""
    what = err.strerror or type(err).__name__
    paths = [p for p in (err.filename, err.filename2) if p is not None]
    return f"{what}: " + " -> ".join(repr(os.fspath(p)) for p in paths) if paths else what


def _nearest_existing(path: Path) -> Path:
    p = path
    while not p.exists() and not p.is_symlink():
        if p.parent == p:
            break
        p = p.parent
    return p


def _probe(folder: Path, label: str) -> None:
    """A temporary folder is created in ``folder`` and removed: the proof that entries can be made there."""
    try:
        probe = tempfile.mkdtemp(prefix=".ict_jax_write_check_", dir=folder)
    except OSError as e:
        raise OutputLocationError(f"{label} cannot be written: nothing can be created in {str(folder)!r} "
                                  f"({e.strerror or type(e).__name__})") from None
    shutil.rmtree(probe, ignore_errors=True)


def _check_folder(folder: Path, label: str) -> None:
    existing = _nearest_existing(folder.absolute())
    if existing == folder.absolute() and not existing.is_dir():
        raise OutputLocationError(f"{label} cannot be written: {str(existing)!r} exists and is not a folder")
    if not existing.is_dir():
        raise OutputLocationError(f"{label} cannot be created: {str(existing)!r} is a file, not a folder")
    _probe(existing, label)


def check_output_dir(path: str | os.PathLike, what: str = "output folder") -> Path:
    """Check that folder ``path`` can be written: it is a folder that accepts new entries, or it does not
    exist yet and can be created (every missing folder above it too). Nothing is left behind. Returns
    ``path`` as a Path; raises :class:`OutputLocationError` whose message names ``what`` (the setting:
    ``run_dir``, ``--out``) and the path."""
    target = Path(path)
    _check_folder(target, f"{what} {str(target)!r}")
    return target


def check_output_file(path: str | os.PathLike, what: str = "output file") -> Path:
    """Check that file ``path`` can be written: its folder passes :func:`check_output_dir` and the file,
    if it exists, is a regular file that may be written over. Nothing is left behind."""
    target = Path(path)
    label = f"{what} {str(target)!r}"
    if target.is_dir():
        raise OutputLocationError(f"{label} is a folder; name a file")
    _check_folder(target.absolute().parent, label)
    if target.exists() and not os.access(target, os.W_OK):
        raise OutputLocationError(f"{label} exists and cannot be written over (read-only)")
    return target
