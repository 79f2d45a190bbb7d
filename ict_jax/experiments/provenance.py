"""Where a result came from: the machine, the library versions, and the git commits of the code and of a
file (a pre-registered experiment's plan, :mod:`ict_jax.experiments.runner`). Read-only: ``git`` is asked,
never told; outside a git checkout (or without git) the commits are None and say so."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import jax

__all__ = ["git", "file_commit", "file_name", "code_commit", "machine", "environment", "now_iso"]

#: the distributions whose versions a record names
PACKAGES = ("ict_jax", "jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy", "transformers",
            "reasoning-gym", "math-verify")
_PACKAGE_ROOT = Path(__file__).resolve().parents[1]  # .../ict_jax


def now_iso() -> str:
    """The local time with its UTC offset, to the second."""
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def git(folder: Path, *args: str) -> str | None:
    """``git -C folder args...``'s output (stripped), or None when git fails or is missing."""
    try:
        res = subprocess.run(["git", "-C", str(folder), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return res.stdout.strip() if res.returncode == 0 else None


def file_commit(path: Path) -> dict[str, Any]:
    """The git state of one file: ``{"in_git", "commit", "committed", "clean"}``. ``commit``: the last
    commit that changed it; ``committed``: git tracks it; ``clean``: its contents equal that commit's
    (no staged or unstaged change). Outside a git work tree: in_git False, the rest None."""
    path = Path(path).resolve()
    folder = path.parent
    if git(folder, "rev-parse", "--is-inside-work-tree") != "true":
        return {"in_git": False, "commit": None, "committed": None, "clean": None}
    tracked = git(folder, "ls-files", "--error-unmatch", "--", path.name) is not None
    commit = git(folder, "log", "-1", "--format=%H", "--", path.name) if tracked else None
    status = git(folder, "status", "--porcelain", "--", path.name)
    return {"in_git": True, "commit": commit or None, "committed": tracked and bool(commit),
            "clean": tracked and bool(commit) and status == ""}


def file_name(path: Path) -> str:
    """How a record names a file (a plan): its path relative to the root of the git work tree that holds
    it (``configs/experiments/demo_plan.yaml``, wherever the command ran), else its bare name: never an
    absolute path of the machine that ran it."""
    path = Path(path).resolve()
    top = git(path.parent, "rev-parse", "--show-toplevel")
    if top:
        try:
            return path.relative_to(Path(top).resolve()).as_posix()
        except ValueError:
            pass
    return path.name


def code_commit() -> dict[str, Any]:
    """The git commit the imported ict_jax package was checked out at, and whether its files differ from
    it (``dirty``: a change under ``ict_jax/``); None values outside a git checkout (an installed wheel)."""
    root = _PACKAGE_ROOT.parent
    if git(root, "rev-parse", "--is-inside-work-tree") != "true":
        return {"commit": None, "dirty": None}
    status = git(root, "status", "--porcelain", "--", _PACKAGE_ROOT.name)
    return {"commit": git(root, "rev-parse", "HEAD"), "dirty": None if status is None else status != ""}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    return None


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def machine() -> dict[str, Any]:
    """The machine a result was measured on, without asking JAX (so a script may call it before it picks a
    backend): host, CPU model (Linux's /proc/cpuinfo; elsewhere what ``platform`` knows), cores usable by
    this process, memory in GiB, OS and Python. The one description of a machine every record and benchmark
    writes."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count()
    return {"host": platform.node(), "cpu": _cpu_model(), "cores": cores, "memory_gib": _memory_gib(),
            "os": f"{platform.system()} {platform.release()}", "python": sys.version.split()[0]}


def environment() -> dict[str, Any]:
    """The machine and software a result was measured on: :func:`machine`, the JAX backend and devices,
    :data:`PACKAGES`' versions, the code's commit."""
    devices = jax.devices()
    return {
        **machine(), "backend": jax.default_backend(), "devices": f"{len(devices)} x {devices[0].device_kind}",
        "versions": {name: _version(name) for name in PACKAGES}, **code_commit(),
    }
