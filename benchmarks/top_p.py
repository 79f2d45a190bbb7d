"""One draw of ``sample_token`` with top-p and no top-k (an evaluation's sampling, method.md §6: T 0.6,
top-p 0.95): among the ``TOP_P_CANDIDATES`` largest logits vs the whole vocabulary sorted, side by side.

    python benchmarks/top_p.py                      # rows 8 and 64, V = 151,936 (Qwen2.5's vocabulary)
    python benchmarks/top_p.py --rows 8,16,64 --repeats 10

The logits are peaked like a language model's next token (standard normal, 5 entries of each row raised
by 14, then divided by the temperature), so the candidates hold top-p of every row and the fast path is the
one measured. The reference is the same function with ``top_p_candidates`` = V: one sort of the whole
vocabulary per draw (what every top-p draw did before the candidates). Milliseconds a draw: the median of
``--repeats`` calls after compilation, the two sides alternating. Also checks that both draw the same
tokens for the same uniforms. Prints a table and writes benchmarks/results/top_p.json (with the machine and
the 1-minute load average).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np


def _ms(fn, *args) -> float:
    import jax

    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return (time.perf_counter() - t0) * 1000.0


def bench(rows: int, vocab: int, repeats: int) -> dict:
    import jax
    import jax.numpy as jnp

    from ict_jax.sampling.draw import TOP_P_CANDIDATES, sample_token

    rng = np.random.default_rng(0)
    z = rng.normal(size=(rows, vocab)).astype(np.float32)
    z[np.arange(rows)[:, None], rng.integers(0, vocab, (rows, 5))] += 14.0
    logits, u = jnp.asarray(z), jnp.asarray(rng.uniform(size=rows).astype(np.float32))
    fns = {name: jax.jit(lambda z, u, c=cand: sample_token(z, u, temperature=0.6, top_p=0.95, top_p_candidates=c))
           for name, cand in (("candidates", TOP_P_CANDIDATES), ("whole_vocabulary", vocab))}
    tokens = {name: np.asarray(f(logits, u)[0]) for name, f in fns.items()}  # compiles
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, f in fns.items():
            times[name].append(_ms(f, logits, u))
    ms = {name: statistics.median(t) for name, t in times.items()}
    return {"rows": rows, "vocab": vocab, "candidates": TOP_P_CANDIDATES, "ms_candidates": ms["candidates"],
            "ms_whole_vocabulary": ms["whole_vocabulary"], "speedup": ms["whole_vocabulary"] / ms["candidates"],
            "same_tokens": bool((tokens["candidates"] == tokens["whole_vocabulary"]).all())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="8,64", help="rows a draw (comma-separated)")
    p.add_argument("--vocab", type=int, default=151_936)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "top_p.json"))
    args = p.parse_args()
    import jax

    load_before = os.getloadavg()[0]
    results = [bench(int(r), args.vocab, args.repeats) for r in args.rows.split(",")]
    load_after = os.getloadavg()[0]
    print(f"{'rows':>5}{'vocab':>9}{'candidates ms':>15}{'whole vocabulary ms':>21}{'speedup':>9}{'same tokens':>13}")
    for r in results:
        print(f"{r['rows']:>5}{r['vocab']:>9}{r['ms_candidates']:>15.1f}{r['ms_whole_vocabulary']:>21.1f}"
              f"{r['speedup']:>8.0f}x{str(r['same_tokens']):>13}")
    from ict_jax.experiments.provenance import machine
    meta = {"machine": machine() | {"backend": jax.default_backend()}, "jax": jax.__version__,
            "load_avg_1m_before_after": [round(load_before, 2), round(load_after, 2)],
            "temperature": 0.6, "top_p": 0.95, "repeats": args.repeats}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
