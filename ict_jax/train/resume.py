"""Where a run directory stands and what a resumed run continues from (docs/checkpoints.md "Resume"):
the resume point (RL checkpoint, finished or unfinished SFT warm start), a finished run, the KL reference of
a resumed run, and the logged rows a resumed run writes again. The run directory's checks and its hold are
:mod:`ict_jax.train.run_dir`."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
from flax import nnx

from ict_jax.config import Config
from ict_jax.model.qwen2 import Qwen2
from ict_jax.train.checkpoints import Checkpointer
from ict_jax.train.logs import read_metrics, truncate_metrics
from ict_jax.train.model_source import resolve_model
from ict_jax.train.record import SFT_MODEL, check_resume, read_config, read_summary, run_finished

SFT_CHECKPOINTS = "checkpoints_sft"  # <run_dir>/checkpoints_sft/<sft step>/: an unfinished SFT warm start


@dataclasses.dataclass(frozen=True)
class ResumePoint:
    """Where a run directory stands: ``phase`` "start" (nothing to continue), "sft" (an SFT checkpoint
    at ``step`` SFT steps), or "rl" (``step`` rollout batches done; 0 = the SFT warm start finished and
    RL has not saved a checkpoint yet). ``keep_below``: per phase, the first step a resumed run logs
    again (the rows from there on are dropped from metrics.jsonl and hidden in TensorBoard)."""

    phase: str
    step: int
    keep_below: dict[str, int]


def finished_sft_steps(directory: Path) -> int | None:
    """The latest finished checkpoint's step in ``directory`` (an SFT or RL checkpoint folder; None when
    there is none)."""
    if not directory.is_dir():
        return None
    with Checkpointer(directory, read_only=True) as ck:
        return ck.latest_step()


def sft_ahead(cfg: Config, run_dir: Path, resume: bool) -> bool:
    """Whether a run of ``cfg`` in ``run_dir`` has SFT steps ahead of it: ``train.sft_steps > 0`` and, when
    resumed, neither a finished warm start (``<run_dir>/sft_model``) nor an RL checkpoint to continue
    from. Such a run starts in the SFT phase: its state is an SFT state, RL's is built when SFT ends."""
    if cfg.train.sft_steps <= 0:
        return False
    return not resume or not ((run_dir / SFT_MODEL).is_dir() or finished_sft_steps(run_dir / "checkpoints") is not None)


def resume_point(cfg: Config, run_dir: Path, rl_step: int | None) -> ResumePoint:
    """The :class:`ResumePoint` of ``run_dir`` given its latest RL checkpoint step."""
    if rl_step is not None:
        return ResumePoint("rl", rl_step, {"rl": rl_step, "eval": rl_step + 1})
    if cfg.train.sft_steps > 0 and (run_dir / SFT_MODEL).is_dir():
        summary = read_summary(run_dir) or {}
        return ResumePoint("rl", 0, {"rl": 0, "eval": 1 if "eval_after_sft" in summary else 0})
    sft_step = finished_sft_steps(run_dir / SFT_CHECKPOINTS) if cfg.train.sft_steps > 0 else None
    if sft_step is not None:
        return ResumePoint("sft", sft_step, {"sft": sft_step, "rl": 0, "eval": 0})
    return ResumePoint("start", 0, {"sft": 0, "rl": 0, "eval": 0})


def finished_run(cfg: Config, run_dir: Path) -> dict[str, Any] | None:
    """The summary of a finished run that ``cfg`` does not extend (its ``train.steps`` not raised past
    the steps done), else None. A change the resume rules refuse raises first, even for a finished run."""
    if not run_finished(run_dir):
        return None
    previous = read_config(run_dir)
    if previous is not None:
        check_resume(previous, cfg)
    summary = read_summary(run_dir) or {}
    done = summary.get("steps", previous.train.steps if previous is not None else cfg.train.steps)
    return summary if cfg.train.steps <= int(done) else None


def reference_model(cfg: Config, run_dir: Path, model: Qwen2, resumed: bool, mesh: jax.sharding.Mesh) -> Any:
    """The parameters of the KL reference of a run, the policy at the start of RL. A resumed run rebuilds
    it: the SFT result saved at ``<run_dir>/sft_model`` if there is one (placed on the run's mesh, like
    the policy), else the initial model (reloaded / re-initialised deterministically, which is what
    ``model`` is before any checkpoint is restored into the state)."""
    sft_dir = run_dir / SFT_MODEL
    if resumed and sft_dir.is_dir():
        return nnx.state(resolve_model(cfg, weights=sft_dir, adapters=False).load(mesh=mesh), nnx.Param)
    return nnx.state(model, nnx.Param)


def drop_rows_logged_again(run_dir: Path, point: ResumePoint) -> None:
    """metrics.jsonl without the rows a run resumed at ``point`` logs again (one row per (phase, step)
    in the end); the first process writes."""
    if jax.process_index() == 0:
        truncate_metrics(run_dir / "metrics.jsonl", point.keep_below)


def eval_on_record(run_dir: Path, point: ResumePoint | None) -> tuple[int, dict[str, float]] | None:
    """(step, metrics) of the evaluation of the resumed RL step when metrics.jsonl holds one: the resumed
    run does not evaluate that step again."""
    metrics = run_dir / "metrics.jsonl"
    if point is None or point.phase != "rl" or not metrics.is_file():
        return None
    done = [r for r in read_metrics(metrics, "eval") if r["step"] == point.step]
    return (point.step, {k: v for k, v in done[-1].items() if k.startswith("eval/")}) if done else None
