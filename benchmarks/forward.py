"""Forward throughput of ict_jax.Qwen2 vs transformers' PyTorch Qwen2ForCausalLM, same random weights.

    python benchmarks/forward.py                 # Qwen2.5-0.5B shape, batch 4 x 512, float32, CPU
    python benchmarks/forward.py --shape small   # a quick run at a small shape
    python benchmarks/forward.py --dtype bfloat16   # on a GPU

Prints a table (tokens/s, compile time, the ratio JAX / PyTorch) and writes JSON to
benchmarks/results/forward.json. Both sides compute the full float32 logits.
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
    "0.5b": dict(vocab_size=151_936, hidden_size=896, intermediate_size=4_864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True),
    "small": dict(vocab_size=32_000, hidden_size=256, intermediate_size=1_024, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
}


def _best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="0.5b")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "forward.json"))
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import torch
    from flax import nnx
    from transformers import Qwen2Config, Qwen2ForCausalLM

    import ict_jax

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    tdt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    hf = Qwen2ForCausalLM(Qwen2Config(rope_theta=1e6, **SHAPES[args.shape])).eval()
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        model = ict_jax.load_hf(d, remat="none", compute_dtype=args.dtype)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    hf = hf.to(device=device, dtype=tdt)

    rng = np.random.default_rng(0)
    ids = rng.integers(0, SHAPES[args.shape]["vocab_size"], size=(args.batch, args.seq))
    tokens = args.batch * args.seq

    graphdef, state = nnx.split(model)
    fwd = jax.jit(lambda st, i: nnx.merge(graphdef, st)(i))
    ids_j = jnp.asarray(ids)
    t0 = time.perf_counter()
    compiled = fwd.lower(state, ids_j).compile()
    compile_s = time.perf_counter() - t0
    compiled(state, ids_j).block_until_ready()
    jax_s = _best(lambda: compiled(state, ids_j).block_until_ready(), args.repeats)

    ids_t = torch.tensor(ids, device=device)
    with torch.no_grad():
        hf(ids_t).logits.float()
        torch_s = _best(lambda: hf(ids_t).logits.float().sum().item(), args.repeats)

    rows = {
        "jax": {"tokens_per_s": tokens / jax_s, "step_s": jax_s, "compile_s": compile_s},
        "torch": {"tokens_per_s": tokens / torch_s, "step_s": torch_s},
    }
    ratio = rows["jax"]["tokens_per_s"] / rows["torch"]["tokens_per_s"]
    print(f"forward, shape {args.shape}, batch {args.batch} x {args.seq} tokens, {args.dtype}, "
          f"backend {jax.default_backend()}, {args.threads} threads")
    print(f"{'impl':<8}{'tokens/s':>12}{'step s':>10}{'compile s':>11}")
    print(f"{'jax':<8}{rows['jax']['tokens_per_s']:>12.1f}{jax_s:>10.3f}{compile_s:>11.2f}")
    print(f"{'torch':<8}{rows['torch']['tokens_per_s']:>12.1f}{torch_s:>10.3f}{'-':>11}")
    print(f"ratio jax/torch tokens/s: {ratio:.2f}x")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    from ict_jax.experiments.provenance import machine
    result = dict(benchmark="forward", shape=args.shape, batch=args.batch, seq=args.seq, dtype=args.dtype,
                  backend=jax.default_backend(), devices=[str(d) for d in jax.devices()],
                  machine=machine(),
                  threads=args.threads, results=rows, ratio=ratio, jax=jax.__version__, torch=torch.__version__)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
