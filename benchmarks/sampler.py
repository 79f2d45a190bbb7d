"""Decode throughput of ict_jax.generate vs transformers' PyTorch generate, same random weights.

    python benchmarks/sampler.py                   # both shapes (small, then the Qwen2.5-0.5B shape)
    python benchmarks/sampler.py --shapes small    # the quick one

Settings on both sides: 8 prompts x G = 4 samples (batch 32), prompt 64 tokens, exactly 128 new tokens
(EOS disabled: transformers gets min_new_tokens = max_new_tokens, ict_jax no eos_ids), sampling at
temperature 1 without top-k/top-p, KV cache on, float32, PyTorch on 2 threads. Tokens/s counts the
P x G x 128 generated tokens over the wall time of one generate call (prefill included on both sides;
JAX after compilation, best of --repeats, the two sides alternating). Compile time: lowering +
compiling the same program ahead of time. Other processes' load hits PyTorch harder than XLA (its
threads oversubscribe busy cores): the JSON records the 1-minute load average. Prints a table and
writes benchmarks/results/sampler.json.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

SHAPES = {
    "small": dict(vocab_size=32_000, hidden_size=256, intermediate_size=1_024, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    "0.5b": dict(vocab_size=151_936, hidden_size=896, intermediate_size=4_864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True),
}


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def _cpu_timed(fn):
    """(wall seconds, process CPU seconds over all threads)."""
    w0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w0, time.process_time() - c0


def bench_shape(name: str, args) -> dict:
    import jax
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    import ict_jax

    P, G, Lp, N = args.prompts, args.samples, args.prompt_len, args.new_tokens
    torch.manual_seed(0)
    hf = Qwen2ForCausalLM(Qwen2Config(**SHAPES[name], rope_theta=1_000_000.0, rms_norm_eps=1e-6)).eval()
    ids = np.random.default_rng(0).integers(0, SHAPES[name]["vocab_size"], (P, Lp)).astype(np.int32)
    row = {"shape": name, **SHAPES[name], "prompts": P, "samples": G, "prompt_len": Lp, "new_tokens": N}
    n_tokens = P * G * N
    load_before = os.getloadavg()[0]

    # the same weights through save_pretrained -> load_hf
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        model = ict_jax.load_hf(d)

    tin = torch.from_numpy(ids.astype(np.int64))
    kw = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, num_return_sequences=G, use_cache=True,
              pad_token_id=0, attention_mask=torch.ones_like(tin))

    def run_torch():
        with torch.inference_mode():
            out = hf.generate(tin, max_new_tokens=N, min_new_tokens=N, **kw)
        assert out.shape == (P * G, Lp + N), out.shape

    def run_jax(key):
        r = ict_jax.generate(model, ids, None, jax.random.key(key), num_samples=G, max_new_tokens=N,
                             temperature=1.0, eos_ids=(), unroll_layers=args.unroll)
        r.tokens.block_until_ready()
        assert r.tokens.shape == (P * G, N) and bool(r.valid.all())

    with torch.inference_mode():  # warm-up
        hf.generate(tin, max_new_tokens=4, min_new_tokens=4, **kw)
    # compile time: the same program, lowered and compiled ahead of time
    from flax import nnx

    graphdef, state = nnx.split(model)
    fn = ict_jax.make_generate_fn(graphdef, num_samples=G, max_new_tokens=N, temperature=1.0, eos_ids=(),
                                  unroll_layers=args.unroll)
    row["jax_compile_s"] = _timed(lambda: fn.jitted.lower(state, ids, np.ones_like(ids), jax.random.key(0)).compile())[0]
    run_jax(0)  # generate's own compile
    # alternate the two sides so that load from other processes hits both alike; best of the repeats
    t_torch, t_jax = [], []
    for k in range(args.repeats):
        t_jax.append(_cpu_timed(lambda: run_jax(k + 1)))
        if k < args.torch_repeats:
            t_torch.append(_cpu_timed(run_torch))
    (row["torch_s"], row["torch_cpu_s"]), (row["jax_s"], row["jax_cpu_s"]) = min(t_torch), min(t_jax)
    # CPU seconds per token (all threads) are less sensitive to other processes than wall time
    row["cpu_ratio"] = row["torch_cpu_s"] / row["jax_cpu_s"]
    row["torch_tok_s"] = n_tokens / row["torch_s"]
    row["jax_tok_s"] = n_tokens / row["jax_s"]
    row["ratio"] = row["jax_tok_s"] / row["torch_tok_s"]
    row["load_avg_1m_before_after"] = [round(load_before, 1), round(os.getloadavg()[0], 1)]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="small,0.5b")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3, help="timed JAX runs (best taken)")
    ap.add_argument("--torch-repeats", type=int, default=3, help="timed PyTorch runs (at most --repeats)")
    ap.add_argument("--unroll", default=None, choices=[None, "true", "false"],
                    help="unroll the decoder layers (default: the sampler's rule)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "sampler.json"))
    args = ap.parse_args()
    args.unroll = None if args.unroll is None else args.unroll == "true"

    import jax
    import torch
    import transformers

    torch.set_num_threads(args.threads)
    rows = []
    for name in args.shapes.split(","):
        rows.append(bench_shape(name, args))
        r = rows[-1]
        print(f"{name}: torch {r['torch_tok_s']:.0f} tok/s, jax {r['jax_tok_s']:.0f} tok/s, "
              f"ratio {r['ratio']:.2f} (cpu-time ratio {r['cpu_ratio']:.2f}), jax compile {r['jax_compile_s']:.1f} s",
              flush=True)
    print()
    print(f"{'shape':<7}{'torch tok/s':>13}{'jax tok/s':>11}{'jax/torch':>11}{'cpu-time ratio':>16}{'compile s':>11}"
          f"{'load 1m':>13}")
    for r in rows:
        print(f"{r['shape']:<7}{r['torch_tok_s']:>13.1f}{r['jax_tok_s']:>11.1f}{r['ratio']:>11.2f}"
              f"{r['cpu_ratio']:>16.2f}{r['jax_compile_s']:>11.1f}{str(r['load_avg_1m_before_after']):>13}")
    from ict_jax.experiments.provenance import machine
    meta = {"machine": machine() | {"backend": jax.default_backend()},
            "jax": jax.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "torch_threads": args.threads, "dtype": "float32"}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    old = json.loads(out.read_text()) if out.exists() else {}
    results = {r["shape"]: r for r in old.get("results", [])} | {r["shape"]: r for r in rows}
    out.write_text(json.dumps({"meta": meta, "results": list(results.values())}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
