"""``ict-jax train`` and ``ict-jax sft``: parse the config and run the :class:`ict_jax.train.trainer.Trainer`."""

from __future__ import annotations

import argparse
import json
import sys

from ict_jax.config import ConfigError, load_config


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="YAML config (see configs/ and docs/config.md)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. train.steps=10")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--coordinator", default=None, help="multi-host: coordinator address host:port")
    p.add_argument("--num-processes", type=int, default=None, help="multi-host: number of processes")
    p.add_argument("--process-id", type=int, default=None, help="multi-host: this process's index")


def add_train_args(p: argparse.ArgumentParser) -> None:
    _common(p)
    p.add_argument("--resume", action="store_true", help="continue the run in run_dir from its last checkpoint")
    p.add_argument("--profile-steps", default=None, metavar="A:B",
                   help="write a jax.profiler trace of steps A..B-1 to <run_dir>/profile")


def add_sft_args(p: argparse.ArgumentParser) -> None:
    _common(p)


def _parse_profile(text: str | None) -> tuple[int, int] | None:
    if not text:
        return None
    try:
        a, b = (int(x) for x in text.split(":"))
    except ValueError:
        raise ConfigError(f"--profile-steps {text!r}: expected A:B with integers A < B") from None
    if not 0 <= a < b:
        raise ConfigError(f"--profile-steps {text!r}: expected 0 <= A < B")
    return a, b


def _setup(args: argparse.Namespace):
    from ict_jax.train.run import maybe_initialize_distributed

    cfg = load_config(args.config, args.overrides)
    maybe_initialize_distributed(args.coordinator, args.num_processes, args.process_id)
    return cfg


def train_main(args: argparse.Namespace) -> int:
    from ict_jax.train.trainer import Trainer

    cfg = _setup(args)
    profile = _parse_profile(args.profile_steps)
    with Trainer(cfg, resume=args.resume, progress=not args.no_progress, profile_steps=profile) as trainer:
        summary = trainer.train()
    _print_summary(summary)
    return 0


def sft_main(args: argparse.Namespace) -> int:
    """Supervised warm start only: ``train.sft_steps`` updates, then the model is written as a Hugging
    Face checkpoint to ``<run_dir>/sft_model`` (usable as ``model.path`` of a later run)."""
    from ict_jax.train.trainer import Trainer

    cfg = _setup(args)
    if cfg.train.sft_steps <= 0:
        raise ConfigError("train.sft_steps: must be > 0 for `ict-jax sft`")
    with Trainer(cfg, progress=not args.no_progress) as trainer:
        metrics = trainer.sft()  # also writes <run_dir>/sft_model
        out = trainer.run_dir / "sft_model"
        summary = {"sft": metrics, "model": str(out)}
        if cfg.data.eval:
            summary["eval"] = trainer.evaluate(0)
    _print_summary(summary)
    return 0


def _print_summary(summary: dict) -> None:
    import jax

    if jax.process_index() != 0:
        return
    print(json.dumps(summary, indent=2, default=str), file=sys.stdout)
