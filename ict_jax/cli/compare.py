"""``ict-jax compare``: every method x seed from one shared warm start (:mod:`ict_jax.tools.compare`)."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_compare_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="YAML config: the warm start and every run's settings")
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


def compare_main(args: argparse.Namespace) -> int:
    import jax

    from ict_jax.tools.compare import PLOTS, run_comparison

    results = run_comparison(args.config, methods=args.methods, seeds=args.seeds, rhos=args.rho, out=args.out,
                             target_reward=args.target_reward, overrides=args.overrides,
                             progress=not args.no_progress)
    if jax.process_index() == 0:
        out = Path(results["out"])
        print((out / "results.md").read_text(), end="")
        print(f"\nwrote {out / 'results.md'}, {out / 'results.json'}, "
              + ", ".join(str(out / png) for _, png in PLOTS.values()))
    return 0
