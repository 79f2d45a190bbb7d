"""Run logging: docs/method.md §5 metrics per step to ``metrics.jsonl`` and TensorBoard event files
(tensorboardX, no TensorFlow), a progress bar, and the summary plot. Only process 0 writes."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any, Iterable, Mapping

import jax
import numpy as np

from ict_jax.sharding import to_host

#: Metrics shown in the progress bar (short label -> key).
BAR_KEYS = {"reward": "reward/mean", "acc": "reward/accuracy", "H1": "stats/H1_mean", "sel": "mask/selected_frac"}
#: Metrics plotted by :func:`plot_metrics`.
PLOT_KEYS = ("reward/mean", "reward/accuracy", "stats/H1_mean", "stats/H2_mean", "mask/selected_frac")


def metrics_to_floats(metrics: Mapping[str, Any]) -> dict[str, float]:
    """Device scalars -> Python floats (one transfer; multi-process safe)."""
    values = to_host(dict(metrics))
    return {k: float(np.asarray(v)) for k, v in values.items()}


class RunLogger:
    """Appends one JSON object per step to ``<run_dir>/metrics.jsonl`` and writes TensorBoard events to
    ``<run_dir>/tb``; shows a tqdm bar with step, reward, H1 and the selected fraction."""

    def __init__(self, run_dir: str | Path, *, total_steps: int, initial_step: int = 0, progress: bool = True,
                 tensorboard: bool = True, enabled: bool | None = None, desc: str = "train"):
        self.enabled = jax.process_index() == 0 if enabled is None else enabled
        self.run_dir = Path(run_dir)
        self._bar = None
        self._tb = None
        self._file = None
        if not self.enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._file = open(self.run_dir / "metrics.jsonl", "a", buffering=1)
        if tensorboard:  # optional or heavy packages, imported only when used
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(str(self.run_dir / "tb"))
        if progress:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total_steps, initial=initial_step, desc=desc, dynamic_ncols=True,
                             file=sys.stderr, disable=None)

    def log(self, step: int, metrics: Mapping[str, float], *, phase: str = "rl") -> None:
        if not self.enabled:
            return
        row = {"step": int(step), "phase": phase, **{k: _json_float(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(row) + "\n")
        if self._tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and math.isfinite(v):
                    self._tb.add_scalar(k if phase == "rl" else f"{phase}/{k}", v, step)
        if self._bar is not None:
            shown = {label: f"{metrics[k]:.3f}" for label, k in BAR_KEYS.items() if k in metrics}
            if phase != "rl":
                shown = {k.split("/")[-1]: f"{v:.3f}" for k, v in list(metrics.items())[:3]}
            self._bar.set_postfix(shown, refresh=False)
            self._bar.update(1)

    def message(self, text: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        if self._file is not None:
            self._file.close()
        self._bar = self._tb = self._file = None


def _json_float(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no NaN/inf
    return v


def read_metrics(path: str | Path, phase: str | None = "rl") -> list[dict[str, Any]]:
    """Rows of a ``metrics.jsonl`` (of one ``phase``; None = all). A resumed run may repeat steps that
    were logged after the last checkpoint and before the crash: the last row of a step wins."""
    rows: dict[tuple[str, int], dict[str, Any]] = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            row = json.loads(line)
            if phase is None or row.get("phase", "rl") == phase:
                rows[(row.get("phase", "rl"), row["step"])] = row
    return [rows[k] for k in sorted(rows, key=lambda k: (k[0], k[1]))]


def plot_metrics(metrics_path: str | Path, out_png: str | Path, keys: Iterable[str] = PLOT_KEYS) -> Path:
    """One panel per metric vs step (reward, accuracy, H1, H2, selected fraction by default)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    keys = [k for k in keys if any(k in r for r in rows)]
    fig, axes = plt.subplots(1, max(1, len(keys)), figsize=(3.2 * max(1, len(keys)), 2.8), squeeze=False)
    for ax, k in zip(axes[0], keys):
        xs = [r["step"] for r in rows if isinstance(r.get(k), (int, float))]
        ys = [r[k] for r in rows if isinstance(r.get(k), (int, float))]
        ax.plot(xs, ys, lw=1.2)
        ax.set_title(k, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    out_png = Path(out_png)
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png
