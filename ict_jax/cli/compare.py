"""``ict-jax compare``: every method x seed from one shared warm start (:mod:`ict_jax.tools.compare`), or,
with ``--plan``, a pre-registered experiment (:mod:`ict_jax.tools.experiment`: arms x seeds, paired,
resumable, with a JSON record and a report)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ict_jax.cli.errors import UserError

#: the exit code of an experiment the time box stopped (not finished; the same command continues it)
EXIT_STOPPED = 75

#: run_comparison's parameters -> the flags that set them (its errors name the parameter; these name the flag)
_FLAGS = {"methods": "--methods", "seeds": "--seeds", "rhos": "--rho", "out": "--out",
          "target_reward": "--target-reward"}


def add_compare_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None,
                   help="YAML config: the warm start and every run's settings (without --plan)")
    p.add_argument("--plan", default=None, metavar="PLAN.yaml",
                   help="run (or continue) the pre-registered experiment of this plan: arms x seeds in chunks, "
                        "record and report in the plan's record folder (docs/experiments.md); instead of --config")
    p.add_argument("--max-hours", type=float, default=None, metavar="H",
                   help="with --plan: a time box of H hours: no step or final evaluation starts that would end "
                        "past it at the pace measured (a checkpoint; exit 75; the same command continues)")
    p.add_argument("--report", action="store_true",
                   help="with --plan: only rebuild report.md and its figures from the record (experiment.json)")
    p.add_argument("--status", action="store_true",
                   help="with --plan: print where the experiment stands (each run's state and steps, the invocation "
                        "running, the time left) without any outcome; takes no lock, runs beside an invocation")
    p.add_argument("--uncommitted", action="store_true",
                   help="with --plan: run a plan that is not committed as it is in git (the record says so)")
    p.add_argument("--order", choices=("chunks", "runs"), default=None,
                   help="with --plan: chunks (default: every run reaches each chunk's end before any goes past it) "
                        "or runs (seed by seed, one run from start to end before the next: on a machine that may "
                        "be lost between invocations, a finished run needs no checkpoint to outlive it)")
    p.add_argument("--runs", default=None, metavar="RUN,...",
                   help="with --plan: train only these runs this invocation (names like ict_s3; a branched run "
                        "re-derives its lost branch point as usual); the others wait for a later invocation")
    p.add_argument("--recover", action="store_true",
                   help="with --plan: the record holds results but the working folder (out) is gone (another "
                        "machine): rebuild it from the record and continue; unfinished runs start again from step "
                        "0, what they logged kept in the record (docs/experiments.md)")
    p.add_argument("--eval-batch", type=int, default=None, metavar="B",
                   help="with --plan: prompts a call of every evaluation's sampler (data.eval_batch; default the "
                        "plan's train.prompts_per_step): a resource of the machine, kept by later invocations; "
                        "fixed once an evaluation has finished (docs/experiments.md)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. train.steps=10")
    p.add_argument("--methods", default=None,
                   help="comma-separated selectors (ict, grpo, entropy, stapo, random, frequent, selectable) or "
                        "variants (ict_norm_valid: ict with rl.loss.normalize_over=valid); default: ict, grpo, "
                        "entropy, stapo, random")
    p.add_argument("--seeds", default="3", help="N = seeds 0..N-1, or a list like 0,1,2 (default 3)")
    p.add_argument("--rho", default=None, metavar="R1,R2,...",
                   help="sparsity ablation: one ICT run group per rho (e.g. 0.05,0.1,0.2,0.3)")
    p.add_argument("--out", default=None, help="output folder (default runs/compare_<config name>)")
    p.add_argument("--target-reward", type=float, default=0.5,
                   help="steps for the moving average of reward/mean to reach this (default 0.5)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def _items(text: str) -> list[str]:
    return [x.strip() for x in str(text).split(",") if x.strip()]


def parse_methods(text: str | None) -> list[str] | None:
    """``--methods ict,grpo`` -> ["ict", "grpo"] (None: the library's default)."""
    if text is None:
        return None
    methods = _items(text)
    if not methods:
        raise UserError(f"--methods {text!r}: name at least one method")
    return methods


def parse_seeds(text: str) -> list[int]:
    """``--seeds 3`` -> seeds 0, 1, 2; ``--seeds 0,5,7`` -> those seeds."""
    s = str(text).strip()
    try:
        seeds = [int(x) for x in _items(s)] if "," in s else list(range(int(s)))
    except ValueError:
        seeds = []
    if not seeds:
        raise UserError(f"--seeds {text!r}: expected a count N >= 1 (seeds 0..N-1) or a list like 0,1,2")
    return seeds


def parse_rhos(text: str | None) -> list[float] | None:
    """``--rho 0.05,0.1`` -> [0.05, 0.1] (None or blank: no ablation)."""
    if text is None or not str(text).strip():
        return None
    try:
        return [float(x) for x in _items(text)]
    except ValueError:
        raise UserError(f"--rho {text!r}: expected fractions like 0.05,0.1,0.2") from None


def _plan_main(args: argparse.Namespace) -> int:
    from ict_jax.tools.experiment import ExperimentStopped, rebuild_report, run_experiment

    given = [flag for flag, value in (("--config", args.config), ("--methods", args.methods), ("--rho", args.rho),
                                      ("--out", args.out)) if value is not None]
    given += ["KEY=VALUE overrides"] if args.overrides else []
    given += ["--seeds"] if args.seeds != "3" else []
    given += ["--target-reward"] if args.target_reward != 0.5 else []
    if given:
        raise UserError(f"--plan: the plan fixes the runs; {', '.join(given)} cannot be given with it")
    if args.report or args.status:
        extra = [f for f, v in (("--max-hours", args.max_hours), ("--order", args.order),
                                ("--recover", args.recover or None), ("--eval-batch", args.eval_batch),
                                ("--runs", args.runs),
                                ("--report", (args.report and args.status) or None)) if v is not None]
        if extra:
            what = "--status only reads where the experiment stands" if args.status else \
                "--report only rebuilds the report"
            raise UserError(f"{what}: {', '.join(extra)} does not apply")
        if args.status:
            from ict_jax.tools.experiment_status import experiment_status, format_status

            print(format_status(experiment_status(args.plan)))
        else:
            print(f"wrote {rebuild_report(args.plan)}")
        return 0
    if args.max_hours is not None and not args.max_hours > 0:
        raise UserError(f"--max-hours {args.max_hours}: expected a positive number of hours")
    if args.eval_batch is not None and args.eval_batch < 1:
        raise UserError(f"--eval-batch {args.eval_batch}: expected a positive number of prompts")
    try:
        run_experiment(args.plan, max_hours=args.max_hours, allow_uncommitted=args.uncommitted,
                       progress=not args.no_progress and sys.stderr.isatty(), order=args.order or "chunks",
                       recover=args.recover, eval_batch=args.eval_batch,
                       runs=None if args.runs is None else [r.strip() for r in args.runs.split(",") if r.strip()])
    except ExperimentStopped as e:
        print(f"ict-jax compare: stopped ({e}); run the same command to continue", file=sys.stderr)
        return EXIT_STOPPED
    return 0


def compare_main(args: argparse.Namespace) -> int:
    import jax

    if args.plan is not None:
        return _plan_main(args)
    if (args.report or args.status or args.max_hours is not None or args.uncommitted or args.order is not None
            or args.recover or args.eval_batch is not None or args.runs is not None):
        raise UserError("--report, --status, --max-hours, --uncommitted, --order, --recover, --eval-batch and --runs "
                        "go with --plan")
    if args.config is None:
        raise UserError("--config or --plan is required")

    from ict_jax.config import ConfigError
    from ict_jax.tools.compare import PLOTS, run_comparison

    methods, seeds, rhos = parse_methods(args.methods), parse_seeds(args.seeds), parse_rhos(args.rho)
    try:
        results = run_comparison(args.config, methods=methods, seeds=seeds, rhos=rhos, out=args.out,
                                 target_reward=args.target_reward, overrides=args.overrides,
                                 progress=not args.no_progress)
    except ConfigError as e:  # the library names its parameters; the command line names its flags
        param, sep, rest = str(e).partition(":")
        if sep and param in _FLAGS:
            raise UserError(f"{_FLAGS[param]}:{rest}") from None
        raise
    if jax.process_index() == 0:
        out = Path(results["out"])
        print((out / "results.md").read_text(), end="")
        print(f"\nwrote {out / 'results.md'}, {out / 'results.json'}, "
              + ", ".join(str(out / png) for _, png in PLOTS.values()))
    return 0
