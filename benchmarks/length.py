"""What the response length costs: step and rollout time vs rollout.max_new_tokens at a fixed
answer length, the update at a realistic length distribution, and the compile count and time per bucket;
"before" (rollout.min_response_bucket: null: every update and decode step at max_new_tokens) and "after"
(response buckets, the default) in one run.

    ict-jax sft --config configs/demo.yaml run_dir=R          # the demo model after its SFT warm start
    python benchmarks/length.py --model R/sft_model           # all three parts
    python benchmarks/length.py --model R/sft_model --parts trainer --lengths 16 128 --seeds 0

Parts:

- ``trainer``: the issue's command, ``ict-jax train --config configs/demo.yaml model.path=R/sft_model
  train.sft_steps=0 train.steps=10 ... rollout.max_new_tokens=N seed=S`` (a subprocess per run, runs
  interleaved: for each seed, each N, before then after). Per run the median ``time/update_s`` and
  ``time/rollout_s`` over the steps after the first (the first compiles); per mode the ratio of the
  largest N to the smallest, mean +- sd over seeds. The SFT model answers in ~6 tokens whatever N.
- ``isolated``: the rollout (the jitted sampler) and the update (the jitted step) alone, in process, on
  the SFT model's answers to the demo's first training prompts; per mode, every N is timed once per
  round, ``--reps`` rounds of rollouts, then ``--reps`` rounds of updates (the load hits all alike), wall
  and process CPU time medians.
- ``realistic``: the update alone (in process) on batches whose response lengths follow a real
  Qwen2.5-0.5B's on GSM8K-style problems (docs/benchmarks.md: mean ~180 tokens): lognormal with median
  ``--median-len`` and sigma ``--sigma``, capped at ``--max-new-tokens`` (a capped row is truncated).
  Bucketed vs the uncut step on the same batches, after compilation; the drawn lengths are recorded.
- ``compile``: every response bucket of the step at the largest N, and the rollout sampler with and
  without decode phases, compiled ahead of time (lower + compile), timed one by one.

Wall times and process CPU times; the machine is shared, so the JSON records the 1-minute load average
before and after each part. Prints tables and writes benchmarks/results/length.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results" / "length.json"
MODES = {"before": ["rollout.min_response_bucket=null"], "after": []}


def _load() -> float:
    return round(os.getloadavg()[0], 2)


def _mean_sd(xs: list[float]) -> list[float]:
    return [float(np.mean(xs)), float(np.std(xs, ddof=1)) if len(xs) > 1 else 0.0]


# ------------------------------------------------------------------------------------------------
# Part 1: the trainer, the command
# ------------------------------------------------------------------------------------------------
def trainer_run(args, n: int, mode: str, seed: int, work: Path) -> dict:
    run = work / f"{mode}_{n}_{seed}"
    cmd = [sys.executable, "-m", "ict_jax.cli", "train", "--config", str(args.config), "--no-progress",
           f"model.path={args.model}", "train.sft_steps=0", f"train.steps={args.steps}", "train.eval_every=1000",
           "train.save_every=1000", f"rollout.max_new_tokens={n}", f"seed={seed}", f"run_dir={run}", *MODES[mode]]
    load, t0 = _load(), time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=False)
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r.get("phase", "rl") == "rl" and "time/update_s" in r]
    later = rows[1:]  # the first step compiles
    return {"max_new_tokens": n, "mode": mode, "seed": seed, "steps": len(rows),
            "update_s": [r["time/update_s"] for r in rows], "rollout_s": [r["time/rollout_s"] for r in rows],
            "update_s_median": float(np.median([r["time/update_s"] for r in later])),
            "rollout_s_median": float(np.median([r["time/rollout_s"] for r in later])),
            "first_update_s": rows[0]["time/update_s"], "first_rollout_s": rows[0]["time/rollout_s"],
            "response_length_mean": float(np.mean([r["response/length_mean"] for r in rows])),
            "truncated_frac": float(np.mean([r["response/truncated_frac"] for r in rows])),
            "step_programs": sorted({int(r.get("train/response_len", n)) for r in rows}),
            "wall_s": round(time.perf_counter() - t0, 1), "load_before": load, "load_after": _load()}


def part_trainer(args) -> dict:
    runs = []
    with tempfile.TemporaryDirectory() as work:
        for seed in args.seeds:
            for n in args.lengths:
                for mode in args.modes:
                    r = trainer_run(args, n, mode, seed, Path(work))
                    runs.append(r)
                    print(f"  seed {seed} N {n:>4} {mode:>6}: update {r['update_s_median']:.3f} s, rollout "
                          f"{r['rollout_s_median']:.3f} s, answers {r['response_length_mean']:.2f} tokens, "
                          f"step programs {r['step_programs']} (load {r['load_before']})", flush=True)
    lo, hi = min(args.lengths), max(args.lengths)
    table = {}
    for mode in args.modes:
        for n in args.lengths:
            sel = [r for r in runs if r["mode"] == mode and r["max_new_tokens"] == n]
            table[f"{mode} {n}"] = {k: _mean_sd([r[k] for r in sel]) for k in ("update_s_median", "rollout_s_median")}
            for k in ("update_s", "rollout_s"):  # every step after the first of every seed, pooled
                table[f"{mode} {n}"][f"{k}_pooled_median"] = float(np.median([x for r in sel for x in r[k][1:]]))
        ratio = {}
        for k in ("update_s_median", "rollout_s_median"):
            per_seed = []
            for seed in args.seeds:
                a, b = (next(r[k] for r in runs if r["mode"] == mode and r["max_new_tokens"] == m and r["seed"] == seed)
                        for m in (hi, lo))
                per_seed.append(a / b)
            ratio[k] = _mean_sd(per_seed)
        for k in ("update_s", "rollout_s"):
            ratio[f"{k}_pooled_median"] = (table[f"{mode} {hi}"][f"{k}_pooled_median"]
                                           / table[f"{mode} {lo}"][f"{k}_pooled_median"])
        table[f"{mode} ratio {hi}/{lo}"] = ratio
    return {"runs": runs, "summary": table}


# ------------------------------------------------------------------------------------------------
# Part 2: the update at a realistic length distribution
# ------------------------------------------------------------------------------------------------
def _batch(rng, lengths: np.ndarray, width: int, prompt_len: int, vocab: int, G: int):
    import jax.numpy as jnp

    from ict_jax.rl.batch import RolloutBatch
    from ict_jax.rl.losses import group_advantages

    B = len(lengths)
    tokens = rng.integers(3, vocab, (B, prompt_len + width)).astype(np.int32)
    am = np.ones_like(tokens)
    rv = np.zeros((B, width), np.float32)
    for i, n in enumerate(lengths):
        rv[i, :n] = 1.0
        am[i, prompt_len + n:] = 0
    r = rng.integers(0, 2, B).astype(np.float32)
    return RolloutBatch(tokens=jnp.asarray(tokens), attention_mask=jnp.asarray(am), response_valid=jnp.asarray(rv),
                        rewards=jnp.asarray(r), advantages=group_advantages(jnp.asarray(r), G),
                        sampler_logp=jnp.asarray(np.where(rv > 0, -rng.random((B, width)), 0).astype(np.float32)),
                        truncated=jnp.asarray((lengths >= width).astype(np.float32)), row_valid=jnp.ones(B),
                        correct=jnp.asarray(r))


def part_realistic(args) -> dict:
    import jax

    from ict_jax.buckets import response_buckets
    from ict_jax.config_load import load_config
    from ict_jax.model.config import ModelConfig
    from ict_jax.model.qwen2 import init_model, param_count
    from ict_jax.rl.state import init_train_state
    from ict_jax.rl.train_step import bucket_of, make_train_step

    W, P, G, Lp = args.max_new_tokens, args.prompts, args.samples, args.prompt_len
    cfg = load_config(args.config, [f"rollout.max_new_tokens={W}", f"rollout.num_samples={G}",
                                    f"train.prompts_per_step={P}", "rl.selector.warmup_steps=0",
                                    f"stats.chunk={args.chunk}", f"model.remat={args.remat}"])
    mc = ModelConfig.preset(args.preset, **({"vocab_size": 100} if args.preset in ("tiny", "demo") else {}),
                            remat=cfg.model.remat)
    rng = np.random.default_rng(0)
    draws = [np.minimum(np.maximum(1, np.round(rng.lognormal(np.log(args.median_len), args.sigma, P * G))), W)
             .astype(int) for _ in range(args.batches)]
    batches = [_batch(rng, d, W, Lp, mc.vocab_size, G) for d in draws]
    step = make_train_step(cfg)
    state = init_train_state(cfg, init_model(mc, seed=0))
    times: dict[str, list[list[float]]] = {"before": [], "after": []}
    buckets = [bucket_of(step.plan, b) for b in batches]
    for b, n in zip(batches, buckets):  # compile every program first: the times below are steady state
        for length in (W, n):
            state, m = step(state, b, response_len=length)
            jax.block_until_ready(m)
    for _ in range(args.repeats):
        for b, n in zip(batches, buckets):
            for mode, length in (("before", W), ("after", n)):
                w0, c0 = time.perf_counter(), time.process_time()
                state, m = step(state, b, response_len=length)
                jax.block_until_ready(m)
                times[mode].append([time.perf_counter() - w0, time.process_time() - c0])
    lengths = np.concatenate(draws)
    out = {"model": args.preset, "params": param_count(mc), "remat": args.remat, "rows": P * G, "prompt_len": Lp, "max_new_tokens": W,
           "buckets": list(response_buckets(W, cfg.rollout.min_response_bucket)),
           "distribution": {"kind": "lognormal", "median": args.median_len, "sigma": args.sigma,
                            "mean": float(lengths.mean()), "p50": float(np.median(lengths)),
                            "p90": float(np.percentile(lengths, 90)), "max": int(lengths.max()),
                            "truncated_frac": float((lengths >= W).mean()),
                            "batch_longest": [int(d.max()) for d in draws], "batch_bucket": buckets},
           "update_wall_s_median": {k: float(np.median([t[0] for t in v])) for k, v in times.items()},
           "update_cpu_s_median": {k: float(np.median([t[1] for t in v])) for k, v in times.items()},
           "tokens_valid_frac": float(lengths.sum() / (len(lengths) * W))}
    out["speedup_wall"] = out["update_wall_s_median"]["before"] / out["update_wall_s_median"]["after"]
    return out


# ------------------------------------------------------------------------------------------------
# Part 2b: the rollout and the update alone, interleaved (robust to the machine's load)
# ------------------------------------------------------------------------------------------------
def part_isolated(args) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from ict_jax.config_load import load_config
    from ict_jax.data.datasets import load_dataset
    from ict_jax.data.prompts import PromptIterator, encode_prompts
    from ict_jax.rl.batch import build_rollout_batch
    from ict_jax.rl.state import init_train_state
    from ict_jax.rl.train_step import make_train_step
    from ict_jax.sampling.sampler import make_generate_fn
    from ict_jax.train.model_source import resolve_model

    source = resolve_model(args.model, tokenizer="char")
    model, tok = source.load(), source.tokenizer()
    gd, params = nnx.split(model)
    base = load_config(args.config, [f"model.path={args.model}"])
    r = base.rollout
    enc = encode_prompts(load_dataset(base.data.train[0], seed=base.seed), tok, template=base.data.template,
                         max_prompt_len=r.max_prompt_len, max_new_tokens=max(args.lengths))
    pb = next(PromptIterator(enc, base.train.prompts_per_step, seed=base.seed))
    ids, mask = jnp.asarray(pb.ids), jnp.asarray(pb.mask)
    rng = np.random.default_rng(0)
    variants = {}
    for n in args.lengths:
        for mode in args.modes:
            cfg = load_config(args.config, [f"model.path={args.model}", f"rollout.max_new_tokens={n}", *MODES[mode]])
            gen = make_generate_fn(gd, num_samples=r.num_samples, max_new_tokens=n, temperature=r.temperature,
                                   eos_ids=tok.eos_ids, pad_id=tok.pad_id,
                                   min_response_bucket=cfg.rollout.min_response_bucket)
            own = nnx.merge(gd, jax.tree.map(jnp.copy, params))  # the step donates its state: a copy each
            variants[(mode, n)] = {"cfg": cfg, "gen": gen, "step": make_train_step(cfg),
                                   "state": init_train_state(cfg, own), "roll": [], "upd": []}

    def timed(fn: Any) -> tuple[Any, float, float]:
        w0, c0 = time.perf_counter(), time.process_time()
        out = jax.block_until_ready(fn())
        return out, time.perf_counter() - w0, time.process_time() - c0

    for i, v in enumerate(variants.values()):  # compile both programs; each variant's batch for the update
        ro = v["gen"](params, ids, mask, jax.random.key(i))
        rewards = rng.integers(0, 2, ro.tokens.shape[0]).astype(np.float32)
        v["batch"] = build_rollout_batch(ids, mask, ro, rewards, config=v["cfg"])
        v["state"], _ = timed(lambda v=v: v["step"](v["state"], v["batch"]))[0]
    # each mode's variants interleaved among themselves, rollouts and updates in separate rounds: timed
    # right after a 4-s "before" update, a 40-ms rollout or a 0.5-s update of another variant took up to
    # twice as long in a first version of this part (the machine settling after the big program)
    for mode in args.modes:
        group = [v for (m, _), v in variants.items() if m == mode]
        for i in range(args.reps):
            for v in group:
                ro, w, c = timed(lambda v=v, i=i: v["gen"](params, ids, mask, jax.random.key(i + 1)))
                v["roll"].append([w, c, float(ro.lengths.mean())])
        for _ in range(args.reps):
            for v in group:
                (v["state"], m), w, c = timed(lambda v=v: v["step"](v["state"], v["batch"]))
                v["upd"].append([w, c, float(m["train/response_len"])])
    rows = []
    for (mode, n), v in variants.items():
        ro, up = np.asarray(v["roll"]), np.asarray(v["upd"])
        rows.append({"mode": mode, "max_new_tokens": n, "rollout_wall_s": float(np.median(ro[:, 0])),
                     "rollout_cpu_s": float(np.median(ro[:, 1])), "update_wall_s": float(np.median(up[:, 0])),
                     "update_cpu_s": float(np.median(up[:, 1])), "answer_len_mean": float(ro[:, 2].mean()),
                     "update_response_len": sorted(set(up[:, 2].astype(int).tolist()))})
    lo, hi = min(args.lengths), max(args.lengths)
    ratios = {}
    for mode in args.modes:
        a, b = (next(x for x in rows if x["mode"] == mode and x["max_new_tokens"] == m) for m in (hi, lo))
        ratios[f"{mode} {hi}/{lo}"] = {k: a[k] / b[k] for k in ("rollout_wall_s", "rollout_cpu_s", "update_wall_s",
                                                                 "update_cpu_s")}
    return {"prompts": int(ids.shape[0]), "samples": r.num_samples, "reps": args.reps, "rows": rows, "ratios": ratios}


# ------------------------------------------------------------------------------------------------
# Part 3: compile count and time per bucket
# ------------------------------------------------------------------------------------------------
def part_compile(args) -> dict:
    import jax
    from flax import nnx

    from ict_jax.buckets import response_buckets
    from ict_jax.config_load import load_config
    from ict_jax.rl.state import init_train_state
    from ict_jax.rl.train_step import make_train_step
    from ict_jax.sampling.sampler import make_generate_fn
    from ict_jax.sharding import make_mesh
    from ict_jax.train.model_source import resolve_model
    from ict_jax.train.programs import abstract_batch, prompt_len

    N = max(args.lengths)
    cfg = load_config(args.config, [f"rollout.max_new_tokens={N}", f"model.path={args.model}"])
    source = resolve_model(args.model, tokenizer="char")
    model, tok = source.load(), source.tokenizer()
    state = init_train_state(cfg, model)
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state)
    batch = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), abstract_batch(cfg, make_mesh(1, 1, 1,
                         devices=jax.devices()[:1])))
    step = make_train_step(cfg)
    rows = []
    for b in response_buckets(N, cfg.rollout.min_response_bucket):
        t0 = time.perf_counter()
        lowered = step.lower(abstract, batch, response_len=b)
        t1 = time.perf_counter()
        compiled = lowered.compile()
        rows.append({"program": "step", "response_len": b, "lower_s": t1 - t0, "compile_s": time.perf_counter() - t1,
                     "temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes)})
    gd, params = nnx.split(model)
    r = cfg.rollout
    P, Lp = cfg.train.prompts_per_step, prompt_len(cfg)
    ids = jax.ShapeDtypeStruct((P, Lp), np.int32)
    key = jax.eval_shape(lambda: jax.random.key(0))
    for label, mb in (("one phase", None), ("phases", r.min_response_bucket)):
        fn = make_generate_fn(gd, num_samples=r.num_samples, max_new_tokens=N, temperature=r.temperature,
                              eos_ids=tok.eos_ids, pad_id=tok.pad_id, min_response_bucket=mb)
        t0 = time.perf_counter()
        lowered = fn.jitted.lower(params, ids, ids, key)
        t1 = time.perf_counter()
        lowered.compile()
        rows.append({"program": f"generate ({label})", "phases": len(response_buckets(N, mb)),
                     "lower_s": t1 - t0, "compile_s": time.perf_counter() - t1})
    return {"max_new_tokens": N, "step_programs": len(response_buckets(N, cfg.rollout.min_response_bucket)),
            "rows": rows}


# ------------------------------------------------------------------------------------------------
def _print_trainer(res: dict) -> None:
    print("\n| mode | max_new_tokens | update s (median), mean +- sd over seeds | rollout s (median) |")
    print("|---|---|---|---|")
    for k, v in res["summary"].items():
        if "ratio" in k:
            continue
        mode, n = k.split()
        u, r = v["update_s_median"], v["rollout_s_median"]
        print(f"| {mode} | {n} | {u[0]:.3f} +- {u[1]:.3f} | {r[0]:.3f} +- {r[1]:.3f} |")
    for k, v in res["summary"].items():
        if "ratio" in k:
            u, r = v["update_s_median"], v["rollout_s_median"]
            print(f"{k}: update {u[0]:.2f}x +- {u[1]:.2f}, rollout {r[0]:.2f}x +- {r[1]:.2f} (per-seed ratios); "
                  f"pooled medians: update {v['update_s_pooled_median']:.2f}x, rollout {v['rollout_s_pooled_median']:.2f}x")


def _print_isolated(res: dict) -> None:
    print("\n| mode | max_new_tokens | rollout wall / CPU s | update wall / CPU s | answer length | update at |")
    print("|---|---|---|---|---|---|")
    for x in res["rows"]:
        print(f"| {x['mode']} | {x['max_new_tokens']} | {x['rollout_wall_s']:.3f} / {x['rollout_cpu_s']:.3f} | "
              f"{x['update_wall_s']:.3f} / {x['update_cpu_s']:.3f} | {x['answer_len_mean']:.2f} | "
              f"{x['update_response_len']} |")
    for k, v in res["ratios"].items():
        print(f"{k}: rollout {v['rollout_wall_s']:.2f}x wall / {v['rollout_cpu_s']:.2f}x CPU, update "
              f"{v['update_wall_s']:.2f}x wall / {v['update_cpu_s']:.2f}x CPU")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="the demo model after SFT (R/sft_model)")
    ap.add_argument("--config", default=str(ROOT / "configs" / "demo.yaml"))
    ap.add_argument("--parts", nargs="+", default=["trainer", "isolated", "realistic", "compile"],
                    choices=["trainer", "isolated", "realistic", "compile"])
    ap.add_argument("--lengths", nargs="+", type=int, default=[16, 32, 64, 128], help="max_new_tokens values")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=10, help="RL steps a trainer run")
    ap.add_argument("--reps", type=int, default=15, help="isolated: interleaved rounds")
    ap.add_argument("--preset", default="demo", help="realistic: the model preset (random weights)")
    ap.add_argument("--max-new-tokens", type=int, default=1024, help="realistic: the response width")
    ap.add_argument("--median-len", type=float, default=160.0, help="realistic: median response length")
    ap.add_argument("--sigma", type=float, default=0.55, help="realistic: lognormal sigma")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=64, help="realistic: stats.chunk")
    ap.add_argument("--remat", default="block", help="realistic: model.remat (attention over 1k tokens)")
    ap.add_argument("--batches", type=int, default=4, help="realistic: batches drawn")
    ap.add_argument("--repeats", type=int, default=2, help="realistic: timed passes over the batches")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()
    args.model = str(Path(args.model).resolve())

    import jax

    from ict_jax.experiments.provenance import machine
    result = {"machine": machine() | {"backend": jax.default_backend(), "jax": jax.__version__},
              "settings": vars(args)}
    for part in args.parts:
        print(f"== {part} (load {_load()})", flush=True)
        load = _load()
        res = {"trainer": part_trainer, "isolated": part_isolated, "realistic": part_realistic,
               "compile": part_compile}[part](args)
        res["load_before_after"] = [load, _load()]
        result[part] = res
        if part == "trainer":
            _print_trainer(res)
        elif part == "isolated":
            _print_isolated(res)
        elif part == "realistic":
            d = res["distribution"]
            print(f"lengths: mean {d['mean']:.0f}, p50 {d['p50']:.0f}, p90 {d['p90']:.0f}, max {d['max']}; "
                  f"buckets met {d['batch_bucket']} of {res['buckets']}")
            print(f"update median: before {res['update_wall_s_median']['before']:.3f} s, after "
                  f"{res['update_wall_s_median']['after']:.3f} s ({res['speedup_wall']:.2f}x); CPU "
                  f"{res['update_cpu_s_median']['before']:.3f} / {res['update_cpu_s_median']['after']:.3f} s")
        else:
            for row in res["rows"]:
                what = f"response {row['response_len']}" if "response_len" in row else f"{row['phases']} phase(s)"
                print(f"{row['program']:<22} {what:<14} lower {row['lower_s']:.1f} s, compile {row['compile_s']:.1f} s")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2, default=str))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
