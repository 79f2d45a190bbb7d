"""Train-step time of ict_jax's compiled dense GRPO step vs a plain PyTorch step, and compiled memory.

    python benchmarks/train_step.py                  # small Qwen2 shape on CPU + 0.5B memory analysis
    python benchmarks/train_step.py --skip-memory    # timing only
    python benchmarks/train_step.py --skip-timing    # 0.5B compiled memory only (abstract, nothing allocated)
    python benchmarks/train_step.py --skip-memory --torch-stats   # + a PyTorch step with the same statistics
    python benchmarks/train_step.py --mfu            # GPU/TPU: JAX step alone at the 0.5B shape, bf16, MFU

Timing: both sides run the same dense GRPO update from the same random weights (transformers
``Qwen2ForCausalLM``, saved and loaded with ``ict_jax.load_hf``) on the same rollout batch:
one forward over prompt + response, float32 log-probs of the response tokens at temperature T, docs/method.md §4's
clipped surrogate (eps 0.2/0.2, dual clip 3) with ``seq-mean-token-mean`` aggregation, kl_coef = 0 (no
reference pass), one mini-batch of one micro-batch (so logp_old = stop_gradient(logp), r = 1),
global-norm clipping 1.0 and AdamW. PyTorch: dense float32 logits of the last Lr positions
(``logits_to_keep``), ``log_softmax`` + ``gather``, ``torch.optim.AdamW`` and ``clip_grad_norm_``.
JAX: ``make_train_step`` (it also computes H1, H2 and the JS score for docs/method.md §5 metrics; the plain PyTorch
step does not). ``--torch-stats`` times a third side, interleaved with the other two: the PyTorch step that
also computes those statistics the straightforward way from its dense logits (:func:`torch_token_stats`),
i.e. the same work as the JAX step.

Memory: the step is lowered and compiled for the Qwen2.5-0.5B shape from abstract parameters
(``nnx.eval_shape``) and ``memory_analysis()`` is read for ``model.remat`` = none / block / full.

Prints tables and writes JSON to benchmarks/results/train_step.json.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

SMALL = dict(vocab_size=32_000, hidden_size=256, intermediate_size=1_024, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)


def _overrides(args, P: int, G: int, Lr: int, Lp: int) -> list[str]:
    return [f"rl.selector.method={args.method}", "rl.loss.kl_coef=0", "rl.loss.loss_agg=seq-mean-token-mean",
            f"rollout.num_samples={G}", f"train.prompts_per_step={P}", f"rollout.max_new_tokens={Lr}",
            f"rollout.max_prompt_len={Lp}", f"rollout.temperature={args.temperature}",
            f"stats.chunk={args.chunk}", f"optim.lr={args.lr:.12f}", "optim.lr_warmup_steps=0",
            "train.mini_batches=1", "train.micro_batches=1", f"stats.js_metrics={str(not args.no_js_metrics).lower()}"]


def make_batch(P: int, G: int, Lp: int, Lr: int, vocab: int, seed: int = 0) -> dict[str, np.ndarray]:
    """A rollout batch as numpy: left-padded prompts, right-padded responses of varied length."""
    from ict_jax.rl.losses import group_advantages

    rng = np.random.default_rng(seed)
    B = P * G
    tokens = rng.integers(3, vocab, (B, Lp + Lr)).astype(np.int32)
    am = np.ones((B, Lp + Lr), np.int32)
    for p in range(P):  # prompts of different lengths (left padding)
        am[p * G:(p + 1) * G, :rng.integers(0, Lp // 2)] = 0
    rv = np.ones((B, Lr), np.float32)
    for i, n in enumerate(rng.integers(Lr // 4, Lr + 1, B)):  # responses of varied length
        rv[i, n:] = 0
        am[i, Lp + n:] = 0
    tokens[am == 0] = 0
    rewards = rng.integers(0, 2, B).astype(np.float32)
    adv = np.asarray(group_advantages(rewards, G))
    return dict(tokens=tokens, attention_mask=am, response_valid=rv, rewards=rewards, advantages=adv,
                truncated=(rv[:, -1] > 0).astype(np.float32))


# ------------------------------------------------------------------------------------------------
# JAX
# ------------------------------------------------------------------------------------------------
def rollout_batch(b: dict):
    """:func:`make_batch`'s arrays as an ``ict_jax`` RolloutBatch on the first device."""
    import jax
    import jax.numpy as jnp

    from ict_jax.rl.batch import RolloutBatch

    B, Lr = b["response_valid"].shape
    batch = RolloutBatch(tokens=jnp.asarray(b["tokens"]), attention_mask=jnp.asarray(b["attention_mask"]),
                         response_valid=jnp.asarray(b["response_valid"]), rewards=jnp.asarray(b["rewards"]),
                         advantages=jnp.asarray(b["advantages"]), sampler_logp=jnp.zeros((B, Lr), jnp.float32),
                         truncated=jnp.asarray(b["truncated"]), row_valid=jnp.ones((B,), jnp.float32),
                         correct=jnp.asarray(b["rewards"]))
    return jax.device_put(batch, jax.devices()[0])


def jax_setup(args, ckpt: str, b: dict):
    """The JAX step as a closure (state kept inside), after its first (compiling) call."""
    import jax

    import ict_jax
    from ict_jax.config_load import load_config
    from ict_jax.rl.state import init_train_state
    from ict_jax.rl.train_step import make_train_step

    P, G, Lp, Lr = args.prompts, args.group, args.prompt_len, args.response_len
    cfg = load_config(None, _overrides(args, P, G, Lr, Lp) + [f"model.remat={args.remat}"])
    model = ict_jax.load_hf(ckpt, remat=args.remat, scan_layers=not args.unroll, compute_dtype="float32")
    state = init_train_state(cfg, model)
    step = make_train_step(cfg)
    batch = rollout_batch(b)
    box = {"state": state}

    def run() -> dict:
        box["state"], m = step(box["state"], batch)
        jax.block_until_ready((box["state"].params, m))
        return m

    t0 = time.perf_counter()
    first = {k: float(v) for k, v in run().items()}
    first_s = time.perf_counter() - t0
    return run, dict(first_call_s=first_s, loss0=first["loss/total"], grad_norm0=first["grad/norm"],
                     compiles=lambda: len(step.jitted))


# ------------------------------------------------------------------------------------------------
# PyTorch
# ------------------------------------------------------------------------------------------------
def torch_token_stats(logits, valid, G: int, T: float) -> dict:
    """docs/method.md §1 statistics the JAX step computes for its §5 metrics (H1, H2, the group-mean JS), done
    the straightforward way on PyTorch's dense float32 logits ``[B, Lr, V]``, without gradient."""
    import torch

    with torch.no_grad():
        logp = torch.log_softmax(logits.detach().float() / T, dim=-1)
        p = logp.exp()
        H1 = -(p * logp).sum(-1)
        H2 = -torch.log((p * p).sum(-1))
        B, L, V = p.shape
        w = valid.float().reshape(B // G, G, L, 1)
        cnt = w.sum(1)
        pbar = (w * p.reshape(B // G, G, L, V)).sum(1) / cnt.clamp(min=1)  # [P, L, V]
        q = pbar.repeat_interleave(G, dim=0)
        m = 0.5 * (p + q)
        js = 0.5 * (torch.xlogy(p, p) - torch.xlogy(p, m)).sum(-1) + 0.5 * (torch.xlogy(q, q) - torch.xlogy(q, m)).sum(-1)
        js = js.clamp(0.0, float(np.log(2.0)))
        n = valid.sum().clamp(min=1)
        return {k: float(torch.where(valid, x, 0.0).sum() / n) for k, x in (("H1", H1), ("H2", H2), ("js", js))}


def torch_setup(args, hf, b: dict, *, with_stats: bool = False):
    """The PyTorch step as a closure, after its first call. ``with_stats``: it also computes the
    statistics of the JAX step's docs/method.md §5 metrics (:func:`torch_token_stats`)."""
    import torch

    Lr, T = args.response_len, args.temperature
    eps_low, eps_high, dual_c = 0.2, 0.2, 3.0
    tokens = torch.tensor(b["tokens"], dtype=torch.long)
    am = torch.tensor(b["attention_mask"], dtype=torch.long)
    valid = torch.tensor(b["response_valid"]) > 0
    adv = torch.tensor(b["advantages"])[:, None]
    inp, inp_mask, targets = tokens[:, :-1], am[:, :-1], tokens[:, -Lr:]
    pos = (inp_mask.cumsum(1) - 1).clamp(min=0)  # real-token positions, as ict_jax
    opt = torch.optim.AdamW(hf.parameters(), lr=args.lr, betas=(0.9, 0.999), weight_decay=0.01)
    hf.train()

    def one_step() -> tuple[float, float]:
        logits = hf(input_ids=inp, attention_mask=inp_mask, position_ids=pos, logits_to_keep=Lr).logits
        logp_all = torch.log_softmax(logits.float() / T, dim=-1)
        logp = logp_all.gather(-1, targets[..., None])[..., 0]
        logp_old = logp.detach()  # one update per rollout batch: r = 1
        ratio = torch.exp(torch.clamp(logp - logp_old, -20, 20))
        surr = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * adv)
        surr = torch.where(adv < 0, torch.maximum(surr, dual_c * adv), surr)
        per_row = torch.where(valid, surr, 0.0).sum(-1) / valid.sum(-1).clamp(min=1)
        R = valid.any(-1).sum().clamp(min=1)
        loss = -per_row.sum() / R
        if with_stats:
            torch_token_stats(logits, valid, args.group, T)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        opt.step()
        return float(loss), float(gnorm)

    t0 = time.perf_counter()
    loss0, gnorm0 = one_step()
    first_s = time.perf_counter() - t0
    return one_step, dict(first_call_s=first_s, loss0=loss0, grad_norm0=gnorm0)


def interleaved(runs: list, steps: int) -> list[list[float]]:
    """Alternate one step of each side in turn, so all see the same machine load over time."""
    times: list[list[float]] = [[] for _ in runs]
    for run in runs:  # one more warm step each (PyTorch allocates Adam state on its first)
        run()
    for _ in range(steps):
        for run, ts in zip(runs, times):
            t0 = time.perf_counter()
            run()
            ts.append(time.perf_counter() - t0)
    return times


# ------------------------------------------------------------------------------------------------
# Step time and MFU of the JAX step alone at a real model shape (for a GPU/TPU)
# ------------------------------------------------------------------------------------------------
def peak_flops(device_kind: str, override_tflops: float | None) -> float | None:
    """The chip's dense bfloat16 peak (``ict_jax.aot.chips``, the one table of chips), or the override."""
    from ict_jax.aot.chips import chip_for

    if override_tflops:
        return override_tflops * 1e12
    chip = chip_for(device_kind=device_kind)
    return None if chip is None else chip.peak_flops


def mfu_run(args) -> dict:
    """Time the JAX step alone (random weights, ``--mfu-preset`` shape, ``--mfu-dtype`` compute) and report
    MFU = 6 x params x tokens / step time / peak, tokens = P x G x (prompt + response) per step."""
    import jax
    from flax import nnx

    import ict_jax
    from ict_jax.config_load import load_config
    from ict_jax.rl.state import init_train_state
    from ict_jax.rl.train_step import make_train_step

    P, G, Lp, Lr = args.mem_prompts, args.mem_group, args.mem_prompt_len, args.mem_response_len
    cfg = load_config(None, _overrides(args, P, G, Lr, Lp) + [f"model.remat={args.mfu_remat}"])
    mcfg = ict_jax.ModelConfig.preset(args.mfu_preset, remat=args.mfu_remat, compute_dtype=args.mfu_dtype)
    model = ict_jax.init_model(mcfg, seed=0)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    state = init_train_state(cfg, model)
    step = make_train_step(cfg)
    b = make_batch(P, G, Lp, Lr, mcfg.vocab_size)
    batch = rollout_batch(b)
    times = []
    for _ in range(args.steps + 2):  # the first call compiles, the second is a warm step
        t0 = time.perf_counter()
        state, m = step(state, batch)
        jax.block_until_ready((state.params, m))
        times.append(time.perf_counter() - t0)
    step_s = float(np.median(times[2:]))
    tokens = P * G * (Lp + Lr)
    kind = jax.devices()[0].device_kind
    peak = peak_flops(kind, args.peak_tflops)
    flops = 6.0 * n_params * tokens
    out = dict(preset=args.mfu_preset, params=n_params, compute_dtype=mcfg.resolved_compute_dtype(), remat=args.mfu_remat,
               prompts=P, group=G, prompt_len=Lp, response_len=Lr, tokens_per_step=tokens, device_kind=kind,
               compile_s=times[0] - step_s, step_s=step_s, min_s=float(min(times[2:])), times_s=times[2:],
               tokens_per_s=tokens / step_s, model_flops_per_s=flops / step_s, peak_flops=peak,
               mfu=None if peak is None else flops / step_s / peak, compiles=len(step.jitted),
               grad_norm_last=float(m["grad/norm"]))
    print(f"JAX step alone, {args.mfu_preset} ({n_params:,} params, compute {out['compute_dtype']}, remat "
          f"{args.mfu_remat}), P={P} x G={G}, prompt {Lp} + response {Lr} = {tokens} tokens, on {kind}")
    print(f"step {step_s:.3f} s (median of {args.steps}, min {out['min_s']:.3f}), compile {out['compile_s']:.1f} s, "
          f"{out['tokens_per_s']:,.0f} tok/s, {flops / step_s / 1e12:.2f} TFLOP/s (6 x params x tokens); MFU "
          + ("n/a (unknown peak: pass --peak-tflops)" if peak is None else f"{out['mfu']:.1%} of {peak / 1e12:.0f} TFLOP/s"))
    return out


# ------------------------------------------------------------------------------------------------
# Compiled memory at the Qwen2.5-0.5B shape (abstract only)
# ------------------------------------------------------------------------------------------------
def memory_analysis(args, remat: str, micro: int = 1) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import ict_jax
    from ict_jax.config_load import load_config
    from ict_jax.rl.batch import RolloutBatch
    from ict_jax.rl.state import TrainState, make_optimizer
    from ict_jax.rl.train_step import make_train_step

    P, G, Lp, Lr = args.mem_prompts, args.mem_group, args.mem_prompt_len, args.mem_response_len
    cfg = load_config(None, [o for o in _overrides(args, P, G, Lr, Lp) if not o.startswith("train.micro")]
                      + [f"model.remat={remat}", f"train.micro_batches={micro}"])
    mcfg = ict_jax.ModelConfig.qwen2p5_0p5b(remat=remat, compute_dtype="float32")
    abstract = nnx.eval_shape(lambda: ict_jax.Qwen2(mcfg, rngs=nnx.Rngs(0)))
    graphdef, params = nnx.split(abstract, nnx.Param)
    tx = make_optimizer(cfg)
    opt_state = jax.eval_shape(tx.init, params)
    sds = jax.ShapeDtypeStruct
    state = TrainState(params=params, opt_state=opt_state, step=sds((), jnp.int32), rng=sds((2,), jnp.uint32),
                       graphdef=graphdef)
    B, L = P * G, Lp + Lr
    f32 = jnp.float32
    batch = RolloutBatch(tokens=sds((B, L), jnp.int32), attention_mask=sds((B, L), jnp.int32),
                         response_valid=sds((B, Lr), f32), rewards=sds((B,), f32), advantages=sds((B,), f32),
                         sampler_logp=sds((B, Lr), f32), truncated=sds((B,), f32), row_valid=sds((B,), f32),
                         correct=sds((B,), f32))
    step = make_train_step(cfg, tx=tx)
    t0 = time.perf_counter()
    compiled = step.lower(state, batch).compile()
    compile_s = time.perf_counter() - t0
    ma = compiled.memory_analysis()
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    return dict(remat=remat, micro_batches=micro, temp_bytes=int(ma.temp_size_in_bytes), argument_bytes=int(ma.argument_size_in_bytes),
                output_bytes=int(ma.output_size_in_bytes), alias_bytes=int(ma.alias_size_in_bytes),
                generated_code_bytes=int(ma.generated_code_size_in_bytes), compile_s=compile_s, params=n_params)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=4, help="P")
    ap.add_argument("--group", type=int, default=4, help="G")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--response-len", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--chunk", type=int, default=64, help="stats.chunk of the JAX step (64 = the config default)")
    ap.add_argument("--method", default="dense",
                    help="JAX selector (the PyTorch step is always dense GRPO; the target is for dense)")
    ap.add_argument("--remat", choices=["none", "block", "full"], default="none", help="JAX timing run")
    ap.add_argument("--unroll", action="store_true", help="JAX: unrolled layers instead of lax.scan")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--no-js-metrics", action="store_true",
                    help="JAX: skip the JS score that dense GRPO computes only for the stats/js_* metrics")
    ap.add_argument("--torch-stats", action="store_true",
                    help="also time a PyTorch step that computes the JAX step's docs/method.md §5 statistics (H1, H2, JS)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps of each, interleaved (medians reported)")
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    ap.add_argument("--mem-prompts", type=int, default=4)
    ap.add_argument("--mem-group", type=int, default=8)
    ap.add_argument("--mem-prompt-len", type=int, default=128)
    ap.add_argument("--mem-response-len", type=int, default=1024)
    ap.add_argument("--mem-chunk", type=int, default=None, help="stats.chunk for the memory run (default --chunk)")
    ap.add_argument("--mem-remat", nargs="+", default=["none", "block", "full"])
    ap.add_argument("--mem-micro", nargs="+", type=int, default=[1, 4], help="train.micro_batches values")
    ap.add_argument("--mfu", action="store_true",
                    help="time the JAX step alone at --mfu-preset (the --mem-* batch shape) and report MFU; "
                         "for a GPU/TPU (replaces the PyTorch comparison and the memory analysis)")
    ap.add_argument("--mfu-preset", default="qwen2p5_0p5b", help="ModelConfig preset for --mfu")
    ap.add_argument("--mfu-dtype", default="bfloat16", choices=["bfloat16", "float32"], help="compute dtype for --mfu")
    ap.add_argument("--mfu-remat", default="block", choices=["none", "block", "full"])
    ap.add_argument("--peak-tflops", type=float, default=None,
                    help="peak FLOP/s of one device in TFLOP/s for the MFU (default: looked up by device kind)")
    ap.add_argument("--skip-timing", action="store_true")
    ap.add_argument("--skip-memory", action="store_true")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "train_step.json"))
    args = ap.parse_args()

    import jax

    from ict_jax.experiments.provenance import machine
    result: dict = dict(benchmark="train_step", backend=jax.default_backend(),
                        machine=machine(),
                        load_avg_start=os.getloadavg(), jax=jax.__version__)
    if args.mfu:
        result["mfu"] = mfu_run(args)
        out = Path(args.out).with_name(Path(args.out).stem + "_mfu.json") if args.out == ap.get_default("out") else Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
        print(f"wrote {out}")
        return
    if not args.skip_timing:
        import torch
        from transformers import Qwen2Config, Qwen2ForCausalLM

        torch.set_num_threads(args.threads)
        torch.manual_seed(0)
        hf = Qwen2ForCausalLM(Qwen2Config(rope_theta=1e6, attn_implementation="sdpa", **SMALL))
        b = make_batch(args.prompts, args.group, args.prompt_len, args.response_len, SMALL["vocab_size"])
        with tempfile.TemporaryDirectory() as d:
            hf.save_pretrained(d)
            run_jax, jx = jax_setup(args, d, b)
        hf_stats = copy.deepcopy(hf) if args.torch_stats else None
        run_torch, th = torch_setup(args, hf, b)
        runs, sides = [run_jax, run_torch], [jx, th]
        if args.torch_stats:
            run_torch_stats, ths = torch_setup(args, hf_stats, b, with_stats=True)
            runs.append(run_torch_stats)
            sides.append(ths)
        times = interleaved(runs, args.steps)
        tj, tt = times[0], times[1]
        jx["compiles"] = jx["compiles"]()
        for r, ts in zip(sides, times):
            r.update(step_s=float(np.median(ts)), min_s=float(min(ts)), times_s=ts)
        jx["compile_s"] = jx["first_call_s"] - jx["step_s"]
        ratio = jx["step_s"] / th["step_s"]
        ratio_pairs = float(np.median(np.array(tj) / np.array(tt)))
        ratio_min = jx["min_s"] / th["min_s"]
        tokens = args.prompts * args.group * (args.prompt_len + args.response_len)
        print(f"GRPO train step (JAX method {args.method}, PyTorch dense), small Qwen2 (vocab 32k, hidden 256, 4 layers, 4/2 heads, FFN 1024), "
              f"P={args.prompts} x G={args.group}, prompt {args.prompt_len} + response {args.response_len} "
              f"= {tokens} tokens, float32, T={args.temperature}, JAX remat={args.remat} "
              f"scan_layers={not args.unroll} chunk={args.chunk}; torch threads {args.threads}")
        print(f"{'impl':<8}{'step s (median)':>16}{'min s':>8}{'compile s':>11}{'loss0':>12}{'|g|0':>10}")
        print(f"{'jax':<8}{jx['step_s']:>16.3f}{jx['min_s']:>8.3f}{jx['compile_s']:>11.2f}"
              f"{jx['loss0']:>12.6f}{jx['grad_norm0']:>10.5f}")
        print(f"{'torch':<8}{th['step_s']:>16.3f}{th['min_s']:>8.3f}{'-':>11}{th['loss0']:>12.6f}"
              f"{th['grad_norm0']:>10.5f}")
        if args.torch_stats:
            print(f"{'torch+st':<8}{ths['step_s']:>16.3f}{ths['min_s']:>8.3f}{'-':>11}{ths['loss0']:>12.6f}"
                  f"{ths['grad_norm0']:>10.5f}   (also H1, H2, JS for the §5 metrics, as the JAX step)")
        print(f"ratio jax/torch step time (medians): {ratio:.2f}; median of per-pair ratios {ratio_pairs:.2f}; "
              f"of minima {ratio_min:.2f}" + (f" (target <= 1.0: {'met' if ratio <= 1.0 else 'NOT met'})"
                                               if args.method == "dense" else ""))
        ratio_stats = None
        if args.torch_stats:
            ratio_stats = jx["step_s"] / ths["step_s"]
            print(f"ratio jax/torch+stats (both compute the same statistics, medians): {ratio_stats:.2f}; "
                  f"median of per-pair ratios {float(np.median(np.array(tj) / np.array(times[2]))):.2f}")
        result["timing"] = dict(shape=SMALL, prompts=args.prompts, group=args.group, prompt_len=args.prompt_len,
                                response_len=args.response_len, temperature=args.temperature, chunk=args.chunk,
                                remat=args.remat, scan_layers=not args.unroll, steps=args.steps, method=args.method,
                                js_metrics=not args.no_js_metrics,
                                threads=args.threads, jax=jx, torch=th, ratio=ratio, ratio_pairs_median=ratio_pairs,
                                torch_stats=ths if args.torch_stats else None, ratio_vs_torch_stats=ratio_stats,
                                ratio_min=ratio_min, torch_version=torch.__version__)
    if not args.skip_memory:
        if args.mem_chunk is not None:
            args.chunk = args.mem_chunk
        rows = [memory_analysis(args, r, mu) for mu in args.mem_micro for r in args.mem_remat]
        gb = 1e9
        print(f"compiled memory of the step, Qwen2.5-0.5B shape ({rows[0]['params']:,} params, float32), "
              f"P={args.mem_prompts} x G={args.mem_group}, prompt {args.mem_prompt_len} + response "
              f"{args.mem_response_len}, chunk {args.chunk}, backend {jax.default_backend()}")
        print(f"{'remat':<8}{'micro':>6}{'temp GB':>10}{'args GB':>10}{'out GB':>10}{'alias GB':>10}{'compile s':>11}")
        for r in rows:
            print(f"{r['remat']:<8}{r['micro_batches']:>6}{r['temp_bytes'] / gb:>10.2f}{r['argument_bytes'] / gb:>10.2f}"
                  f"{r['output_bytes'] / gb:>10.2f}{r['alias_bytes'] / gb:>10.2f}{r['compile_s']:>11.1f}")
        result["memory"] = dict(prompts=args.mem_prompts, group=args.mem_group, prompt_len=args.mem_prompt_len,
                                response_len=args.mem_response_len, chunk=args.chunk, rows=rows)
    result["load_avg_end"] = os.getloadavg()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.exists() and (args.skip_timing or args.skip_memory):  # keep the other half of an earlier run
        old = json.loads(out.read_text())
        result = {**{k: v for k, v in old.items() if k in ("timing", "memory")}, **result}
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
