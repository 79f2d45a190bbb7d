"""``<run_dir>/summary.json`` as a run writes it: its sections as they finish (``sft``,
``eval_after_sft``, ``final``, ``eval_final``, ``steps``, ``plot``), its ``status``, the resumes, and
``wall_s`` over every invocation (an interrupted or failed one included). docs/checkpoints.md."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

import jax

from ict_jax.train.record import read_resumes, read_summary, write_summary


class RunSummary:
    """The summary of the run in ``run_dir`` (``data``, a dict), continued from the one on disk when
    ``resume``. A finished run trained further (``train.steps`` raised) keeps its earlier end under
    ``earlier``. Only the first process writes."""

    def __init__(self, run_dir: Path, *, resume: bool):
        self.run_dir = Path(run_dir)
        self.data: dict[str, Any] = (read_summary(self.run_dir) or {}) if resume else {}
        self._clock: tuple[float, float] | None = None  # (wall_s before this invocation, its start)
        if self.data.get("status", "finished") == "finished" and "final" in self.data:
            earlier = {k: self.data.pop(k) for k in ("final", "eval_final", "steps") if k in self.data}
            self.data.setdefault("earlier", []).append(earlier)

    def __getitem__(self, key: str) -> Any:
        return self.data[key]

    def __setitem__(self, key: str, value: Any) -> None:
        self.data[key] = value

    def __contains__(self, key: str) -> bool:
        return key in self.data

    def get(self, key: str, default: Any = None) -> Any:
        return self.data.get(key, default)

    def start_clock(self) -> None:
        """This invocation's work starts now (once; ``wall_s`` adds its time to the earlier ones')."""
        if self._clock is None:
            self._clock = (float(self.data.get("wall_s", 0.0)), time.perf_counter())

    def stamp_wall(self) -> None:
        """``wall_s``: the earlier invocations' time plus this one's so far."""
        if self._clock is not None:
            before, t0 = self._clock
            self.data["wall_s"] = before + time.perf_counter() - t0

    def stop_clock(self) -> None:
        self._clock = None

    def save(self, status: str) -> None:
        self.data.update(run_dir=str(self.run_dir), status=status, resumes=read_resumes(self.run_dir))
        if jax.process_index() == 0:
            write_summary(self.run_dir, self.data)

    def close(self) -> None:
        """An invocation that stopped (Ctrl-C, an error) or ran SFT only: its time is recorded too."""
        if self._clock is not None:
            self.stamp_wall()
            self._clock = None
            with contextlib.suppress(OSError):  # a full disk: the error that stopped the run is the one shown
                self.save(self.data.get("status", "running"))
