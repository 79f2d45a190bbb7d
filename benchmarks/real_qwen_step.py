"""The real Qwen2.5-Coder-0.5B's RL step on this CPU: time split and memory, read from
finished runs of the CPU recipes and from `ict-jax compile --topology local --json`.

    flock /work/notes/realmodel.lock nice ict-jax train --config configs/qwen2p5_coder_0p5b_cpu_ict.yaml \\
        train.steps=2 'data.eval=[]' run_dir=/tmp/real_runs/ict2
    ict-jax compile --config configs/qwen2p5_coder_0p5b_cpu_ict.yaml --topology local --json /tmp/compile_ict.json
    python benchmarks/real_qwen_step.py --run ict=/tmp/real_runs/ict2 --run grpo=/tmp/real_runs/grpo2 \\
        --compile ict=/tmp/compile_ict.json --compile grpo=/tmp/compile_grpo.json

For each run: every RL step's ``time/sample_s`` (generation), ``time/rewards_s`` (decoding and checking
the answers), ``time/update_s`` (the one compiled train step: the old-policy and reference passes, the
token statistics and the selector's mask, the loss, its gradient and AdamW) as mean +- sd over the run's
steps, the response tokens, and ``summary.json``'s ``memory`` block (each program's ``device_bytes``, the
pre-flight's ``predicted_peak`` and the process's measured ``peak_rss``). For each compile JSON: every
program's arguments / temporaries / outputs / aliased / resident / live bytes. The token statistics are
not timed apart from the update: they run inside the same compiled program, for every method (GRPO's
step computes them too, for its metrics), so the ICT and GRPO update times do not isolate them either;
benchmarks/token_stats.py times the statistics alone. Prints a table; writes
benchmarks/results/real_qwen_step.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

GIB = 2**30
TIMES = ("time/sample_s", "time/rewards_s", "time/rollout_s", "time/update_s")


def mean_sd(xs: list[float]) -> tuple[float, float]:
    return (statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0)


def read_run(run: Path) -> dict:
    """The RL steps' times and the memory record of a finished run directory."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rl = [r for r in rows if "time/update_s" in r]
    if not rl:
        raise SystemExit(f"{run}: no RL step in metrics.jsonl")
    summary = json.loads((run / "summary.json").read_text())
    out = {"run_dir": str(run), "steps": len(rl), "status": summary.get("status"),
           "tokens": [r.get("response/length_mean", float("nan")) for r in rl]}
    for k in TIMES:
        out[k] = [float(r[k]) for r in rl if k in r]
    out["reward/accuracy"] = [r.get("reward/accuracy") for r in rl]
    out["mask/selected_frac"] = [r.get("mask/selected_frac") for r in rl]
    mem = summary.get("memory") or {}
    out["memory"] = {k: mem.get(k) for k in ("predicted_peak", "peak_rss")}
    out["memory"]["programs"] = {name: p.get("device_bytes") for name, p in (mem.get("programs") or {}).items()}
    out["memory"]["budget_per_device"] = (mem.get("budget") or {}).get("per_device")
    out["wall_s"] = summary.get("wall_s")
    return out


def read_compile(path: Path) -> dict:
    d = json.loads(path.read_text())
    keys = ("arguments", "temporaries", "outputs", "aliased", "resident", "live", "fits")
    return {"budget": d.get("hbm_bytes"), "programs": {p["program"]: {k: p.get(k) for k in keys}
                                                      for p in d["programs"]}}


def gib(x) -> str:
    return "-" if x is None else f"{x / GIB:.2f} GiB"


def table(runs: dict, compiles: dict) -> str:
    lines = ["| method | steps | sample s | rewards s | update s | step total s | predicted peak | peak RSS |",
             "|---|---|---|---|---|---|---|---|"]
    for name, r in runs.items():
        cells = []
        for k in ("time/sample_s", "time/rewards_s", "time/update_s"):
            m, s = mean_sd(r[k]) if r[k] else (float("nan"), 0.0)
            cells.append(f"{m:.2f} +- {s:.2f}" if m < 1 else f"{m:.1f} +- {s:.1f}")
        tot = [a + b for a, b in zip(r["time/rollout_s"], r["time/update_s"])]
        m, s = mean_sd(tot)
        lines.append(f"| {name} | {r['steps']} | " + " | ".join(cells) + f" | {m:.1f} +- {s:.1f} | "
                     f"{gib(r['memory']['predicted_peak'])} | {gib(r['memory']['peak_rss'])} |")
    lines += ["", "| recipe | program | arguments | temporaries | outputs | aliased | resident | live | budget |",
              "|---|---|---|---|---|---|---|---|---|"]
    for name, c in compiles.items():
        for prog, p in c["programs"].items():
            lines.append(f"| {name} | {prog} | {gib(p['arguments'])} | {gib(p['temporaries'])} | "
                         f"{gib(p['outputs'])} | {gib(p['aliased'])} | {gib(p['resident'])} | {gib(p['live'])} | "
                         f"{gib(c['budget'])} |")
    return "\n".join(lines)


def pairs(items: list[str], flag: str) -> dict[str, Path]:
    out = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not path:
            raise SystemExit(f"{flag} expects NAME=PATH, got {item!r}")
        out[name] = Path(path)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", action="append", default=[], help="NAME=RUN_DIR of a finished run")
    ap.add_argument("--compile", action="append", default=[], help="NAME=JSON from ict-jax compile --json")
    ap.add_argument("--out", default="benchmarks/results/real_qwen_step.json")
    args = ap.parse_args()
    runs = {n: read_run(p) for n, p in pairs(args.run, "--run").items()}
    compiles = {n: read_compile(p) for n, p in pairs(args.compile, "--compile").items()}
    print(table(runs, compiles))
    from ict_jax.experiments.provenance import machine
    record = {"machine": machine() | {"loadavg_at_report": os.getloadavg()},
              "runs": runs, "compiles": compiles}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
