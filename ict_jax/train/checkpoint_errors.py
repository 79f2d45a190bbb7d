"""A checkpoint that could not be written (a full disk, a quota, a folder that went read-only): one line
for the user, the details in a log file.

Orbax writes a checkpoint in background threads; when the disk fills up it logs every failing thread's
traceback through absl (hundreds of lines: RESOURCE_EXHAUSTED, "Event loop is closed", ...) and re-raises
the error at the next call that waits for the save. :class:`OrbaxLogCapture` keeps those records off the
console while a :class:`~ict_jax.train.checkpoints.Checkpointer` is open, and :func:`write_error` turns
the failure into a :class:`CheckpointWriteError`: one line naming the step, the folder, the reason, the
last checkpoint that is intact and the log file that holds the captured records and the traceback.
Nothing already saved is touched: orbax writes into a temporary folder and renames it only when
complete, and that temporary folder is removed when the run is resumed (docs/checkpoints.md).
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import re
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

__all__ = ["CheckpointWriteError", "OrbaxLogCapture", "QuietEventLoopTracebacks", "write_error", "ERROR_LOG"]

#: The details of a failed checkpoint write: ``<run_dir>/checkpoint_errors.log`` (beside the checkpoint
#: folder), or a file in the system's temporary folder when that one cannot be written either.
ERROR_LOG = "checkpoint_errors.log"
_OS_ERROR_CODE = re.compile(r"os_error_code='?(\d+)")


class CheckpointWriteError(OSError):
    """A checkpoint that could not be written. ``str(err)`` is one line; ``err.log_path`` the details;
    ``err.errno`` the operating system's reason (``ENOSPC`` for a full disk) when known."""

    def __init__(self, code: int, message: str, log_path: str | None):
        super().__init__(code, message)
        self.log_path = log_path

    def __str__(self) -> str:
        return str(self.strerror)


class OrbaxLogCapture(logging.Filter):
    """While installed (:meth:`install` / :meth:`remove`), log records of WARNING and above that orbax
    emits (through absl) and asyncio's are kept here, at most ``limit`` of them, instead of printed."""

    def __init__(self, directory: str | os.PathLike, limit: int = 200):
        super().__init__()
        self.directory = str(directory)
        self.records: collections.deque = collections.deque(maxlen=limit)
        self._loggers = (logging.getLogger("absl"), logging.getLogger("asyncio"))

    def _ours(self, record: logging.LogRecord) -> bool:
        if record.name == "asyncio" or f"{os.sep}orbax{os.sep}" in (record.pathname or ""):
            return True
        text = record.getMessage()
        if text.startswith("[process="):  # orbax's own prefix: [process=0][thread=...]
            return True
        if record.exc_info and record.exc_info[1] is not None:
            text += str(record.exc_info[1])
            frames = traceback.extract_tb(record.exc_info[2]) if record.exc_info[2] is not None else []
            if any(f"{os.sep}orbax{os.sep}" in f.filename for f in frames):
                return True
        return self.directory in text or "orbax" in text.lower()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING and self._ours(record):
            self.records.append(record)
            return False
        return True

    def install(self) -> "OrbaxLogCapture":
        for lg in self._loggers:
            lg.addFilter(self)
        return self

    def remove(self) -> None:
        for lg in self._loggers:
            lg.removeFilter(self)

    def text(self) -> str:
        fmt = logging.Formatter("%(asctime)s %(levelname)s %(name)s %(threadName)s: %(message)s")
        return "\n".join(fmt.format(r) for r in self.records)


class QuietEventLoopTracebacks:
    """``sys.stderr`` while a :class:`~ict_jax.train.checkpoints.Checkpointer` writes: everything passes
    through unchanged and at once, except the tracebacks that end in ``RuntimeError: Event loop is
    closed``. tensorstore prints those (from C, through ``sys.stderr``, bypassing logging and
    ``sys.excepthook``) for the other writes of a save that already failed, which complete after orbax
    closed their event loop; they are kept in ``capture`` (the details log) instead. Only a text that
    starts a traceback is held back, until its last line says what it is; each thread's text is read on
    its own (two threads print their tracebacks at the same time)."""

    HEADER = "Traceback (most recent call last):"
    NOISE = "RuntimeError: Event loop is closed"

    def __init__(self, stream: Any, capture: "OrbaxLogCapture"):
        self.stream, self.capture = stream, capture
        self.blocks: dict[int, str] = {}  # thread -> the traceback it is printing
        self.active = True
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            self._write(text)
        return len(text)

    def _write(self, text: str) -> None:
        me = threading.get_ident()
        while text:
            if me not in self.blocks:
                start = text.find(self.HEADER) if self.active else -1
                if start < 0:
                    self.stream.write(text)
                    return
                self.stream.write(text[:start])
                self.blocks[me], text = "", text[start:]
            self.blocks[me] += text
            text = ""
            lines = self.blocks[me].split("\n")
            for k in range(1, len(lines) - 1):  # complete lines after the header
                if lines[k] and not lines[k][0].isspace():  # the exception line ends the traceback
                    block, text = "\n".join(lines[:k + 1]) + "\n", "\n".join(lines[k + 1:])
                    del self.blocks[me]
                    if lines[k].strip() == self.NOISE:
                        self.capture.records.append(logging.makeLogRecord(
                            {"name": "tensorstore", "levelno": logging.ERROR, "levelname": "ERROR", "msg": block}))
                    else:
                        self.stream.write(block)
                    break

    def flush(self) -> None:  # a traceback still being printed by another thread stays held until it ends
        self.stream.flush()

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding, ...: the real stream's
        return getattr(self.stream, name)

    def install(self) -> "QuietEventLoopTracebacks":
        sys.stderr = self
        return self

    def remove(self) -> None:
        with self._lock:
            for block in self.blocks.values():  # a traceback that never finished: shown as it is
                self.stream.write(block)
            self.blocks.clear()
        self.flush()
        if sys.stderr is self:
            sys.stderr = self.stream
        else:  # another writer wrapped it meanwhile: stay in the chain, inert
            self.active = False


def _reason(exc: BaseException) -> tuple[int, str]:
    """(errno, reason) of a failed write: an OSError's own, else the os_error_code in orbax's message."""
    code = getattr(exc, "errno", None)
    if isinstance(code, int) and code > 0 and isinstance(exc, OSError) and exc.strerror:
        return code, exc.strerror
    if not isinstance(code, int):
        m = _OS_ERROR_CODE.search(str(exc))
        code = int(m.group(1)) if m else None
    if isinstance(code, int) and code > 0:
        return code, os.strerror(code)
    first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return errno.EIO, first[:200]


def _write_log(directory: Path, text: str) -> str | None:
    """The details written to ``<run_dir>/checkpoint_errors.log``, else to a temporary file (the run's disk
    may be the full one); None when neither can be written."""
    try:
        path = directory.parent / ERROR_LOG
        with open(path, "a", encoding="utf-8") as f:
            f.write(text)
        return str(path)
    except OSError:
        pass
    try:
        fd, name = tempfile.mkstemp(prefix="ict_jax_checkpoint_errors_", suffix=".log")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        return name
    except OSError:
        return None


def write_error(exc: BaseException, *, step: int | None, directory: Path, intact: int | None,
                capture: OrbaxLogCapture | None) -> CheckpointWriteError:
    """The :class:`CheckpointWriteError` of ``exc`` raised while checkpoint ``step`` was written to
    ``directory`` (``intact``: the latest finished step), with the details log written."""
    code, reason = _reason(exc)
    what = "a checkpoint" if step is None else f"the checkpoint of step {step}"
    details = (f"== {time.strftime('%Y-%m-%d %H:%M:%S')}: {what} could not be written to {directory}: {reason}\n"
               + "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
               + ("\n== orbax's log records\n" + capture.text() + "\n" if capture is not None and capture.records
                  else ""))
    log_path = _write_log(directory, details)
    kept = (f"the last finished checkpoint (step {intact}) is intact" if intact is not None
            else "no earlier checkpoint was touched")
    where = f"details in {log_path}" if log_path else "no log could be written either"
    return CheckpointWriteError(code, f"{what} could not be written to {directory}: {reason}; {kept} (free the "
                                f"space or fix the folder, then resume the run); {where}", log_path)
