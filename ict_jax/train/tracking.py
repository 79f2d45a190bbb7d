"""Experiment tracking with Weights & Biases (the optional ``wandb`` extra): ``logging.wandb: true``.

Every row the run logs to ``metrics.jsonl`` is also logged to W&B under the same metric names; each
phase has its own x axis (``sft/step``, ``rl/step``, ``eval/step``: the ``step`` of its JSONL rows), so
SFT, RL and evaluation curves do not collide. The W&B run id is kept in ``<run_dir>/wandb_id`` and a
resumed run continues the same W&B run. ``WANDB_MODE=offline`` writes the run under ``<run_dir>/wandb``
without a network (``wandb sync`` uploads it later). docs/config.md (``logging``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from ict_jax.config import Config, ConfigError
from ict_jax.install import install_line

PHASES = ("sft", "rl", "eval")


def require_wandb() -> Any:
    """The ``wandb`` module, or a one-line ConfigError saying how to install it."""
    try:
        # optional: the `wandb` extra, imported only when logging.wandb is true
        import wandb
    except ImportError:
        raise ConfigError(f"logging.wandb: true needs the wandb package: {install_line('wandb')}") from None
    return wandb


class WandbTracker:
    """A W&B run for ``cfg`` in ``run_dir`` (``resume``: continue the run whose id is in
    ``<run_dir>/wandb_id``). :meth:`log` takes what :class:`~ict_jax.train.logs.RunLogger` logs."""

    def __init__(self, cfg: Config, run_dir: str | Path, *, resume: bool = False):
        wandb = require_wandb()
        self.run_dir = Path(run_dir)
        id_file = self.run_dir / "wandb_id"
        run_id = id_file.read_text().strip() if resume and id_file.is_file() else None
        lg = cfg.logging
        self.run = wandb.init(project=lg.wandb_project, name=lg.wandb_name or self.run_dir.name,
                              dir=str(self.run_dir), config=cfg.to_dict(), id=run_id,
                              resume="allow" if run_id else None, reinit="create_new")
        id_file.write_text(self.run.id)
        for phase in PHASES:
            self.run.define_metric(f"{phase}/step")
        self.run.define_metric("sft/*", step_metric="sft/step")
        self.run.define_metric("eval/*", step_metric="eval/step")
        self.run.define_metric("*", step_metric="rl/step")

    def log(self, step: int, metrics: Mapping[str, float], phase: str) -> None:
        self.run.log({f"{phase}/step": int(step), **metrics})

    def close(self) -> None:
        self.run.finish()
