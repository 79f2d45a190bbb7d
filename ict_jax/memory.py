"""What memory this machine gives a run: the budget a run's compiled programs are checked against
before the first step (the memory pre-flight, docs/memory.md), read from the operating system.

- CPU: the memory available to this process = what it holds now (its resident set) plus what the
  kernel can still give it: the smaller of ``MemAvailable`` (``/proc/meminfo``) and the headroom under
  the cgroup's limit (v2 ``memory.max`` - ``memory.current``; v1 ``memory.limit_in_bytes`` -
  ``memory.usage_in_bytes``). A process started under ``ulimit -v`` is bounded by that too.
- GPU: the device's ``memory_stats()["bytes_limit"]`` (what XLA's allocator may use).
- TPU: the HBM the compiler allows (``ict_jax.aot.compile.hbm_bytes`` asks the compiler; nothing here).

``ICT_JAX_MEMORY_BUDGET`` (bytes, or a number with a unit: ``20GiB``, ``512MiB``, ``1.5e10``) replaces the
detected budget of every device: for a machine whose limit is not visible to the process, or for tests.
Nothing in this module imports JAX at import time; it imports nothing of ict_jax.
"""

from __future__ import annotations

import dataclasses
import os
import re
import resource
from pathlib import Path
from typing import Any

#: Environment variable that sets the budget (bytes a device, or the host on CPU).
BUDGET_ENV = "ICT_JAX_MEMORY_BUDGET"
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000 ** 2, "mb": 1000 ** 2, "g": 1000 ** 3, "gb": 1000 ** 3,
          "t": 1000 ** 4, "tb": 1000 ** 4, "kib": 1024, "mib": 1024 ** 2, "gib": 1024 ** 3, "tib": 1024 ** 4}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)
#: cgroup v2 / v1 files, relative to the cgroup's folder
_V2 = ("memory.max", "memory.current")
_V1 = ("memory.limit_in_bytes", "memory.usage_in_bytes")
#: cgroup v1 reports "no limit" as a huge number (2^63 rounded down to the page size)
_V1_UNLIMITED = 1 << 60


@dataclasses.dataclass(frozen=True)
class Budget:
    """Bytes a run may hold at its peak on one device (the host, on CPU), and where the number came from.
    ``held``: bytes this process already holds that are part of ``total`` (CPU: its resident set when the
    budget was read; 0 elsewhere)."""

    total: int
    source: str
    held: int = 0

    @property
    def free(self) -> int:
        """What is left beyond what the process already holds."""
        return self.total - self.held


def fmt_bytes(n: int | None) -> str:
    """``13.17 GiB``, ``812.4 MiB``, ``96.0 KiB``; ``-`` for None."""
    if n is None:
        return "-"
    for unit, size in (("GiB", 1024 ** 3), ("MiB", 1024 ** 2), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}" if unit == "GiB" else f"{n / size:.1f} {unit}"
    return f"{n} B"


def parse_size(text: str, *, what: str = BUDGET_ENV) -> int:
    """``"20GiB"`` -> 21474836480; ``"512MB"``, ``"1.5e10"``, ``"123"`` (bytes). ValueError (one line) otherwise."""
    m = _SIZE.match(str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ValueError(f"{what}: {text!r} is not a size (bytes, or a number with a unit: 20GiB, 512MB)")
    n = int(float(m.group(1)) * _UNITS[unit])
    if n <= 0:
        raise ValueError(f"{what}: {text!r} must be more than 0 bytes")
    return n


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return None if text in ("", "max") else int(text) if text.isdigit() else None


def _cgroup_dirs(root: Path) -> list[Path]:
    """This process's cgroup folders (v2 unified first, then v1's memory controller), from /proc/self/cgroup;
    the root itself when the process's path is not mounted there (containers mount their own group at /)."""
    out = []
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        rel = path.lstrip("/")
        if controllers == "":
            out.append(root / rel)
        elif "memory" in controllers.split(","):
            out.append(root / "memory" / rel)
    out += [root, root / "memory"]
    return [d for i, d in enumerate(out) if d not in out[:i]]


def cgroup_headroom(root: str | Path = "/sys/fs/cgroup") -> tuple[int, int] | None:
    """(limit, limit - usage) of this process's memory cgroup, or None without a limit."""
    for d in _cgroup_dirs(Path(root)):
        for limit_file, usage_file in (_V2, _V1):
            limit = _read_int(d / limit_file)
            if limit is None or limit >= _V1_UNLIMITED:
                continue
            usage = _read_int(d / usage_file) or 0
            return limit, max(0, limit - usage)
    return None


def meminfo(path: str | Path = "/proc/meminfo") -> dict[str, int]:
    """``/proc/meminfo`` in bytes (``{"MemTotal": ..., "MemAvailable": ...}``); {} where it cannot be read."""
    out = {}
    try:
        for line in Path(path).read_text().splitlines():
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                out[key] = int(parts[0]) * (1024 if parts[1:2] == ["kB"] else 1)
    except OSError:
        return {}
    return out


def process_rss() -> int:
    """This process's resident set now, bytes (``VmRSS``; 0 where unknown)."""
    return meminfo("/proc/self/status").get("VmRSS", 0)


def peak_rss() -> int:
    """This process's peak resident set so far, bytes (``VmHWM``, else ``ru_maxrss``)."""
    hwm = meminfo("/proc/self/status").get("VmHWM", 0)
    return hwm or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def host_budget(*, cgroup_root: str | Path = "/sys/fs/cgroup", meminfo_path: str | Path = "/proc/meminfo",
                rss: int | None = None) -> Budget:
    """The memory this process may use at its peak: what it holds now plus what it can still get (the
    smaller of MemAvailable, the cgroup's headroom and ``RLIMIT_AS``'s); ``ICT_JAX_MEMORY_BUDGET`` wins."""
    held = process_rss() if rss is None else int(rss)
    if os.environ.get(BUDGET_ENV):
        return Budget(parse_size(os.environ[BUDGET_ENV]), BUDGET_ENV, held)
    options: list[tuple[int, str]] = []
    available = meminfo(meminfo_path).get("MemAvailable")
    if available is not None:
        options.append((held + available, "MemAvailable + this process's resident set"))
    cg = cgroup_headroom(cgroup_root)
    if cg is not None:
        options.append((held + cg[1], f"cgroup memory limit {cg[0] / 1024 ** 3:.2f} GiB"))
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft not in (resource.RLIM_INFINITY, -1):
        options.append((int(soft), "ulimit -v"))
    if not options:
        raise RuntimeError(f"cannot tell how much memory this machine has (no /proc/meminfo): set {BUDGET_ENV}")
    total, source = min(options)
    return Budget(total, source, held)


def device_budget(device: Any) -> Budget | None:
    """An accelerator's budget from its allocator (``memory_stats()["bytes_limit"]``; GPU), the
    environment variable's, or None where the device reports none (CPU, compile-only TPU devices)."""
    if os.environ.get(BUDGET_ENV):
        return Budget(parse_size(os.environ[BUDGET_ENV]), BUDGET_ENV)
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - compile-only devices raise; they have no allocator to ask
        return None
    if not stats or "bytes_limit" not in stats:
        return None
    return Budget(int(stats["bytes_limit"]), f"{device.platform} device bytes_limit", int(stats.get("bytes_in_use", 0)))
