"""The compiles behind docs/tpu.md's tables: each recipe x TPU slice, compiled with the real TPU compiler
(libtpu, the ``tpu`` extra) on a CPU machine, nothing run (``ict-jax compile``).

    python benchmarks/tpu_compile.py run [NAME ...]   # compile the listed jobs (default: those not yet logged)
    python benchmarks/tpu_compile.py tables           # every logged compile as one markdown table (per-chip GiB)

Every compile appends one JSON line to benchmarks/results/tpu_compile.jsonl: the job, the command line
that reproduces it, the date, the machine's load average before and after (compile times on a shared
2-core machine depend on it), the wall time, and ``ict-jax compile --json``'s report (per-chip bytes of
every program, fits, compile seconds, collectives, checks). A job that does not fit is a result too.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOG = ROOT / "benchmarks" / "results" / "tpu_compile.jsonl"
GIB = 1024 ** 3

# name -> the arguments of `ict-jax compile` (docs/tpu.md's tables). "--topology" absent: the recipe's
# mesh.target. Recipes as shipped, on their own slice and on others (the `-1` mesh axis takes the chips),
# the recipes' earlier settings (before they were fitted to their slices), --fit, and 7B at fsdp
# 8 -> 16 -> 32 with 4 rows a chip a micro-batch.
_0P5B, _1P5B, _7B = ("configs/qwen2p5_0p5b_ict.yaml", "configs/qwen2p5_1p5b_ict.yaml", "configs/qwen2p5_7b_ict.yaml")
JOBS: dict[str, list[str]] = {
    # every recipe as shipped on its mesh.target: all three programs
    "0p5b_shipped": ["--config", _0P5B],
    "1p5b_shipped": ["--config", _1P5B],
    "1p5b_fit_v5e8": ["--config", _1P5B, "--topology", "v5e:2x4", "--fit", "--max-compiles", "3"],
    "7b_shipped": ["--config", _7B],
    # the recipes' earlier settings, before they were fitted to their slices
    "0p5b_before_v5e8": ["--config", _0P5B, "--program", "step", "mesh.data=-1", "mesh.fsdp=1",
                         "train.micro_batches=2"],
    "1p5b_before_v5e8": ["--config", _1P5B, "--program", "step", "mesh.tensor=1", "train.micro_batches=4"],
    # recipe x slice
    "0p5b_v6e8": ["--config", _0P5B, "--topology", "v6e:2x4", "--program", "step"],
    "0p5b_v5p8": ["--config", _0P5B, "--topology", "v5p:2x2x1", "--program", "step"],
    "0p5b_v5e16": ["--config", _0P5B, "--topology", "v5e:4x4", "--program", "step"],
    "1p5b_v6e8": ["--config", _1P5B, "--topology", "v6e:2x4", "--program", "step"],
    "1p5b_v5p8": ["--config", _1P5B, "--topology", "v5p:2x2x1", "--program", "step"],
    "1p5b_v5e16": ["--config", _1P5B, "--topology", "v5e:4x4", "--program", "step"],
    "7b_v6e8_m4_full": ["--config", _7B, "--topology", "v6e:2x4", "--program", "step", "mesh.fsdp=-1",
                        "train.micro_batches=4", "model.remat=full", "stats.chunk=64"],
    # 7B past one host: fsdp 8 -> 16 -> 32 on v5e, 4 rows a chip a micro-batch
    "7b_v5e8_m8_full": ["--config", _7B, "--topology", "v5e:2x4", "--program", "step", "train.micro_batches=8",
                        "model.remat=full", "stats.chunk=64"],
    "7b_v5e16_m4_full": ["--config", _7B, "--topology", "v5e:4x4", "--program", "step", "train.micro_batches=4",
                         "model.remat=full", "stats.chunk=64"],
    "7b_v5e32_m2_full": ["--config", _7B, "--topology", "v5e:4x8", "--program", "step", "train.micro_batches=2",
                         "model.remat=full", "stats.chunk=64"],
    # the H200 benchmark's 0.5B step (benchmarks/accelerator.py: P 4 x G 8, 128 + 1,024 tokens, one mini-batch
    # of one micro-batch, bf16) on one v5p chip, with the bytes by category: the before/after check of the
    # step's memory traffic (docs/benchmarks.md "The step's bytes by category")
    "0p5b_h200_v5p1": ["--config", _0P5B, "--topology", "v5p:1x1x1", "--program", "step", "--breakdown",
                       "train.prompts_per_step=4", "rollout.num_samples=8", "rollout.max_prompt_len=128",
                       "rollout.max_new_tokens=1024", "train.mini_batches=1", "train.micro_batches=1", "mesh.data=1",
                       "mesh.fsdp=-1", "mesh.tensor=1"],
    # LoRA: the 7B on one v5e-8 host, base frozen in bfloat16, rank 16 on the seven projections;
    # every program (the full-parameter step does not fit here: 7b_v5e8_m8_full)
    "7b_lora_v5e8": ["--config", _7B, "--topology", "v5e:2x4", "model.lora.enabled=true",
                     "model.lora.base_dtype=bfloat16", "mesh.data=1", "mesh.fsdp=8", "train.micro_batches=8",
                     "model.remat=full", "stats.chunk=128", "rollout.chunks=2"],
}


def _load() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def logged() -> dict[str, dict]:
    out = {}
    if LOG.exists():
        for line in LOG.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                out[rec["job"]] = rec
    return out


def run(names: list[str]) -> None:
    from ict_jax.cli.main import main

    done = logged()
    todo = names or [n for n in JOBS if n not in done]
    for name in todo:
        argv = ["compile"] + JOBS[name]
        out = ROOT / "benchmarks" / "results" / f".tpu_compile_{name}.json"
        start, load0 = time.time(), _load()
        print(f"== {name}: ict-jax {' '.join(argv)} (load {load0})", flush=True)
        rc = main(argv + ["--json", str(out)])
        record(name, "ict-jax " + " ".join(argv), rc, load0, _load(), time.time() - start,
               json.loads(out.read_text()) if out.exists() else None)
        out.unlink(missing_ok=True)


def record(name: str, command: str, rc: int, load_before: str, load_after: str, wall_s: float,
           report: dict | None, date: str | None = None) -> None:
    """Append one compile to the log."""
    from ict_jax.experiments.provenance import machine
    rec = {"job": name, "command": command, "rc": rc,
           "date": date or datetime.datetime.now().isoformat(timespec="seconds"), "load_before": load_before,
           "load_after": load_after, "wall_s": round(wall_s, 1),
           "machine": machine(), "report": report}
    LOG.parent.mkdir(parents=True, exist_ok=True)
    with LOG.open("a") as f:
        f.write(json.dumps(rec) + "\n")


def _g(n: int | None) -> str:
    return "-" if n is None else f"{n / GIB:.2f}"


def _settings(command: str) -> str:
    keys = ("mesh.data=", "mesh.fsdp=", "mesh.tensor=", "train.micro_batches=", "model.remat=", "stats.chunk=")
    return ", ".join(o for o in command.split() if o.startswith(keys)) or "as shipped"


def rows(rec: dict) -> list[dict]:
    """One row per program of a logged compile: per-chip GiB (arguments from the shardings when the
    compiler refused the program: it reports only its temporaries then)."""
    rep = rec["report"] or {}
    out = []
    for p in rep.get("programs", []):
        args = p["arguments"] if p["arguments"] is not None else p["expected_arguments"]
        live = p["live"] if p["live"] is not None else (
            None if p["temporaries"] is None else args + p["temporaries"] + p["resident"])
        out.append({"job": rec["job"], "slice": rep["target"], "mesh": rep.get("mesh") or {}, "program": p["program"],
                    "settings": _settings(rec["command"]), "arguments": _g(args), "temporaries": _g(p["temporaries"]),
                    "live": ("" if p["compiled"] else ">= ") + _g(live), "hbm": _g(p["hbm"]),
                    "fits": "yes" if p["fits"] else "NO", "compile_s": f"{p['compile_s']:.0f}",
                    "load": rec["load_before"].split()[0]})
    return out


def tables() -> None:
    cols = ("job", "slice", "mesh", "settings", "program", "arguments", "temporaries", "live", "hbm", "fits",
            "compile_s", "load")
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for rec in logged().values():
        for r in rows(rec):
            m = r["mesh"]
            r["mesh"] = f"{m.get('data', '?')} x {m.get('fsdp', '?')} x {m.get('tensor', '?')}"
            print("| " + " | ".join(str(r[c]) for c in cols) + " |")


def main_cli(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=("run", "tables"))
    ap.add_argument("names", nargs="*")
    a = ap.parse_args(argv)
    if a.mode == "run":
        unknown = [n for n in a.names if n not in JOBS]
        if unknown:
            print(f"unknown jobs {unknown}; known: {', '.join(JOBS)}", file=sys.stderr)
            return 2
        run(a.names)
    else:
        tables()
    return 0


if __name__ == "__main__":
    sys.exit(main_cli())
