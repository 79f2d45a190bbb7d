"""Compiled memory of the train step with and without LoRA, from abstract arguments only.

    python benchmarks/lora_memory.py                       # Qwen2.5-0.5B shape, the CPU setting below
    python benchmarks/lora_memory.py --preset qwen2p5_1p5b --rank 64

The step is lowered and compiled for the preset's shape from ``jax.ShapeDtypeStruct`` arguments (nothing
is allocated) and XLA's ``memory_analysis()`` is read, for:

- ``full``: every parameter trains; the arguments hold the weights, AdamW's two moments and the KL
  reference copy (``rl.state.reference_params``, in the compute dtype);
- ``lora``: adapters of ``--rank`` on the seven projections; the arguments hold the frozen base once, the
  adapters and their two moments; the KL reference is the base with the adapters off (no copy);
- ``lora_bf16_base``: the same with the frozen base held in bfloat16 (``model.lora.base_dtype``).

"total" = arguments + temporaries + outputs not aliased to a donated input: the step's peak as XLA plans
it (the sampler's KV cache and host copies are not in it). Prints a table; writes
benchmarks/results/lora_memory.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path


def abstract_state(cfg, mc):
    """The TrainState ``init_train_state(cfg, init_model(mc))`` would build, as ShapeDtypeStructs."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import ict_jax
    from ict_jax.rl.state import TrainState, make_optimizer, split_trainable

    graphdef, params, frozen = split_trainable(nnx.eval_shape(lambda: ict_jax.Qwen2(mc, rngs=nnx.Rngs(0))))
    opt_state = jax.eval_shape(make_optimizer(cfg).init, params)
    sds = jax.ShapeDtypeStruct
    return TrainState(params=params, opt_state=opt_state, step=sds((), jnp.int32), rng=sds((2,), jnp.uint32),
                      graphdef=graphdef, frozen=frozen)


def abstract_batch(P: int, G: int, Lp: int, Lr: int):
    import jax
    import jax.numpy as jnp

    from ict_jax.rl.batch import RolloutBatch

    sds, f32, B, L = jax.ShapeDtypeStruct, jnp.float32, P * G, Lp + Lr
    return RolloutBatch(tokens=sds((B, L), jnp.int32), attention_mask=sds((B, L), jnp.int32),
                        response_valid=sds((B, Lr), f32), rewards=sds((B,), f32), advantages=sds((B,), f32),
                        sampler_logp=sds((B, Lr), f32), truncated=sds((B,), f32), row_valid=sds((B,), f32),
                        correct=sds((B,), f32))


def nbytes(tree) -> int:
    import jax
    import numpy as np

    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def measure(args, variant: str) -> dict:
    import jax

    import ict_jax
    from ict_jax.config_load import load_config
    from ict_jax.model.lora import lora_spec
    from ict_jax.rl.train_step import make_train_step

    overrides = [f"rl.selector.method={args.method}", f"rollout.num_samples={args.group}",
                 f"train.prompts_per_step={args.prompts}", f"rollout.max_new_tokens={args.response_len}",
                 f"train.micro_batches={args.micro}", f"model.remat={args.remat}", f"rl.loss.kl_coef={args.kl_coef}"]
    if variant != "full":
        overrides += ["model.lora.enabled=true", f"model.lora.rank={args.rank}", f"model.lora.alpha={2 * args.rank}"]
    if variant == "lora_bf16_base":
        overrides.append("model.lora.base_dtype=bfloat16")
    cfg = load_config(None, overrides)
    mc = ict_jax.ModelConfig.preset(args.preset, remat=args.remat, compute_dtype=args.compute_dtype)
    mc = mc.replace(lora=lora_spec(cfg.model.lora, mc.num_layers))
    state = abstract_state(cfg, mc)
    ref = None
    if variant == "full" and cfg.rl.loss.kl_coef > 0:  # rl.state.reference_params: a copy in the compute dtype
        ref = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, mc.resolved_compute_dtype()), state.params)
    step = make_train_step(cfg)
    t0 = time.perf_counter()
    ma = step.lower(state, abstract_batch(args.prompts, args.group, args.prompt_len, args.response_len),
                    ref).compile().memory_analysis()
    compile_s = time.perf_counter() - t0
    out = dict(variant=variant, argument_bytes=int(ma.argument_size_in_bytes), temp_bytes=int(ma.temp_size_in_bytes),
               output_bytes=int(ma.output_size_in_bytes), alias_bytes=int(ma.alias_size_in_bytes),
               trainable_bytes=nbytes(state.params), frozen_bytes=nbytes(state.frozen) if state.frozen else 0,
               opt_state_bytes=nbytes(state.opt_state), reference_bytes=nbytes(ref) if ref is not None else 0,
               trainable_params=sum(x.size for x in jax.tree.leaves(state.params)), compile_s=round(compile_s, 1))
    out["total_bytes"] = out["argument_bytes"] + out["temp_bytes"] + out["output_bytes"] - out["alias_bytes"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen2p5_0p5b")
    ap.add_argument("--prompts", type=int, default=4, help="P")
    ap.add_argument("--group", type=int, default=8, help="G")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--response-len", type=int, default=256)
    ap.add_argument("--micro", type=int, default=4, help="train.micro_batches")
    ap.add_argument("--remat", default="block", choices=["none", "block", "full"])
    ap.add_argument("--compute-dtype", default="float32", help="float32 = what the CPU runs")
    ap.add_argument("--method", default="ict")
    ap.add_argument("--kl-coef", type=float, default=0.001)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--variants", default="full,lora,lora_bf16_base")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "lora_memory.json"))
    args = ap.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    rows = [measure(args, v) for v in args.variants.split(",")]
    full = next((r for r in rows if r["variant"] == "full"), None)
    gib = 1024 ** 3
    print(f"{args.preset}, P={args.prompts} x G={args.group}, prompt {args.prompt_len} + response {args.response_len}, "
          f"micro_batches {args.micro}, remat {args.remat}, compute {args.compute_dtype}, {args.method}, kl_coef "
          f"{args.kl_coef}, LoRA rank {args.rank} (alpha {2 * args.rank}) on q/k/v/o/gate/up/down; {jax.default_backend()}")
    print(f"{'variant':16s} {'trainable':>11s} {'arguments':>10s} {'opt state':>10s} {'reference':>10s} "
          f"{'temp':>8s} {'total':>8s} {'vs full':>8s} {'compile':>8s}")
    for r in rows:
        ratio = f"{r['total_bytes'] / full['total_bytes']:.0%}" if full else "-"
        print(f"{r['variant']:16s} {r['trainable_params']:>11,d} {r['argument_bytes'] / gib:>8.2f} G "
              f"{r['opt_state_bytes'] / gib:>8.2f} G {r['reference_bytes'] / gib:>8.2f} G {r['temp_bytes'] / gib:>6.2f} G "
              f"{r['total_bytes'] / gib:>6.2f} G {ratio:>8s} {r['compile_s']:>7.1f}s")
    from ict_jax.experiments.provenance import machine
    result = dict(settings=vars(args), rows=rows, machine=machine() | dict(
                  backend=jax.default_backend(), jax=jax.__version__, load_avg=os.getloadavg()))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
