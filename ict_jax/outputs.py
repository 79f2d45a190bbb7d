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

import contextlib
import errno
import fcntl
import json
import os
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

__all__ = ["OutputLocationError", "OutputInUse", "check_output_dir", "check_output_file", "hold_output_dir",
           "has_entries", "numbered_dir", "held_by", "os_error_line", "USER_PATH_ERRNOS", "LOCK_FILE"]

#: errno values of an ``OSError`` that describe the user's paths or disk, not a bug: the command line
#: reports them as one line with exit code 2 (cli/main.py).
USER_PATH_ERRNOS = frozenset({errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.ENOTDIR,
                              errno.EISDIR, errno.ENAMETOOLONG, errno.ENOENT, errno.EEXIST, errno.ELOOP})


class OutputLocationError(ValueError):
    """An output location that cannot be written; ``str(err)`` is one line naming it and why."""


class OutputInUse(OutputLocationError):
    """An output folder another process holds (:func:`hold_output_dir`); ``str(err)`` names the process."""


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


LOCK_FILE = ".lock"


def has_entries(path: str | os.PathLike) -> bool:
    """Whether folder ``path`` exists and holds anything besides a hold's lock file (:func:`hold_output_dir`):
    what decides that a run directory or an output folder already holds results."""
    folder = Path(path)
    return folder.is_dir() and any(p.name != LOCK_FILE for p in folder.iterdir())


def numbered_dir(path: str | os.PathLike) -> Path:
    """Create and return the first of ``path``, ``path-2``, ``path-3``, ... that does not exist yet (each
    try an atomic ``mkdir``: two processes never get the same folder): a default output folder that
    never replaces an earlier result."""
    base = Path(path)
    base.parent.mkdir(parents=True, exist_ok=True)
    n = 1
    while True:
        folder = base if n == 1 else base.with_name(f"{base.name}-{n}")
        try:
            folder.mkdir()
            return folder
        except FileExistsError:
            n += 1


def _lock(folder: Path, what: str) -> int:
    """An open descriptor of ``<folder>/.lock`` holding its exclusive flock; :class:`OutputInUse` when another
    holds it. The file locked must still be the one at that path (a holder that created the folder removes
    it, lock file included, when it ends with nothing written): otherwise the lock is taken again."""
    lock = folder / LOCK_FILE
    while True:
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise _in_use(what, folder, _holder(lock)) from None
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(lock))
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)


def _in_use(what: str, folder: Path, holder: str) -> OutputInUse:
    return OutputInUse(f"{what} {str(folder)!r} is in use by {holder}: wait for it to end or stop it "
                       "(nothing was written)")


def check_not_held(path: str | os.PathLike, what: str = "output folder") -> None:
    """:class:`OutputInUse`, naming the holder, when another process holds folder ``path`` now
    (:func:`held_by`; nothing is locked or written): what a command that reads the folder checks first, so
    that a folder in use is never taken for an empty or a finished one."""
    holder = held_by(path)
    if holder is not None:
        raise _in_use(what, Path(path), holder)


@contextlib.contextmanager
def hold_output_dir(path: str | os.PathLike, what: str = "output folder") -> Iterator[Path]:
    """Hold folder ``path`` (created if missing) for this process while the block runs: a second holder
    is refused at once with :class:`OutputInUse`, naming the process that holds it (pid, host, command,
    since when). The hold is an exclusive ``flock`` on ``<path>/.lock``: the kernel releases it when the
    holder exits in any way (a kill included), so a lock file left by a dead process is never in the way.
    The file keeps the last holder's description. A folder this hold created and that holds nothing but
    the lock file when the block ends (the work failed before writing) is removed: nothing was written.
    Two opens of the lock file exclude each other even within one process."""
    folder = check_output_dir(path, what)
    created = not folder.exists()
    fd = _lock(folder, what)
    try:
        info = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "command": " ".join(sys.argv)[:300]}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        yield folder
    finally:
        try:
            if created and not has_entries(folder):  # removed while still held: no one can take it meanwhile
                (folder / LOCK_FILE).unlink()
                folder.rmdir()
        except OSError:
            pass
        os.close(fd)  # releases the flock


def held_by(path: str | os.PathLike) -> str | None:
    """The process that holds folder ``path`` now (:func:`hold_output_dir`), described as its lock file
    describes it, or None when no process does; read without taking the lock, so a holder, or one about to
    start, is never disturbed. On Linux the kernel's table of flocks (``/proc/locks``) decides; elsewhere
    the lock file's process, when it runs on this host."""
    lock = Path(path) / LOCK_FILE
    try:
        st = lock.stat()
    except OSError:
        return None
    try:
        table = Path("/proc/locks").read_text()
    except OSError:
        table = None
    if table is not None:
        pid = _described_pid(lock)
        for line in table.splitlines():
            fields = line.split()
            # "1: FLOCK  ADVISORY  WRITE 16180 fe:00:5530712 0 EOF" (a waiter's line has "->" after "1:")
            if "FLOCK" not in fields or "->" in fields:
                continue
            at = next((i for i, f in enumerate(fields) if f.count(":") == 2), None)
            try:
                major, minor, inode = fields[at].split(":") if at is not None else ("", "", "")
                ident = (int(major, 16), int(minor, 16), int(inode))
                owner = int(fields[at - 1])
            except (ValueError, IndexError):
                continue
            # the same device and inode; or, where a layered file system shows another device (overlayfs),
            # the same inode held by the process the lock file names
            if ident == (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino) or (
                    ident[2] == st.st_ino and pid is not None and owner == pid):
                return _holder(lock)
        return None
    pid = _described_pid(lock, this_host=True)
    if pid is None:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:  # alive, another user's
        pass
    return _holder(lock)


def _described_pid(lock: Path, this_host: bool = False) -> int | None:
    """The process id the lock file names (with ``this_host``: only when it names this host), else None."""
    try:
        info = json.loads(lock.read_text() or "{}")
        pid = int(info.get("pid") or 0)
    except (OSError, ValueError, TypeError, AttributeError):
        return None
    if pid <= 0 or (this_host and info.get("host") != socket.gethostname()):
        return None
    return pid


def _holder(lock: Path) -> str:
    """The holder of ``lock`` as its file describes it."""
    try:
        info = json.loads(lock.read_text() or "{}")
    except (OSError, ValueError):
        info = {}
    if not info.get("pid"):
        return "another process"
    return (f"process {info['pid']} on {info.get('host', '?')} since {info.get('since', '?')}"
            + (f" ({info['command']})" if info.get("command") else ""))
