"""The demo's SFT warm start: held-out P@1 every ``--every`` SFT steps, per seed (why ``train.sft_steps``
is 500 in configs/demo.yaml; docs/results.md).

    python benchmarks/demo_warm_start.py                    # seeds 0 1 2, 1,200 SFT steps, P@1 every 100
    python benchmarks/demo_warm_start.py --seeds 0 --steps 600

Each seed builds the demo's run (``train.parts.build_parts``, ``seed=S``) and runs the library's own warm
start, step by step: the same batches (the SFT-order stream at each step, ``train.warm_start.sft_batch``),
the same optimizer and the same evaluation (``train.evaluation.Evaluator``: 256 held-out problems, n = 4,
temperature 0.6) as ``ict-jax train --config configs/demo.yaml seed=S``. The SFT learning rate is
constant after its 5-step warm-up, so the weights at step N are those of an N-step warm start: one run
gives the whole curve (the 1,200-step value equals the demo run's "after SFT", checked). Prints a table;
writes benchmarks/results/demo_warm_start.json. About 6 minutes a seed on 2 shared cores.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def curve(seed: int, steps: int, every: int, run_dir: Path) -> list[dict]:
    """[{sft_steps, loss, pass@1}] of one seed's warm start, every ``every`` steps."""
    from ict_jax.config_load import load_config
    from ict_jax.rl.sft import make_sft_step
    from ict_jax.rl.state import TrainState, init_opt_state
    from ict_jax.train.evaluation import Evaluator
    from ict_jax.train.parts import build_parts
    from ict_jax.train.warm_start import sft_batch, sft_data

    cfg = load_config(ROOT / "configs" / "demo.yaml", [f"seed={seed}", f"run_dir={run_dir}",
                                                       f"train.sft_steps={steps}"])
    parts, state, _ = build_parts(cfg, progress=False)
    out = []
    try:
        sft = make_sft_step(cfg, parts.mesh)
        st = TrainState(params=state.params, opt_state=init_opt_state(sft.tx, state.params), step=state.step,
                        rng=state.rng, graphdef=state.graphdef)
        data, evaluator, t0 = sft_data(parts), Evaluator(parts), time.time()
        for s in range(steps):
            st, m = sft(st, *sft_batch(parts, data, s))
            if (s + 1) % every == 0:
                res = evaluator.evaluate(st, s + 1)
                p1 = next(v for k, v in res.items() if k.endswith("pass@1"))
                out.append({"sft_steps": s + 1, "loss": float(m["sft/loss"]), "pass@1": p1})
                print(f"seed {seed}: {s + 1} SFT steps, loss {out[-1]['loss']:.3f}, P@1 {p1:.3f} "
                      f"({time.time() - t0:.0f} s)", flush=True)
    finally:
        parts.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=1200, help="SFT steps (constant lr: a prefix is a shorter run)")
    ap.add_argument("--every", type=int, default=100, help="evaluate every N SFT steps")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "demo_warm_start.json"))
    args = ap.parse_args()
    curves = {}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            curves[seed] = curve(seed, args.steps, args.every, Path(tmp) / f"s{seed}")
    points = [p["sft_steps"] for p in curves[args.seeds[0]]]
    print("\nP@1 after N SFT steps (configs/demo.yaml, 256 held-out problems, n = 4, T = 0.6)")
    print("N      " + "  ".join(f"seed {s}" for s in args.seeds))
    for i, n in enumerate(points):
        print(f"{n:<6} " + "  ".join(f"{curves[s][i]['pass@1']:>6.3f}" for s in args.seeds))
    from ict_jax.experiments.provenance import machine
    record = {"machine": machine() | {"load_average": os.getloadavg()},
              "config": "configs/demo.yaml", "seeds": {str(s): c for s, c in curves.items()}}
    Path(args.out).write_text(json.dumps(record, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
