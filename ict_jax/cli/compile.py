"""``ict-jax compile``: lower and compile, without running, the programs a run of a config uses, for a TPU
slice or the local devices; per-device memory, fit, compile time, collectives (docs/tpu.md).

Exit codes: 0 every program fits, 3 one does not (one line naming it and its bytes), 2 bad input
(unknown topology, a mesh that does not divide it, a bad config, libtpu missing)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from ict_jax.cli.errors import EXIT_DOES_NOT_FIT


def add_compile_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="YAML config (a recipe)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. train.micro_batches=8")
    p.add_argument("--topology", default=None, metavar="NAME|local",
                   help="a TPU topology as libtpu names it (v5e:2x4, v6e:2x4, v5p:2x2x1, ...; needs the tpu extra) "
                        "or 'local' for this machine's devices; default: the config's mesh.target, else local")
    p.add_argument("--program", default="all", choices=("sft", "step", "generate", "eval", "all"),
                   help="which program to compile: the SFT step, the train step, the rollout sampler, the "
                        "evaluation sampler, or all the run executes (default: the SFT step when train.sft_steps "
                        "> 0, then the other three)")
    p.add_argument("--response-len", type=int, default=None, metavar="N",
                   help="build the train step at response bucket N (1..rollout.max_new_tokens); default: the "
                        "largest, max_new_tokens, whose memory a run needs (a run compiles one step per "
                        "response bucket it meets)")
    p.add_argument("--fit", action="store_true",
                   help="search the cheapest settings that fit (mesh, micro_batches, remat, stats.chunk, "
                        "rollout.chunks) and print them as KEY=VALUE overrides")
    p.add_argument("--max-compiles", type=int, default=4,
                   help="--fit: at most this many candidate settings are compiled to confirm (default 4)")
    p.add_argument("--headroom", type=float, default=0.05,
                   help="--fit: fraction of each chip's HBM to leave free (default 0.05)")
    p.add_argument("--breakdown", action="store_true",
                   help="also print each program's HLO bytes (and matmul FLOPs) by category: attention, matmul "
                        "I/O, converts, norms/elementwise, vocabulary head + statistics, optimizer, other "
                        "(loop trip counts multiplied in; --json always holds them)")
    p.add_argument("--json", default=None, metavar="OUT", help="also write the results as JSON to OUT")
    p.add_argument("--dump-hlo", default=None, metavar="DIR", help="write each compiled program's HLO text to DIR")


def compile_main(args: argparse.Namespace) -> int:
    from ict_jax.aot.compile import compile_run, get_target, run_programs, with_run_budget
    from ict_jax.aot.fit import format_fit, search
    from ict_jax.aot.report import not_fitting_line, render, to_json
    from ict_jax.cli.errors import UserError
    from ict_jax.config_load import load_config
    from ict_jax.outputs import check_output_dir, check_output_file

    if args.max_compiles < 1:
        raise UserError(f"--max-compiles {args.max_compiles}: must be at least 1")
    if args.response_len is not None and args.fit:
        raise UserError("--response-len and --fit: --fit sizes the largest response bucket; drop one")
    if args.json:  # the results are written after minutes of compiling: check the places first
        check_output_file(args.json, "--json")
    if args.dump_hlo:
        check_output_dir(args.dump_hlo, "--dump-hlo")
    cfg = load_config(args.config, args.overrides)
    if args.response_len is not None and not 1 <= args.response_len <= cfg.rollout.max_new_tokens:
        raise UserError(f"--response-len {args.response_len}: the step's response bucket is "
                        f"1..rollout.max_new_tokens={cfg.rollout.max_new_tokens}")
    target = with_run_budget(get_target(args.topology if args.topology is not None else cfg.mesh.target), cfg)
    programs = run_programs(cfg) if args.program == "all" else (args.program,)
    fit = None
    if args.fit:
        result = search(cfg, target, programs=programs, max_compiles=args.max_compiles, headroom=args.headroom,
                        log=lambda line: print(line, flush=True))
        print(format_fit(result))
        fit = result.to_dict()
        if result.best is None:
            _write_json(args.json, {"config": args.config, "target": target.name, "fit": fit})
            print(f"ict-jax compile: no setting tried fits {target.name}", file=sys.stderr)
            return EXIT_DOES_NOT_FIT
        reports, mesh, source = result.reports, result.mesh, result.model_source
    else:
        t0 = time.perf_counter()
        reports, source = compile_run(cfg, target, programs, dump_dir=args.dump_hlo, response_len=args.response_len,
                                      on_start=lambda name: _progress(f"{name}: compiling for {target.name} ..."),
                                      on_report=lambda r: _progress(program_done_line(r, time.perf_counter() - t0)))
        mesh = reports[0].mesh
    print(render(args.config, target, mesh, source, reports, with_breakdown=args.breakdown))
    _write_json(args.json, to_json(args.config, target, mesh, source, reports, fit))
    bad = [r for r in reports if not r.fits]
    if bad:
        print(f"ict-jax compile: {not_fitting_line(bad[0])}", file=sys.stderr)
        return EXIT_DOES_NOT_FIT
    return 0


def _progress(line: str) -> None:
    """A progress line on stderr (the report itself goes to stdout)."""
    print(f"[compile] {line}", file=sys.stderr, flush=True)


def program_done_line(r, elapsed: float) -> str:
    """``step: compiled in 12.3 s (lowered in 1.1 s), 3.2 GiB live a device of 15.8 GiB: fits (45 s so far)``"""
    from ict_jax.memory import fmt_bytes

    if not r.compiled:
        what = f"does not fit ({r.error})"
    else:
        hbm = f" of {fmt_bytes(r.hbm)}" if r.hbm else ""
        what = f"{fmt_bytes(r.live)} live a device{hbm}: {'fits' if r.fits else 'does not fit'}"
    return (f"{r.program}: compiled in {r.compile_s:.1f} s (lowered in {r.lower_s:.1f} s), {what} "
            f"({elapsed:.0f} s so far)")


def _write_json(path: str | None, data: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(data, indent=2, default=str))
