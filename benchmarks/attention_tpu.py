"""The 0.5B train step at the H200 benchmark's shapes compiled for ONE TPU v5p chip, per ``model.attention``:
HLO bytes, FLOPs, live memory and the roofline bound (docs/benchmarks.md "Attention").

    python benchmarks/attention_tpu.py dense splash       # one compile each (~5 min, ~3 GB on 2 cores)

The shapes and settings are ``benchmarks/accelerator.py``'s ``train_0p5b`` (the ICT recipe: KL 0.001,
remat block, stats.chunk 128; P 4 x G 8 rows of 128 prompt + 1,024 response tokens, one micro-batch,
bfloat16 compute). One chip has no collectives and no windowed-einsum loops, so the bytes are the
program's own. libtpu accepts ``v5p:1x1x1`` only with ``chips_per_host_bounds=[1, 1, 1]``. Each compile
appends one JSON line to ``benchmarks/results/attention_tpu.jsonl``; ``--dump-hlo DIR`` writes each
program's HLO text.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOG = ROOT / "benchmarks" / "results" / "attention_tpu.jsonl"


def one_chip_target():
    """A v5p topology of one chip (compile-only devices)."""
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5p-2")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    from jax.experimental import topologies

    from ict_jax.aot.compile import Target, hbm_bytes

    devs = tuple(topologies.get_topology_desc(platform="tpu", topology_name="v5p:1x1x1",
                                              chips_per_host_bounds=[1, 1, 1]).devices)
    return Target("v5p:1x1x1", "tpu", devs, devs[0].device_kind, hbm_bytes(devs), "v5p")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("attention", nargs="+", help="model.attention values to compile")
    ap.add_argument("--dump-hlo", type=Path, default=None, metavar="DIR")
    ap.add_argument("--log", type=Path, default=LOG)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from accelerator import train_config
    from ict_jax.aot.compile import compile_run

    target = one_chip_target()
    for attention in args.attention:
        cfg = train_config("0p5b", False, attention)
        t0 = time.perf_counter()
        (rep,), source = compile_run(cfg, target, ("step",),
                                     dump_dir=None if args.dump_hlo is None else args.dump_hlo / attention)
        wall = time.perf_counter() - t0
        roof = rep.roofline
        from ict_jax.experiments.provenance import machine

        rec = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), machine=machine(),
                   command=" ".join(["python", "benchmarks/attention_tpu.py", attention]), attention=attention,
                   target=target.name, model=source, load_before=os.getloadavg(), wall_s=wall,
                   compile_s=rep.compile_s, live=rep.live, arguments=rep.arguments, temporaries=rep.temporaries,
                   hlo_flops=roof.flops, hlo_bytes=roof.bytes, bound_s=roof.bound_s, bound=roof.bound,
                   failed_checks=[c.name for c in rep.checks if not c.ok])
        args.log.parent.mkdir(parents=True, exist_ok=True)
        with args.log.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        print(f"{attention}: {roof.bytes / 1e12:.3f} TB, {roof.flops / 1e12:.2f} TFLOP, live {rep.live / 2 ** 30:.2f} GiB, "
              f"bound {roof.bound_s * 1e3:.0f} ms ({roof.bound}), compile {rep.compile_s:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
