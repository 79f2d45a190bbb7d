"""``ict-jax train`` and ``ict-jax sft``: parse the config and run the :class:`ict_jax.train.trainer.Trainer`."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

from ict_jax.config import ConfigError
from ict_jax.config_load import load_config
from ict_jax.config_overrides import parse_override
from ict_jax.outputs import check_output_dir


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None,
                   help="YAML config (see configs/ and docs/config.md); required unless --resume, which without it "
                        "continues the run_dir=DIR given from its recorded config (DIR/config.json), the overrides "
                        "on the command line being the only changes")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. train.steps=10")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in run_dir from its last checkpoint (SFT or RL); a finished run is left "
                        "as it is. Without --config the run's recorded config is continued (`--resume run_dir=DIR "
                        "[key=value ...]`); settings that would change how it trains are refused")
    p.add_argument("--print-config", action="store_true",
                   help="print the resolved config (every key, defaults included) as YAML and exit")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar (a compact line every logging.print_every steps instead)")
    p.add_argument("--coordinator", default=None, help="multi-host: coordinator address host:port")
    p.add_argument("--num-processes", type=int, default=None, help="multi-host: number of processes")
    p.add_argument("--process-id", type=int, default=None, help="multi-host: this process's index")


def add_train_args(p: argparse.ArgumentParser) -> None:
    _common(p)
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


def _load(args: argparse.Namespace):
    """The run's config: ``--config`` with the overrides; with ``--resume`` alone, the recorded config of the
    run named by ``run_dir=DIR`` with the overrides (``train.record.resume_config``)."""
    if args.config is not None:
        return load_config(args.config, args.overrides)
    if not args.resume:
        raise ConfigError("--config is required (only --resume may leave it out: it continues the run in "
                          "run_dir=DIR from the config the run recorded)")
    run_dir = next((value for key, value in map(parse_override, args.overrides) if key == "run_dir"), None)
    if run_dir is None:
        raise ConfigError("--resume without --config: name the run to continue with run_dir=DIR")
    from ict_jax.train.record import resume_config

    return resume_config(str(run_dir), args.overrides)


def _multi_process(args: argparse.Namespace) -> bool:
    """Whether this is one process of a multi-process run (the flags or the environment name one: what
    ``train.distributed.maybe_initialize_distributed`` reads)."""
    return any(v is not None for v in (args.coordinator, args.num_processes)) or any(
        os.environ.get(k) for k in ("ICT_JAX_COORDINATOR", "ICT_JAX_NUM_PROCESSES"))


def _setup(args: argparse.Namespace) -> tuple:
    """(config, the hold of its run_dir, whether that hold is taken): the run directory is checked and held
    from the command's first second, before JAX and the trainer are imported, so that a second run (or a
    ``--resume``) on it is refused at once, naming this process. A process of a multi-process run leaves the
    hold to the trainer (process 0 holds it, known once JAX is initialised)."""
    cfg = _load(args)
    hold = contextlib.ExitStack()
    if args.print_config:
        return cfg, hold, False
    check_output_dir(cfg.run_dir, "run_dir")  # before anything is built
    from ict_jax.data.extras import check_extras

    check_extras((*cfg.data.train, *cfg.data.eval))  # a missing optional extra (gym:, tfds:) before the model loads
    held = not _multi_process(args)
    if held:
        from ict_jax.train.run_dir import hold_run_dir

        hold.enter_context(hold_run_dir(Path(cfg.run_dir), args.resume, primary=True))
    return cfg, hold, held


def _start(args: argparse.Namespace, beat) -> None:
    """The command's first phase, under its heartbeat: JAX imported (a multi-process run initialised)."""
    beat.phase("starting (importing JAX and the trainer)")
    from ict_jax.train.distributed import maybe_initialize_distributed

    maybe_initialize_distributed(args.coordinator, args.num_processes, args.process_id)


def print_config(cfg) -> None:
    """The resolved config tree, every key with its value (defaults included), as YAML."""
    import yaml  # only where text is written

    print(yaml.safe_dump(cfg.to_dict(), sort_keys=False, default_flow_style=False), end="")


def heartbeat(args: argparse.Namespace):
    """The command's heartbeat on stderr (:class:`ict_jax.heartbeat.Heartbeat`) from its first second, where
    progress is lines (redirected, or ``--no-progress``): a line naming the phase whenever 30 s pass without
    one, while the trainer is imported and the run is built (data, model, compile and the memory
    pre-flight, reward workers, weights) and after its last step; in between the run's own lines and
    heartbeat (:class:`ict_jax.train.logs.RunLogger`) take over (``phase(None)``)."""
    from ict_jax.cli.progress import command_heartbeat

    return command_heartbeat(args.command, enabled=args.no_progress or not sys.stderr.isatty())


def train_main(args: argparse.Namespace) -> int:
    cfg, hold, held = _setup(args)
    if args.print_config:
        print_config(cfg)
        return 0
    with hold, heartbeat(args) as beat:
        _start(args, beat)
        return _train(args, cfg, held, beat)


def _train(args: argparse.Namespace, cfg, held: bool, beat) -> int:
    from ict_jax.train.trainer import Trainer

    profile = _parse_profile(args.profile_steps)
    with Trainer(cfg, resume=args.resume, progress=not args.no_progress, profile_steps=profile,
                 held=held, tell=beat.phase) as trainer:
        beat.phase(None)  # the run's own lines and heartbeat from here
        if trainer.finished is not None:
            _say(f"{cfg.run_dir}: finished at step {trainer.finished.get('steps', cfg.train.steps)}; nothing to do "
                 "(raise train.steps to train it further)")
            return 0
        summary = trainer.train()
        beat.phase("finishing (the last checkpoint, the summary and its plots)")
    _print_summary(summary)
    return 0


def sft_main(args: argparse.Namespace) -> int:
    """Supervised warm start only: ``train.sft_steps`` updates, then the model is written as a Hugging
    Face checkpoint to ``<run_dir>/sft_model`` (usable as ``model.path`` of a later run). ``--resume``
    continues an interrupted warm start; ``ict-jax train --resume`` on the same run_dir goes on with RL."""
    cfg, hold, held = _setup(args)
    if args.print_config:
        print_config(cfg)
        return 0
    with hold, heartbeat(args) as beat:
        _start(args, beat)
        return _sft(args, cfg, held, beat)


def _sft(args: argparse.Namespace, cfg, held: bool, beat) -> int:
    from ict_jax.train.trainer import Trainer

    if cfg.train.sft_steps <= 0:
        raise ConfigError("train.sft_steps: must be > 0 for `ict-jax sft`")
    out = Path(cfg.run_dir) / "sft_model"
    if args.resume and out.is_dir():
        _say(f"{cfg.run_dir}: the SFT warm start is finished ({out}); nothing to do "
             "(`ict-jax train --resume` goes on with RL)")
        return 0
    # the SFT warm start alone: the pre-flight checks the programs it runs, the SFT step (and the evaluation
    # sampler with data.eval), not RL's (docs/memory.md)
    with Trainer(cfg, resume=args.resume, progress=not args.no_progress, rl=False, held=held,
                 tell=beat.phase) as trainer:
        beat.phase(None)  # the run's own lines and heartbeat from here
        summary = trainer.warm_start()  # also writes <run_dir>/sft_model
        beat.phase("finishing (the warm start's model and the summary)")
    _print_summary(summary)
    return 0


def _say(text: str) -> None:
    print(text, file=sys.stderr)


def _print_summary(summary: dict) -> None:
    """The before/after table (stdout) and where the full summary is; the JSON stays in summary.json."""
    import jax

    from ict_jax.train.logs import BAR_KEYS, summary_table

    if jax.process_index() != 0:
        return
    final = summary.get("final") or {}
    if final:
        print(f"after {summary.get('steps', '?')} RL steps: "
              + "  ".join(f"{label} {final[k]:.3f}" for label, k in BAR_KEYS.items() if k in final))
    table = summary_table(summary)
    if table:
        print(table)
    run_dir = summary.get("run_dir")
    if run_dir:
        plot = f", {summary['plot']}" if summary.get("plot") else ""
        print(f"wrote {run_dir}/summary.json, metrics.jsonl{plot}")
