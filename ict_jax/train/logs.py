"""Run logging: docs/method.md §5 metrics per step to ``metrics.jsonl`` and TensorBoard event files
(tensorboardX, no TensorFlow), a progress bar on a terminal or compact lines in a log file, the summary
plot and the before/after table. Only process 0 writes."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import math
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import jax
import numpy as np

from ict_jax.heartbeat import Heartbeat, duration
from ict_jax.sharding import to_host

#: Metrics shown in the progress bar and the compact lines (short label -> key).
BAR_KEYS = {"reward": "reward/mean", "acc": "reward/accuracy", "H1": "stats/H1_mean", "sel": "mask/selected_frac"}
#: Metrics plotted by :func:`plot_metrics` (RL rows; the evaluation's pass@1 is added when logged).
PLOT_KEYS = ("reward/mean", "reward/accuracy", "stats/H1_mean", "stats/H2_mean", "mask/selected_frac")
#: Lines printed per phase when ``print_every`` is None (no terminal: CI, nohup, redirected output).
AUTO_LINES = 5


def metrics_to_floats(metrics: Mapping[str, Any]) -> dict[str, float]:
    """Device scalars -> Python floats (one transfer; multi-process safe)."""
    values = to_host(dict(metrics))
    return {k: float(np.asarray(v)) for k, v in values.items()}


#: ``75`` -> ``1m15s``, ``3725`` -> ``1h02m``, ``9`` -> ``9s`` (the heartbeat's and eval's format)
format_duration = duration


def compact_line(phase: str, step: int, total: int, metrics: Mapping[str, float], eta_s: float | None) -> str:
    """One line of a phase's progress for a log file: ``rl 40/400  reward 0.412  acc 0.398  H1 1.231
    sel 0.100  2460 tok/s  ETA 3m12s`` (``step`` is 1-based here: steps done)."""
    parts = [f"{phase} {step}/{total}"]
    if phase == "sft":
        if "sft/loss" in metrics:
            parts.append(f"loss {metrics['sft/loss']:.4f}")
    else:
        parts += [f"{label} {metrics[k]:.3f}" for label, k in BAR_KEYS.items() if k in metrics]
        if "throughput/tokens_per_s" in metrics:
            parts.append(f"{metrics['throughput/tokens_per_s']:.0f} tok/s")
    if eta_s is not None and step < total:
        parts.append(f"ETA {format_duration(eta_s)}")
    return "  ".join(parts)


def complete_lines(text: str) -> list[str]:
    """The non-blank lines of a JSONL text, without a last line that was cut short (no newline after it
    and not valid JSON: a process killed, or a disk that filled up, in the middle of writing a row)."""
    lines = [line for line in text.split("\n")]
    if lines and lines[-1].strip() and not text.endswith("\n"):
        try:
            json.loads(lines[-1])
        except json.JSONDecodeError:
            lines.pop()
    return [line for line in lines if line.strip()]


def truncate_metrics(path: str | Path, keep_below: Mapping[str, int | None]) -> int:
    """Rewrite ``metrics.jsonl`` without the rows a resumed run will log again: a row of phase ``p`` is
    kept when ``keep_below[p]`` is None (or ``p`` is not named) or its step is below it; a later row of
    the same (phase, step) replaces an earlier one. Atomic (written aside, then renamed); returns the
    number of rows dropped."""
    path = Path(path)
    if not path.is_file():
        return 0
    rows: dict[tuple[str, int], str] = {}
    total = 0
    for line in complete_lines(path.read_text()):
        total += 1
        row = json.loads(line)
        phase, step = row.get("phase", "rl"), int(row["step"])
        limit = keep_below.get(phase)
        if limit is None or step < limit:
            rows.pop((phase, step), None)  # the later row of a step wins, in the later position
            rows[(phase, step)] = line
    tmp = path.with_name("." + path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in rows.values()))
    os.replace(tmp, path)
    return total - len(rows)


class RunLogger:
    """Appends one JSON object per step to ``<run_dir>/metrics.jsonl``, writes TensorBoard events to
    ``<run_dir>/tb/<phase>`` (tags are the metric names), and shows progress: a tqdm bar on a terminal,
    else (``print_every``) a compact line every N steps on stderr. ``tracker``: another sink with
    ``log(step, metrics, phase)`` (Weights & Biases, :mod:`ict_jax.train.tracking`).

    ``purge``: {phase: step} for a resumed run: TensorBoard hides that phase's events from that step on
    (they are logged again). ``print_every``: 0 = no lines; None = about :data:`AUTO_LINES` per phase.
    With compact lines, a heartbeat (:class:`ict_jax.heartbeat.Heartbeat`) adds one whenever 30 s
    (``$ICT_JAX_HEARTBEAT_S``) pass without a line: a step of a real model on a CPU takes minutes
    (``rl 1/2 steps  3m30s since the last step  (12m05s in rl)``)."""

    def __init__(self, run_dir: str | Path, *, total_steps: int, initial_step: int = 0, progress: bool = True,
                 tensorboard: bool = True, enabled: bool | None = None, desc: str = "train",
                 print_every: int | None = 0, purge: Mapping[str, int] | None = None, tracker: Any = None):
        self.enabled = jax.process_index() == 0 if enabled is None else enabled
        self.run_dir = Path(run_dir)
        self.purge = dict(purge or {})
        self.tracker = tracker
        self.progress, self.print_every = progress, print_every
        self._bar = None
        self._beat: Heartbeat | None = None
        self._previous_thread_hook: Any = None
        self._thread_hook: Any = None
        self._tb: dict[str, Any] | None = None
        self._file = None
        if self.enabled:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            # unbuffered bytes: a row is on disk whole when log() returns, or not at all (append_row)
            self._file = open(self.run_dir / "metrics.jsonl", "ab", buffering=0)
            if tensorboard:
                self._tb = {}
        self.start(desc, total_steps, initial_step)

    def start(self, desc: str, total_steps: int, initial_step: int = 0) -> None:
        """Show the progress of a new phase (``desc``: "sft", "rl"): a new bar, or lines counted anew."""
        self.total, self.initial, self.desc = int(total_steps), int(initial_step), desc
        self._every = 0
        self._t_first = self._t_phase = self._t_step = time.perf_counter()
        self._done = self.initial
        self._work: str | None = None
        self._stop_heartbeat()
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if not self.enabled:
            return
        if self.progress and sys.stderr.isatty():  # optional or heavy packages, imported only when used
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total_steps, initial=initial_step, desc=desc, dynamic_ncols=True,
                             file=sys.stderr)
        elif self.print_every is None:
            self._every = max(1, -(-max(1, self.total) // AUTO_LINES))
        else:
            self._every = int(self.print_every)
        if self._every:
            stream = sys.stderr  # this phase's stream, also for a heartbeat that outlives it unclosed
            self._beat = Heartbeat(lambda line: print(line, file=stream, flush=True),
                                   status=self.heartbeat_line).__enter__()

    def heartbeat_line(self) -> str:
        """``rl 1/2 steps  3m30s since the last step  (12m05s in rl)``: the heartbeat between compact lines,
        with the work between steps when there is some (:meth:`working_on`), e.g.
        ``rl 40/40 steps  6m00s since the last step  (2h31m in rl): evaluating, 16/128 problems done``."""
        now = time.perf_counter()
        last = "since the start" if self._done == self.initial else "since the last step"
        return (f"{self.desc} {self._done}/{self.total} steps  {duration(now - self._t_step)} {last}  "
                f"({duration(now - self._t_phase)} in {self.desc})" + (f": {self._work}" if self._work else ""))

    def working_on(self, text: str | None) -> None:
        """Names the work that runs between steps (an evaluation: problems done, the batch being sampled)
        in the heartbeat's lines, until it is called with None."""
        self._work = text

    def _stop_heartbeat(self) -> None:
        if getattr(self, "_beat", None) is not None:
            self._beat.__exit__()
            self._beat = None

    def _quiet_event_threads(self) -> None:
        """A tensorboardX event thread that dies on a failed write (a full disk) is not printed as a
        traceback: :func:`check_event_writer` raises its error on the next log, as one line."""
        if self._previous_thread_hook is not None:
            return
        previous = self._previous_thread_hook = threading.excepthook

        def hook(args: Any) -> None:
            if type(args.thread).__name__ == "_EventLoggerThread" and issubclass(args.exc_type, OSError):
                return
            previous(args)

        threading.excepthook = hook
        self._thread_hook = hook

    def _writer(self, phase: str) -> Any:
        self._quiet_event_threads()
        if phase not in self._tb:
            # tensorboardX: event files without TensorFlow; imported only when used
            from tensorboardX import SummaryWriter

            self._tb[phase] = SummaryWriter(str(self.run_dir / "tb" / phase), purge_step=self.purge.get(phase))
        return self._tb[phase]

    def log(self, step: int, metrics: Mapping[str, float], *, phase: str = "rl") -> None:
        """One row: ``step`` is the phase's step (SFT and RL: 0-based index; eval: rollout batches done)."""
        if not self.enabled:
            return
        row = {"step": int(step), "phase": phase, **{k: _json_float(v) for k, v in metrics.items()}}
        append_row(self._file, json.dumps(row) + "\n", self.run_dir / "metrics.jsonl")
        if self._tb is not None:
            tb = self._writer(phase)
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and math.isfinite(v):
                    check_event_writer(tb, self.run_dir / "tb" / phase)
                    tb.add_scalar(k, v, step)
        if self.tracker is not None:
            self.tracker.log(step, metrics, phase)
        if phase == "eval":
            return
        if self._bar is not None:
            shown = {label: f"{metrics[k]:.3f}" for label, k in BAR_KEYS.items() if k in metrics}
            if phase == "sft":
                shown = {k.split("/")[-1]: f"{v:.3f}" for k, v in list(metrics.items())[:2]}
            self._bar.set_postfix(shown, refresh=False)
            self._bar.update(1)
        elif self._every:
            done = int(step) + 1
            now = time.perf_counter()
            self._done, self._t_step = done, now
            if done == self.initial + 1:  # the first step compiles: the rate is measured after it
                self._t_first = now
            if done == self.initial + 1 or done % self._every == 0 or done == self.total:
                eta = None
                if done > self.initial + 1:
                    eta = (now - self._t_first) / (done - self.initial - 1) * (self.total - done)
                self.message(compact_line(phase, done, self.total, metrics, eta))

    def message(self, text: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)
        if self._beat is not None:
            self._beat.said()

    def close(self) -> None:
        """Close every sink. A sink that cannot be flushed (a full disk) raises its OSError after the
        others are closed, unless an exception is already on its way (the first error is the one the
        user sees, e.g. the checkpoint that did not fit)."""
        self._stop_heartbeat()
        if self._bar is not None:
            self._bar.close()
        failed: OSError | None = None
        # a TensorBoard writer whose thread died cannot flush, and closing it would block on its queue
        sinks = [tb for tb in (self._tb or {}).values() if not event_writer_died(tb)]
        for sink in [*sinks, *([self._file] if self._file is not None else [])]:
            try:
                sink.close()
            except OSError as e:
                failed = failed or e
        self._bar = self._tb = self._file = None
        if self._thread_hook is not None and threading.excepthook is self._thread_hook:
            threading.excepthook = self._previous_thread_hook
        self._previous_thread_hook = self._thread_hook = None
        if failed is not None and sys.exc_info()[1] is None:
            raise failed


def append_row(f: Any, line: str, path: Path) -> None:
    """Append ``line`` to the unbuffered binary file ``f`` whole, or not at all: a write that fails half
    way (a full disk) is cut back to where the row began, so the file never ends in half a row (which a
    resumed run could not read); the ``OSError`` then names ``path``."""
    data = line.encode("utf-8")
    start = os.fstat(f.fileno()).st_size
    try:
        done = 0
        while done < len(data):
            done += f.write(data[done:])
    except OSError as e:
        with contextlib.suppress(OSError):
            os.ftruncate(f.fileno(), start)
        raise OSError(e.errno, e.strerror, str(path)) from None


def event_writer_died(writer: Any) -> bool:
    """Whether a tensorboardX SummaryWriter's background event thread has ended (a failed write)."""
    events = getattr(getattr(writer, "file_writer", None), "event_writer", None)
    worker = getattr(events, "_worker", None)
    return worker is not None and not worker.is_alive()


def check_event_writer(writer: Any, logdir: Path) -> None:
    """tensorboardX writes events from a background thread; when a write fails (a full disk) that thread
    ends, and the next events would block forever on its full queue (a hung run). Raise the write's
    ``OSError`` (named by the folder) instead, before anything is queued to a writer that is gone."""
    if not event_writer_died(writer):
        return
    events = writer.file_writer.event_writer
    error = OSError(errno.EIO, "TensorBoard's event writer stopped", str(logdir))
    try:  # the writer's own file: its flush fails with the reason the thread ended
        events._ev_writer.flush()
    except OSError as e:
        error = OSError(e.errno, e.strerror, str(logdir))
    # nothing will write these events any more: tensorboardX's exit-time close must neither block on
    # the full queue nor flush into the full disk again
    with contextlib.suppress(Exception):
        while True:
            events._event_queue.get_nowait()
    events._closed = True
    raise error


def _json_float(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no NaN/inf
    return v


def last_logged_step(run_dir: str | Path, phase: str = "rl") -> dict[str, Any]:
    """The metrics of the last ``phase`` step in ``<run_dir>/metrics.jsonl`` (without ``step`` and ``phase``),
    as the step returned them (a non-finite value back as a float); {} when there is none."""
    path = Path(run_dir) / "metrics.jsonl"
    rows = read_metrics(path, phase) if path.is_file() else []
    if not rows:
        return {}
    return {k: (float(v) if v in ("nan", "inf", "-inf") else v) for k, v in rows[-1].items()
            if k not in ("step", "phase")}


def read_metrics(path: str | Path, phase: str | None = "rl") -> list[dict[str, Any]]:
    """Rows of a ``metrics.jsonl`` (of one ``phase``; None = all), ordered by (phase, step). The trainer
    writes one row per (phase, step) (a resumed run first drops the rows it logs again); should a file
    still repeat a step, the last row of it wins."""
    rows: dict[tuple[str, int], dict[str, Any]] = {}
    with open(path) as f:
        for line in complete_lines(f.read()):
            row = json.loads(line)
            if phase is None or row.get("phase", "rl") == phase:
                rows[(row.get("phase", "rl"), row["step"])] = row
    return [rows[k] for k in sorted(rows, key=lambda k: (k[0], k[1]))]


def moving_average(values: Sequence[float], window: int) -> np.ndarray:
    """Trailing mean over the last ``window`` values (fewer at the start), float64."""
    v = np.asarray(values, np.float64)
    if v.size == 0:
        return v
    c = np.concatenate([[0.0], np.cumsum(v)])
    idx = np.arange(1, v.size + 1)
    lo = np.maximum(0, idx - window)
    return (c[idx] - c[lo]) / (idx - lo)


@dataclasses.dataclass
class Curve:
    """One panel of ``metrics.png``: the raw values and their moving average (None for sparse series
    such as the evaluation, drawn with markers)."""

    title: str
    steps: list[int]
    raw: list[float]
    smooth: list[float] | None


def metric_curves(rows: Sequence[Mapping[str, Any]], eval_rows: Sequence[Mapping[str, Any]] = (),
                  keys: Iterable[str] = PLOT_KEYS, window: int | None = None) -> list[Curve]:
    """The panels of :func:`plot_metrics`: each RL metric of ``keys`` present in ``rows`` (raw and
    smoothed by a trailing moving average over ``window`` steps, default ~5% of the steps, at least 1),
    then the evaluation's pass@1 per benchmark vs rollout batches done (from ``eval_rows``)."""
    window = window or max(1, len(rows) // 20)
    out = []
    for k in keys:
        pts = [(r["step"], r[k]) for r in rows if isinstance(r.get(k), (int, float))]
        if pts:
            xs, ys = [p[0] for p in pts], [float(p[1]) for p in pts]
            out.append(Curve(k, xs, ys, moving_average(ys, window).tolist()))
    benches = sorted({k for r in eval_rows for k in r if k.startswith("eval/") and k.endswith("/pass@1")})
    for k in benches:
        pts = [(r["step"], r[k]) for r in eval_rows if isinstance(r.get(k), (int, float))]
        out.append(Curve(f"P@1 {short_benchmark_name(k[5:-7], [b[5:-7] for b in benches])}",
                         [p[0] for p in pts], [float(p[1]) for p in pts], None))
    return out


def plot_metrics(metrics_path: str | Path, out_png: str | Path, keys: Iterable[str] = PLOT_KEYS) -> Path:
    """One panel per metric vs step (reward, accuracy, H1, H2, selected fraction, and the evaluation's
    pass@1 when the run evaluated): raw values faint, their moving average bold."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = metric_curves(read_metrics(metrics_path), read_metrics(metrics_path, "eval"), keys)
    fig, axes = plt.subplots(1, max(1, len(curves)), figsize=(3.2 * max(1, len(curves)), 2.8), squeeze=False)
    for ax, c in zip(axes[0], curves):
        if c.smooth is None:
            ax.plot(c.steps, c.raw, "o-", lw=1.5, ms=4, color="C1")
        else:
            ax.plot(c.steps, c.raw, lw=0.8, alpha=0.3, color="C0")
            ax.plot(c.steps, c.smooth, lw=1.8, color="C0")
        ax.set_title(c.title, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    out_png = Path(out_png)
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png


def short_benchmark_name(name: str, others: Sequence[str] = ()) -> str:
    """A benchmark's name for a table: the dataset name without its options (``split?digits=2&size=256``
    -> ``split``) unless another benchmark in ``others`` has the same base name; a file task's file name
    without folders."""
    base = name.split("?", 1)[0]
    if base.startswith("file:"):
        base = "file:" + Path(base[5:]).name
    if sum(o.split("?", 1)[0] == name.split("?", 1)[0] for o in others) > 1:
        return name
    return base


def format_eval(ev: Mapping[str, float]) -> str:
    """``{"eval/split?digits=2/pass@1": 0.29, ...}`` -> ``split P@1 0.290  P@4 0.684`` (short names)."""
    names = sorted({k[5:k.rindex("/")] for k in ev if k.startswith("eval/") and "/pass@" in k})
    parts = []
    for name in names:
        ks = sorted((int(k.rsplit("@", 1)[1]), v) for k, v in ev.items() if k.startswith(f"eval/{name}/pass@"))
        parts.append(short_benchmark_name(name, names) + " " + "  ".join(f"P@{k} {v:.3f}" for k, v in ks))
    return ";  ".join(parts)


def summary_table(summary: Mapping[str, Any]) -> str:
    """The before/after table of a run's summary: per benchmark, P@k after the SFT warm start (or at
    the start), at the end, and the change. "" when the run evaluated nothing."""
    before, after = summary.get("eval_after_sft") or {}, summary.get("eval_final") or {}
    names = sorted({k[5:k.rindex("/")] for k in [*before, *after] if k.startswith("eval/") and "/pass@" in k})
    if not names:
        return ""
    ks = sorted({int(k.rsplit("@", 1)[1]) for k in [*before, *after] if "/pass@" in k})
    short = [short_benchmark_name(n, names) for n in names]
    width = max(9, *(len(s) for s in short))
    label = "after SFT" if summary.get("sft") else "before"
    head = f"{'benchmark':<{width}}" + "".join(f"  {f'P@{k} ' + label:>15} {'final':>6} {'change':>7}" for k in ks)
    lines = [head]
    for name, s in zip(names, short):
        cells = []
        for k in ks:
            b, a = before.get(f"eval/{name}/pass@{k}"), after.get(f"eval/{name}/pass@{k}")
            cells.append(f"  {'-' if b is None else f'{b:.3f}':>15} {'-' if a is None else f'{a:.3f}':>6} "
                         f"{'' if a is None or b is None else f'{a - b:+.3f}':>7}")
        lines.append(f"{s:<{width}}" + "".join(cells))
    return "\n".join(lines)
