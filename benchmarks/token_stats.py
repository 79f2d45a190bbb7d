"""Benchmark: dense vs chunked token statistics at the Qwen2.5-0.5B head.

value_and_grad of a masked loss (ICT mask from the group-mean JS, a token-mean policy-gradient-like
term on logp) through (a) full logits ``[B, T, V]`` + ``stats_from_logits`` and (b) ``stats_from_hidden``
in blocks of ``chunk`` positions. Reports XLA's ``compiled.memory_analysis()`` temp bytes at T = 1,024
(compile only) and the CPU time of both at T = 128. Gradients flow to both the hidden states and the
(tied) unembedding, as in training.

    python benchmarks/token_stats.py                      # full run, writes benchmarks/results/token_stats.json
    python benchmarks/token_stats.py --chunks 64 128 --reps 2
    python benchmarks/token_stats.py --readings           # the cost of each reading of u (stats.u_form)
                                                          # at chunk 64: benchmarks/results/token_stats_readings.json
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

from ict_jax.rl.selectors import ict_mask
from ict_jax.rl.token_stats import U_FORMS, stats_from_hidden, stats_from_logits

D, V, G = 896, 151_936, 8  # Qwen2.5-0.5B head; G rollouts of one prompt


def make_loss(path: str, chunk: int, u_form: str = "aligned"):
    def loss(hidden, unembed, tokens, valid, adv):
        if path == "dense":
            logits = jnp.einsum("btd,dv->btv", hidden, unembed, preferred_element_type=jnp.float32)
            s = stats_from_logits(logits, tokens, valid, group_size=G, temperature=1.0, u_form=u_form)
        else:
            s = stats_from_hidden(hidden, unembed, tokens, valid, group_size=G, temperature=1.0, chunk=chunk,
                                  u_form=u_form)
        m = ict_mask(s.js, valid, group_size=G, rho=0.1, scope="sequence")
        x = jnp.where(m > 0, s.logp * adv[:, None], 0.0)
        return -jnp.sum(x) / jnp.maximum(jnp.sum(m), 1.0)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def shapes(T: int):
    return (jax.ShapeDtypeStruct((G, T, D), jnp.float32), jax.ShapeDtypeStruct((D, V), jnp.float32),
            jax.ShapeDtypeStruct((G, T), jnp.int32), jax.ShapeDtypeStruct((G, T), jnp.float32),
            jax.ShapeDtypeStruct((G,), jnp.float32))


def temp_bytes(path: str, chunk: int, T: int, u_form: str = "aligned") -> tuple[int, float]:
    t0 = time.perf_counter()
    compiled = make_loss(path, chunk, u_form).lower(*shapes(T)).compile()
    return int(compiled.memory_analysis().temp_size_in_bytes), time.perf_counter() - t0


def inputs(T: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    hidden = rng.standard_normal((G, T, D), np.float32)
    unembed = (rng.standard_normal((D, V), np.float32) * 0.05).astype(np.float32)
    tokens = rng.integers(0, V, (G, T)).astype(np.int32)
    lengths = rng.integers(T // 2, T + 1, G)
    valid = (np.arange(T)[None] < lengths[:, None]).astype(np.float32)
    adv = rng.standard_normal(G).astype(np.float32)
    return tuple(jnp.asarray(x) for x in (hidden, unembed, tokens, valid, adv))


def timings(variants: dict[str, object], T: int, reps: int):
    """Interleaved timing (the machine is shared: every round times each variant once, so load
    drifts hit all of them alike). Returns {name: (min wall s, median wall s, min process CPU s)},
    and each variant's (value, grads) for a correctness check."""
    args = inputs(T)
    outs = {n: jax.block_until_ready(f(*args)) for n, f in variants.items()}  # compile + warm-up
    wall = {n: [] for n in variants}
    cpu = {n: [] for n in variants}
    for _ in range(reps):
        for n, f in variants.items():
            t0, c0 = time.perf_counter(), time.process_time()
            jax.block_until_ready(f(*args))
            wall[n].append(time.perf_counter() - t0)
            cpu[n].append(time.process_time() - c0)
    return {n: (min(wall[n]), float(np.median(wall[n])), min(cpu[n])) for n in variants}, outs


def readings(a, res) -> None:
    """value_and_grad of the masked loss at chunk 64 for every reading of u: temp memory at mem_T, time at
    time_T (interleaved rounds). The reading only changes the JS part of the forward pass."""
    print(f"# readings of u (stats.u_form), chunk 64: temp bytes at T={a.mem_T}, value_and_grad time at T={a.time_T}")
    res["readings"] = {"memory": {}, "time": {}}
    for form in U_FORMS:
        m, ct = temp_bytes("chunked", 64, a.mem_T, form)
        res["readings"]["memory"][form] = m
        print(f"{form:8s} {m / 2**30:8.2f} GiB   (compile {ct:.1f} s)")
    if a.skip_time:
        return
    t, outs = timings({form: make_loss("chunked", 64, form) for form in U_FORMS}, a.time_T, a.reps)
    base = t["aligned"]
    for form, (wmin, wmed, cmin) in t.items():
        res["readings"]["time"][form] = {"wall_min_s": wmin, "wall_median_s": wmed, "cpu_min_s": cmin}
        print(f"{form:8s} {wmin:8.3f} s {wmed:8.3f} s {cmin:8.3f} s   ratio wall {wmin / base[0]:4.2f} cpu "
              f"{cmin / base[2]:4.2f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", type=int, nargs="+", default=[32, 64, 128, 256])
    ap.add_argument("--mem-T", type=int, default=1024)
    ap.add_argument("--time-T", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--skip-time", action="store_true")
    ap.add_argument("--readings", action="store_true", help="the cost of each reading of u instead of the chunk sweep")
    ap.add_argument("--out", default=None, help="default benchmarks/results/token_stats[_readings].json")
    a = ap.parse_args()
    results = Path(__file__).parent / "results"
    a.out = a.out or str(results / ("token_stats_readings.json" if a.readings else "token_stats.json"))

    from ict_jax.experiments.provenance import machine
    res = {"machine": machine() | {"device": str(jax.devices()[0]), "jax": jax.__version__},
           "shape": {"D": D, "V": V, "G": G, "dtype": "float32"}, "mem_T": a.mem_T, "time_T": a.time_T,
           "memory": {}, "time": {}}
    if a.readings:
        res["load_before"] = os.getloadavg()
        readings(a, res)
        res["load_after"] = os.getloadavg()
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(res, indent=2) + "\n")
        print(f"wrote {a.out}")
        return
    print(f"# memory: value_and_grad temp bytes at T={a.mem_T} (compile only)")
    dense_mem, ct = temp_bytes("dense", 0, a.mem_T)
    res["memory"]["dense"] = dense_mem
    print(f"dense          {dense_mem / 2**30:8.2f} GiB   (compile {ct:.1f} s)")
    for c in a.chunks:
        m, ct = temp_bytes("chunked", c, a.mem_T)
        res["memory"][f"chunk{c}"] = m
        print(f"chunk {c:4d}     {m / 2**30:8.2f} GiB   ratio {m / dense_mem:6.3f}   (compile {ct:.1f} s)")

    if not a.skip_time:
        print(f"# value_and_grad at T={a.time_T}: {a.reps} interleaved rounds; wall min / median, process CPU min")
        variants = {"dense": make_loss("dense", 0)}
        variants.update({f"chunk{c}": make_loss("chunked", c) for c in a.chunks if c <= a.time_T})
        t, outs = timings(variants, a.time_T, a.reps)
        vd, gd = outs["dense"]
        for n, (wmin, wmed, cmin) in t.items():
            res["time"][n] = {"wall_min_s": wmin, "wall_median_s": wmed, "cpu_min_s": cmin}
            line = f"{n:12s} {wmin:8.3f} s {wmed:8.3f} s {cmin:8.3f} s"
            if n != "dense":
                vc, gc = outs[n]
                err = max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(gd, gc))
                line += (f"   ratio wall {wmin / t['dense'][0]:4.2f} cpu {cmin / t['dense'][2]:4.2f}"
                         f"   |dloss| {abs(float(vd - vc)):.1e}  max|dgrad| {err:.1e}")
            print(line)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
