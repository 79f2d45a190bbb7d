"""``ict-jax align``: the gradient-alignment check of a run's selectors on its own rollouts from its starting
policy (:mod:`ict_jax.diagnostics.gradient_alignment`; docs/results.md "Gradient alignment"). A line per batch, and
a heartbeat from the command's first second, at least every ``$ICT_JAX_HEARTBEAT_S`` seconds (30 by default),
naming the phase that runs (importing JAX, each part of the run's build, each batch's sampling and gradients,
the report)."""

from __future__ import annotations

import argparse

from ict_jax.cli.errors import EXIT_STOPPED, UserError
from ict_jax.config_load import load_config
from ict_jax.outputs import check_output_dir


def add_align_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, metavar="YAML", help="the run's config (its model, LoRA, data, sampler)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. seed=3")
    p.add_argument("--batches", type=int, default=16, metavar="N",
                   help="rollout batches with a group of unequal rewards to take (default 16)")
    p.add_argument("--out", default="runs/align", help="output folder (default runs/align); must not hold a check "
                   "unless --resume")
    p.add_argument("--resume", action="store_true",
                   help="go on with the check in --out from its journal (draws.jsonl), with the same config")
    p.add_argument("--max-hours", type=float, default=None, metavar="H",
                   help="a time box of H hours: no batch starts that would end past it at the pace measured "
                        "(exit 75; the same command with --resume goes on)")


def _say(line: str) -> None:
    print(f"[align] {line}", flush=True)


def align_main(args: argparse.Namespace) -> int:
    if args.batches < 2:
        raise UserError(f"--batches {args.batches}: the leave-one-out reference needs at least 2")
    if args.max_hours is not None and not args.max_hours > 0:
        raise UserError(f"--max-hours {args.max_hours}: must be a positive number of hours")
    out = check_output_dir(args.out, "--out")
    if (out / "alignment.json").exists():
        if args.resume:
            print(f"the check in {out} is finished: {out / 'alignment.md'}")
            return 0
        raise UserError(f"--out {str(out)!r} already holds a check: choose another folder")
    if args.resume and not (out / "draws.jsonl").is_file():
        raise UserError(f"--resume: --out {str(out)!r} holds no check to go on with (no draws.jsonl); drop "
                        "--resume to start one there")
    if not args.resume and ((out / "run").exists() or (out / "draws.jsonl").exists()):
        raise UserError(f"--out {str(out)!r} already holds an unfinished check: pass --resume to go on with it, "
                        "or choose another folder")
    cfg = load_config(args.config, args.overrides)

    from ict_jax.heartbeat import Heartbeat

    with Heartbeat(_say) as beat:  # from the first second: importing JAX and the trainer alone takes a while
        beat.phase("starting (importing JAX and the trainer)")
        from ict_jax.diagnostics.gradient_alignment import AlignmentStopped, run_alignment

        try:  # the check's own lines count for the heartbeat
            run_alignment(cfg, batches=args.batches, out=out, say=beat.counted(_say), tell=beat.phase,
                          resume=args.resume, max_hours=args.max_hours)
        except AlignmentStopped as stop:
            print(f"ict-jax align: stopped (time box) after {stop.kept}/{stop.batches} batches; the same command "
                  "with --resume goes on", flush=True)
            return EXIT_STOPPED
    print(f"wrote {out / 'alignment.md'}, {out / 'alignment.json'}")
    return 0
