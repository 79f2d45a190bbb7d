"""Benchmark: dense vs blocked vs fused attention (``model.attention``) at a Qwen2.5-0.5B layer's heads.

``jax.value_and_grad`` (w.r.t. q, k and v) of a weighted sum of one layer's attention over left-padded
causal rows, through (a) :func:`ict_jax.model.attention.attend` (the ``[B, KV, G, T, T]`` float32 scores
at once), (b) :func:`ict_jax.model.attention.blocked_attend` with key blocks of ``--blocks`` and (c)
:func:`ict_jax.model.fused_attention.fused_attend` with the implementations of ``--fused`` that run
here (``xla``: the CPU's; ``splash`` only in Pallas' interpreter, ``cudnn`` only on a GPU). Reports
XLA's ``compiled.memory_analysis()`` temporaries at ``--memory-T`` (compile only) and the CPU time of
both at ``--time-T`` (interleaved rounds: each round times every variant once), float32.

    python benchmarks/attention.py                      # writes benchmarks/results/attention.json
    python benchmarks/attention.py --blocks 64 128 --reps 2
    python benchmarks/attention.py --blocks 128 --fused xla --out benchmarks/results/attention_fused.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from ict_jax.model.attention import attend, blocked_attend
from ict_jax.model.fused_attention import fused_attend

H, KV, HD = 14, 2, 64  # Qwen2.5-0.5B: 14 query heads, 2 KV heads, head_dim 64


def make_fn(block: int | str | None):
    """``block``: None = dense, an int = blocked, a string = that fused implementation."""
    def loss(q, k, v, allowed, w):
        if isinstance(block, str):  # the key mask: the last query row of a causal mask sees every real key
            out = fused_attend(q, k, v, allowed[:, -1, :], jnp.float32, block)
        elif block is None:
            out = attend(q, k, v, allowed, jnp.float32)
        else:
            out = blocked_attend(q, k, v, allowed, jnp.float32, block)
        return jnp.sum(out * w)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def inputs(rows: int, T: int, concrete: bool):
    shapes = [((rows, T, H, HD), jnp.float32), ((rows, KV, T, HD), jnp.float32), ((rows, KV, T, HD), jnp.float32),
              ((rows, T, T), jnp.bool_), ((rows, T, H, HD), jnp.float32)]
    if not concrete:
        return [jax.ShapeDtypeStruct(s, d) for s, d in shapes]
    rng = np.random.default_rng(0)
    q, k, v, _, w = (jnp.asarray(rng.standard_normal(s), d) if d != jnp.bool_ else None for s, d in shapes)
    pad = rng.integers(0, T // 4, rows)  # left padding of each row
    mask = np.arange(T)[None, :] >= pad[:, None]
    allowed = jnp.asarray(np.tril(np.ones((T, T), bool))[None] & mask[:, None, :])
    # the loss reads real positions only, as every loss does: a padding query's output differs between forms
    return [q, k, v, allowed, w * jnp.asarray(mask, jnp.float32)[:, :, None, None]]


def label(block: int | str | None) -> str:
    return "dense" if block is None else block if isinstance(block, str) else f"blocked {block}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=8, help="rows B (default 8: one group of G = 8)")
    ap.add_argument("--memory-T", type=int, default=1152, help="positions for the memory compile (128 + 1,024)")
    ap.add_argument("--time-T", type=int, default=384, help="positions for the timing (128 + 256, the CPU recipe)")
    ap.add_argument("--blocks", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--fused", nargs="*", default=[], help="fused implementations to add (xla)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/attention.json")
    args = ap.parse_args()
    variants = [None, *args.blocks, *args.fused]

    memory = {}
    for b in variants:
        t0 = time.perf_counter()
        compiled = make_fn(b).lower(*inputs(args.rows, args.memory_T, False)).compile()
        memory[label(b)] = dict(temp_bytes=int(compiled.memory_analysis().temp_size_in_bytes),
                                compile_s=time.perf_counter() - t0)
        print(f"memory T={args.memory_T} {label(b)}: temporaries {memory[label(b)]['temp_bytes'] / 2**20:,.1f} MiB",
              flush=True)

    x = inputs(args.rows, args.time_T, True)
    fns = {label(b): make_fn(b) for b in variants}
    ref = None
    for name, fn in fns.items():  # compile, and check every variant's value and gradients against dense
        val, grads = jax.block_until_ready(fn(*x))
        if ref is None:
            ref = (val, grads)
        err = max(float(jnp.abs(g - r).max()) for g, r in zip(grads, ref[1]))
        print(f"check T={args.time_T} {name}: loss {float(val):.6f} (dense {float(ref[0]):.6f}), "
              f"max |grad - dense grad| {err:.2e}", flush=True)
    wall = {n: [] for n in fns}
    cpu = {n: [] for n in fns}
    for _ in range(args.reps):
        for name, fn in fns.items():
            t0, c0 = time.perf_counter(), time.process_time()
            jax.block_until_ready(fn(*x))
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)

    dense_mem, dense_cpu = memory["dense"]["temp_bytes"], min(cpu["dense"])
    print(f"\n| attention | temporaries at T = {args.memory_T} | vs dense | wall min at T = {args.time_T} "
          "| CPU min | CPU vs dense |")
    print("|---|---|---|---|---|---|")
    for name in fns:
        m = memory[name]["temp_bytes"]
        print(f"| {name} | {m / 2**20:,.0f} MiB | {m / dense_mem:.3f} | {min(wall[name]):.3f} s | "
              f"{min(cpu[name]):.3f} s | {min(cpu[name]) / dense_cpu:.2f} |")
    from ict_jax.experiments.provenance import machine
    record = dict(args=vars(args), heads=H, kv_heads=KV, head_dim=HD, memory=memory, wall_s=wall, cpu_s=cpu,
                  machine=machine() | dict(load_average=os.getloadavg(), jax=jax.__version__,
                                                    backend=jax.default_backend()),
                  date=time.strftime("%Y-%m-%d"))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
