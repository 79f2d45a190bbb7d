"""Speed on one accelerator (a GPU), prepared to run once in a few minutes of lent device time.

    python benchmarks/accelerator.py                 # every stage at the real shapes (GPU)
    python benchmarks/accelerator.py --smoke         # every stage at tiny shapes, on CPU, in seconds
    python benchmarks/accelerator.py --stages rollout,torch --out DIR

Stages, in order; each runs in a process of its own under a hard time limit (``--stage-s``, and the whole
run under ``--total-s``), writes ``<out>/<stage>.json`` as soon as it finishes (a cut run keeps what
finished), and the table of every stage is printed at the end (``<out>/accelerator.json``):

- ``train_0p5b``, ``train_1p5b``: the RL train step (``rl.train_step.make_train_step``, the ICT recipe's
  loss, remat and stats.chunk) at the Qwen2.5-0.5B / 1.5B shapes with random weights, float32 parameters
  and bfloat16 compute, P 4 x G 8 rows of 128 prompt + 1,024 response tokens, one mini-batch: compiled
  once, then ``--steps`` timed steps. Tokens/s; MFU two ways, ``6 N tokens`` and the compiled program's
  own matmul FLOPs (``aot.cost.cost``, loop trip counts multiplied in), over the chip's peak
  (``aot.chips``); the roofline bound of the compiled step (``aot.roofline``); the device's peak memory.
- ``rollout``: the sampler (``sampling.sampler.make_generate_fn``) at the 0.5B shape in bfloat16, 32
  prompts x G 8 = 256 rows, 128 prompt + 1,024 new tokens, no EOS (every row runs to the end): tokens/s
  against the memory roofline (the least bytes every decode step must read, weights + the filled KV
  cache, over the chip's HBM bandwidth) and the compiled program's own bound; the bytes one compiled
  decode step reads over that least.
- ``torch``: transformers' ``generate`` with a static KV cache on the same device, the same random
  weights (written by ``ict_jax.save_hf``) and shapes: tokens/s, for the ratio with ``rollout``.
  Skipped (with the reason) when torch or transformers is missing, or torch has no CUDA device
  (except in ``--smoke``, which runs it on the CPU).
- ``stats``: the statistics pass (``rl.token_stats.stats_from_hidden``: logp, H1, H2, u) from bfloat16
  hidden states, 8 rows x 1,024 positions = 8,192 tokens x 151,936 vocabulary, in blocks of
  ``stats.chunk``: ms a pass, the compiler's temporaries and the device's peak memory.
- ``memory``: ``ict-jax compile --topology local``'s prediction for ``train_0p5b``'s step (the run's own
  program builder, ``aot.compile.compile_run``) against the peak ``train_0p5b`` measured.
- ``attention``: the fused attention ``model.attention: auto`` picks on the device (cuDNN on a GPU; on a
  CPU ``xla``, the same path's XLA form) against the dense form, one layer's value_and_grad at the train
  step's rows and positions (0.5B heads, left-padded rows, the compute dtype): the largest differences
  of the values and gradients, and the ms of each.
- the variants (:data:`VARIANTS`): a stage above run again with the settings of one change, today's
  program beside it: ``train_0p5b_dense`` and ``rollout_dense`` (``model.attention=dense``, the attention
  before the fused kernel that ``auto`` picks on a GPU), ``train_0p5b_blocked``, ``rollout_unrolled``
  (``unroll_layers=True``: per-layer KV caches, the decode that reads its cache in place). Each record
  names the stage it varies and the settings; the table gives its speed over that stage's.

Every compiled program's optimised HLO text goes to ``<out>/hlo/<stage>.hlo.txt.gz`` (``--dump-hlo DIR``
elsewhere, ``--no-hlo`` not at all): the lent machine's time is short, its programs are read here.

Imports only what the stages need (no gguf, math-verify, tensorboardX or reasoning-gym: the lent GPU
machine lacks them). docs/benchmarks.md "Accelerator".
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

#: the variant stages: today's program against each change, by its settings: name -> (the stage it varies,
#: the settings that differ: ``model.*`` config keys, or the sampler's ``unroll_layers``)
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "train_0p5b_dense": ("train_0p5b", {"model.attention": "dense"}),  # the step before the fused attention
    "train_0p5b_blocked": ("train_0p5b", {"model.attention": "blocked"}),
    "rollout_dense": ("rollout", {"model.attention": "dense"}),  # the prefill before the fused attention
    "rollout_unrolled": ("rollout", {"unroll_layers": True}),  # per-layer KV caches: no slice copied a step
}
STAGES = ("train_0p5b", "train_1p5b", "rollout", "torch", "stats", "memory", "attention", *VARIANTS)
#: default seconds a stage may take at the real shapes (compiles included); the whole run: TOTAL_S
STAGE_S = {"train_0p5b": 120, "train_1p5b": 150, "rollout": 120, "torch": 120, "stats": 60, "memory": 90,
           "attention": 60,
           "train_0p5b_dense": 120, "train_0p5b_blocked": 120, "rollout_dense": 120, "rollout_unrolled": 150}
TOTAL_S = 540
RECIPES = {"0p5b": "configs/qwen2p5_0p5b_ict.yaml", "1p5b": "configs/qwen2p5_1p5b_ict.yaml"}
PRESETS = {"0p5b": "qwen2p5_0p5b", "1p5b": "qwen2p5_1p5b"}
ROOT = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------------------------------------
# Shapes
# ------------------------------------------------------------------------------------------------
def shapes(smoke: bool) -> dict[str, Any]:
    """Every stage's sizes: the real ones, or tiny ones that run on a CPU in seconds."""
    if smoke:
        return dict(P=2, G=4, Lp=8, N=16, rollout_prompts=4, stats_rows=2, stats_T=64, stats_vocab=512,
                    steps=2, dtype="float32", model=dict(preset="tiny"))
    return dict(P=4, G=8, Lp=128, N=1024, rollout_prompts=32, stats_rows=8, stats_T=1024, stats_vocab=151_936,
                steps=5, dtype="bfloat16", model=None)


def model_config(size: str, smoke: bool, *, param_dtype: str = "float32", attention: str | None = None):
    """The model at ``size``'s shape (``attention``: ``model.attention``, default the config's own)."""
    from ict_jax.config import ModelSection
    from ict_jax.model.config import ModelConfig

    s = shapes(smoke)
    kw = dict(compute_dtype=s["dtype"], param_dtype=param_dtype, attention=attention or ModelSection().attention)
    if smoke:
        return ModelConfig.tiny(**kw)
    return ModelConfig.preset(PRESETS[size], **kw)


def train_config(size: str, smoke: bool, attention: str | None = None):
    """The recipe's config at the benchmark's batch: its loss, remat and stats.chunk; one mini-batch; the
    mesh over every local device (one GPU: 1 x 1 x 1; the train stage runs on the first device)."""
    from ict_jax.config_load import load_config

    s = shapes(smoke)
    overrides = [f"train.prompts_per_step={s['P']}", f"rollout.num_samples={s['G']}",
                 f"rollout.max_prompt_len={s['Lp']}", f"rollout.max_new_tokens={s['N']}", "train.mini_batches=1",
                 "train.micro_batches=1", "mesh.data=1", "mesh.fsdp=-1", "mesh.tensor=1",
                 f"model.preset={'tiny' if smoke else PRESETS[size]}",
                 f"model.compute_dtype={s['dtype']}"]
    if smoke:
        overrides.append("stats.chunk=8")
    if attention is not None:
        overrides.append(f"model.attention={attention}")
    return load_config(str(ROOT / RECIPES[size]), overrides)


# ------------------------------------------------------------------------------------------------
# Helpers
# ------------------------------------------------------------------------------------------------
def device_info() -> dict[str, Any]:
    import jax

    from ict_jax.aot.chips import chip_for

    dev = jax.devices()[0]
    chip = chip_for(device_kind=dev.device_kind)
    return dict(platform=dev.platform, device_kind=dev.device_kind, jax=jax.__version__,
                chip=None if chip is None else dict(name=chip.name, peak_flops=chip.peak_flops, hbm_bw=chip.hbm_bw,
                                                     source=chip.source))


def _memory_stat(key: str) -> int | None:
    """One of the device's memory statistics (None where the backend keeps none: a CPU)."""
    import jax

    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:  # noqa: BLE001 - some backends raise instead of returning None
        return None
    return (int(stats.get(key, 0)) or None) if stats else None


def peak_memory() -> int | None:
    """The device's peak bytes in use so far (None where the backend keeps no statistics: a CPU)."""
    return _memory_stat("peak_bytes_in_use")


#: a compiled program runs when its live bytes are at most this fraction of the device's allocator limit
FIT_FRACTION = 0.95
#: where each stage's compiled program goes (``<out>/hlo`` unless ``--dump-hlo DIR`` or ``--no-hlo``)
DUMP_DIR: Path | None = None


def device_bytes_limit() -> int | None:
    """The bytes the device's allocator may hand out (None where the backend keeps no statistics: a CPU)."""
    return _memory_stat("bytes_limit")


def compiled_live(compiled) -> int:
    """Bytes a compiled program holds while it runs: arguments, temporaries and outputs not aliased to an
    argument (what ``ict-jax compile`` reports as live)."""
    m = compiled.memory_analysis()
    return int(m.argument_size_in_bytes + m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes)


def dump_hlo(name: str, compiled) -> None:
    """The compiled program's optimised HLO text as ``DUMP_DIR/<name>.hlo.txt.gz`` (gzip: a 0.5B step's text
    is tens of MB, and what the lent machine returns is limited; ``zcat`` or ``aot.hlo.parse_hlo`` of the
    decompressed text read it)."""
    import gzip

    if DUMP_DIR is not None:
        DUMP_DIR.mkdir(parents=True, exist_ok=True)
        with gzip.open(DUMP_DIR / f"{name}.hlo.txt.gz", "wt") as f:
            f.write(compiled.as_text())


def hlo_cost(compiled, **kw):
    """The roofline of a compiled program on this device (``aot.roofline.estimate``)."""
    import jax

    from ict_jax.aot import hlo, roofline
    from ict_jax.aot.chips import chip_for

    module = hlo.parse_hlo(compiled.as_text())
    return roofline.estimate(module, chip_for(device_kind=jax.devices()[0].device_kind), chips=1, **kw)


def timed(fn: Callable[[], Any], steps: int, deadline: float) -> list[float]:
    """Seconds of up to ``steps`` calls of ``fn`` (blocking on its result), fewer if ``deadline`` passes."""
    import jax

    times = []
    for _ in range(steps):
        if times and time.monotonic() > deadline:
            break
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return times


def median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else 0.5 * (xs[len(xs) // 2 - 1] + xs[len(xs) // 2])


# ------------------------------------------------------------------------------------------------
# Stages (each returns its JSON record)
# ------------------------------------------------------------------------------------------------
def stage_train(size: str, smoke: bool, deadline: float, attention: str | None = None,
                name: str | None = None) -> dict[str, Any]:
    """The train step at ``size``'s shape with the recipe's settings (``attention``: ``model.attention``
    instead of the recipe's)."""
    import jax

    import ict_jax
    from ict_jax.aot.compile import target_model_config
    from ict_jax.rl.state import init_train_state, reference_params
    from ict_jax.rl.train_step import make_train_step
    from ict_jax.train.programs import reference_dtype

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from train_step import make_batch, rollout_batch

    s = shapes(smoke)
    cfg = train_config(size, smoke, attention)
    name = name or f"train_{size}"
    mc, _ = target_model_config(cfg, jax.devices()[0].platform)  # what `ict-jax compile` builds
    model = ict_jax.init_model(mc, seed=0)
    state = init_train_state(cfg, model)
    ref = reference_params(state, reference_dtype(mc)) if cfg.rl.loss.kl_coef > 0 else None
    del model
    P, G, Lp, N = s["P"], s["G"], s["Lp"], s["N"]
    batch = rollout_batch(make_batch(P, G, Lp, N, mc.vocab_size))
    limit, fit, micro = device_bytes_limit(), [], cfg.train.micro_batches
    while True:  # the recipe's one micro-batch, or the fewest micro-batches whose compiled step fits the device
        cfg = cfg.replace(**{"train.micro_batches": micro})
        t0 = time.perf_counter()
        compiled = make_train_step(cfg).lower(state, batch, ref, response_len=N).compile()
        compile_s = time.perf_counter() - t0
        dump_hlo(name, compiled)
        live = compiled_live(compiled)
        fit.append(dict(micro_batches=micro, live=live, compile_s=compile_s))
        rows = P * G
        if limit is None or live <= FIT_FRACTION * limit or micro * 2 > rows or rows % (micro * 2):
            break
        print(f"[accelerator] {name}: train.micro_batches {micro} needs {_gib(live)} live, over "
              f"{FIT_FRACTION:.0%} of the {_gib(limit)} the device allows: compiling {micro * 2}", flush=True)
        micro *= 2
    if limit is not None and live > FIT_FRACTION * limit:
        raise MemoryError(f"{name}: {_gib(live)} live even at train.micro_batches {micro}, over "
                          f"{FIT_FRACTION:.0%} of the device's {_gib(limit)}")
    box = {"state": state}

    def run():
        box["state"], m = compiled(box["state"], batch, ref)
        return box["state"].params, m

    jax.block_until_ready(run())  # a warm step
    times = timed(run, s["steps"], deadline)
    step_s = median(times)
    n_params, tokens = mc.num_params(), P * G * (Lp + N)
    six_nd = 6.0 * n_params * tokens
    roof = hlo_cost(compiled, model_flops=six_nd, tokens=tokens, training=True)
    info = device_info()
    peak = info["chip"]["peak_flops"] if info["chip"] else None
    mem = compiled.memory_analysis()
    return dict(stage=name, shape=dict(P=P, G=G, prompt=Lp, response=N, tokens=tokens),
                micro_batches=micro, fit=fit, device_bytes_limit=limit, params=n_params, remat=mc.remat, attention=mc.attention,
                stats_chunk=cfg.stats.chunk, compute_dtype=mc.resolved_compute_dtype(),
                kl_coef=cfg.rl.loss.kl_coef, compile_s=compile_s, steps_s=times, step_s=step_s,
                tokens_per_s=tokens / step_s, model_flops=six_nd, hlo_flops=roof.flops, hlo_bytes=roof.bytes,
                mfu_6nd=None if peak is None else six_nd / step_s / peak,
                mfu_hlo=None if peak is None else roof.flops / step_s / peak,
                roofline=roof.to_dict(), peak_memory=peak_memory(),
                compiled_memory=dict(arguments=mem.argument_size_in_bytes, temporaries=mem.temp_size_in_bytes,
                                     outputs=mem.output_size_in_bytes, aliased=mem.alias_size_in_bytes),
                loss=float(run()[1]["loss/total"]), **info)


def rollout_setup(smoke: bool, attention: str | None = None):
    """The 0.5B-shaped model in bfloat16 (float32 in --smoke) and the prompts, shared by rollout and torch."""
    import numpy as np

    import ict_jax

    s = shapes(smoke)
    mc = model_config("0p5b", smoke, param_dtype=s["dtype"], attention=attention)
    model = ict_jax.init_model(mc, seed=0)
    rng = np.random.default_rng(0)
    prompts = rng.integers(3, mc.vocab_size, (s["rollout_prompts"], s["Lp"])).astype(np.int32)
    return mc, model, prompts


def least_decode_bytes(mc, rows: int, Lp: int, N: int, min_bucket: int | None) -> tuple[float, float]:
    """(bytes every decode of the run must read at least: each step the weights in the compute dtype and the
    KV cache's slots of its phase; bytes of one step of the last phase)."""
    import jax.numpy as jnp

    from ict_jax.buckets import response_buckets
    from ict_jax.sampling.sampler import decode_steps

    size = jnp.dtype(mc.resolved_compute_dtype()).itemsize
    weights = (mc.num_params() - (0 if mc.tie_word_embeddings else mc.vocab_size * mc.hidden_size)) * size
    kv_slot = 2 * mc.num_layers * rows * mc.num_kv_heads * mc.resolved_head_dim * size
    windows = response_buckets(N, min_bucket)
    total = sum(steps * (weights + kv_slot * (Lp + w - 1)) for steps, w in zip(decode_steps(N, min_bucket), windows))
    return total, weights + kv_slot * (Lp + N - 1)


def stage_rollout(smoke: bool, deadline: float, unroll: bool | None = None, attention: str | None = None,
                  name: str = "rollout") -> dict[str, Any]:
    """The sampler with its default layer loop for the platform (``unroll`` None: a scan on an accelerator),
    or with ``unroll_layers=True`` (per-layer weights and KV caches: no slice of a stacked cache a step);
    ``attention``: the prefill's ``model.attention`` (default the config's)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from ict_jax.config import RolloutSection
    from ict_jax.sampling.sampler import SampleSettings, decode_unrolled, make_generate_fn

    s = shapes(smoke)
    mc, model, prompts = rollout_setup(smoke, attention)
    G, Lp, N = s["G"], s["Lp"], s["N"]
    rows = prompts.shape[0] * G
    graphdef, state = nnx.split(model)
    min_bucket = RolloutSection().min_response_bucket
    fn = make_generate_fn(graphdef, num_samples=G, max_new_tokens=N, temperature=1.0, eos_ids=(),
                          min_response_bucket=min_bucket, unroll_layers=unroll)
    unrolled = decode_unrolled(SampleSettings(max_new_tokens=N, unroll_layers=unroll), mc.num_layers)
    ids, mask = jnp.asarray(prompts), jnp.ones(prompts.shape, jnp.int32)
    key = jax.random.key(0)
    t0 = time.perf_counter()
    compiled = fn.jitted.lower(state, ids, mask, key).compile()
    compile_s = time.perf_counter() - t0
    dump_hlo(name, compiled)
    times = timed(lambda: compiled(state, ids, mask, key).tokens, 2, deadline)
    gen_s = min(times)
    tokens = rows * N
    least, least_step = least_decode_bytes(mc, rows, Lp, N, min_bucket)
    from ict_jax.sampling.sampler import decode_steps

    roof = hlo_cost(compiled, model_flops=2.0 * mc.num_params() * tokens, tokens=tokens,
                    decode_steps=decode_steps(N, min_bucket), decode_min_bytes=least_step)
    info = device_info()
    bw = info["chip"]["hbm_bw"] if info["chip"] else None
    return dict(stage=name, unrolled=unrolled, attention=mc.resolved_attention(), rows=rows, prompt=Lp, new_tokens=N, dtype=s["dtype"], params=mc.num_params(),
                compile_s=compile_s, runs_s=times, generate_s=gen_s, tokens_per_s=tokens / gen_s,
                least_bytes=least, memory_roofline_s=None if bw is None else least / bw,
                memory_roofline_tokens_per_s=None if bw is None else tokens / (least / bw),
                roofline_fraction=None if bw is None else (least / bw) / gen_s,
                roofline=roof.to_dict(), decode_step_ratio=roof.decode_ratio, peak_memory=peak_memory(), **info)


def stage_torch(smoke: bool, deadline: float) -> dict[str, Any]:
    try:
        import torch
        import transformers
    except ImportError as e:
        return dict(stage="torch", skipped=f"torch/transformers not installed: {e}")
    if not smoke and not torch.cuda.is_available():
        return dict(stage="torch", skipped="torch has no CUDA device")
    import tempfile

    import numpy as np

    from ict_jax import save_hf

    s = shapes(smoke)
    mc, model, prompts = rollout_setup(smoke)
    G, N = s["G"], s["N"]
    device = "cuda" if torch.cuda.is_available() and not smoke else "cpu"
    dtype = torch.bfloat16 if s["dtype"] == "bfloat16" else torch.float32
    with tempfile.TemporaryDirectory() as d:
        save_hf(model, d)
        del model
        hf = transformers.Qwen2ForCausalLM.from_pretrained(d, dtype=dtype).to(device).eval()
    ids = torch.as_tensor(np.repeat(prompts, G, axis=0), device=device)
    kw = dict(max_new_tokens=N, min_new_tokens=N, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
              cache_implementation="static", pad_token_id=0, attention_mask=torch.ones_like(ids))
    times = []
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = hf.generate(ids, **kw)  # the first call sets up the static cache
        if device == "cuda":
            torch.cuda.synchronize()
        first_s = time.perf_counter() - t0
        if time.monotonic() < deadline:
            t0 = time.perf_counter()
            out = hf.generate(ids, **kw)
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    new = int(out.shape[1] - ids.shape[1])
    gen_s = min(times) if times else first_s
    return dict(stage="torch", rows=int(ids.shape[0]), new_tokens=new, device=device, dtype=str(dtype),
                torch=torch.__version__, transformers=transformers.__version__, first_call_s=first_s,
                runs_s=times, generate_s=gen_s, tokens_per_s=ids.shape[0] * new / gen_s,
                peak_memory=int(torch.cuda.max_memory_allocated()) if device == "cuda" else None)


def stage_attention(smoke: bool, deadline: float) -> dict[str, Any]:
    """The fused attention the platform's ``model.attention: auto`` picks (cuDNN on a GPU; ``xla``, its
    path's XLA form, on a CPU) against the dense form at the train step's shapes: one layer's
    ``value_and_grad`` w.r.t. q, k, v of a weighted sum over the real positions of left-padded rows, in
    the compute dtype; the largest differences of the values and gradients (the parity of
    tests/model/test_fused_attention.py, here at the recipe's shapes and on the device's kernel) and the
    ms of each."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from ict_jax.model.attention import attend
    from ict_jax.model.config import resolve_attention
    from ict_jax.model.fused_attention import IMPLEMENTATIONS, fused_attend

    s = shapes(smoke)
    mc = model_config("0p5b", smoke)
    platform = jax.devices()[0].platform
    impl = resolve_attention("auto", platform, s["dtype"])
    impl = impl if impl in IMPLEMENTATIONS else "xla"
    B, T, H, KV, hd = s["G"], s["Lp"] + s["N"] - 1, mc.num_heads, mc.num_kv_heads, mc.resolved_head_dim
    dtype = jnp.dtype(s["dtype"])
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal(shape), dtype) for shape in
               ((B, T, H, hd), (B, KV, T, hd), (B, KV, T, hd)))
    pad = rng.integers(0, s["Lp"], B)  # left-padded prompts
    mask = jnp.asarray(np.arange(T)[None, :] >= pad[:, None], jnp.int32)
    allowed = jnp.tril(jnp.ones((T, T), bool))[None] & (mask[:, None, :] > 0)
    w = jnp.asarray(rng.standard_normal((B, T, H, hd)), jnp.float32) * mask[:, :, None, None]

    def loss(fn):
        return jax.jit(jax.value_and_grad(lambda q, k, v: (fn(q, k, v).astype(jnp.float32) * w).sum(),
                                          argnums=(0, 1, 2)))

    fns = {"dense": loss(lambda q, k, v: attend(q, k, v, allowed, dtype)),
           impl: loss(lambda q, k, v: fused_attend(q, k, v, mask, dtype, impl))}
    outs, ms = {}, {}
    for name, fn in fns.items():
        compiled = fn.lower(q, k, v).compile()
        dump_hlo(f"attention_{name}", compiled)
        outs[name] = jax.block_until_ready(compiled(q, k, v))
        ms[name] = 1e3 * median(timed(lambda c=compiled: c(q, k, v), 5 if not smoke else 2, deadline))
    (l_ref, g_ref), (l_got, g_got) = outs["dense"], outs[impl]
    grad_diff = {n: float(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)).max())
                 for n, a, b in zip("qkv", g_got, g_ref)}
    grad_scale = {n: float(jnp.abs(b.astype(jnp.float32)).max()) for n, b in zip("qkv", g_ref)}
    return dict(stage="attention", implementation=impl, rows=B, positions=T, heads=H, kv_heads=KV, head_dim=hd,
                dtype=str(dtype), loss=float(l_ref), loss_diff=abs(float(l_got) - float(l_ref)),
                grad_max_diff=grad_diff, grad_max=grad_scale, ms=ms, speedup=ms["dense"] / ms[impl], **device_info())


def stage_stats(smoke: bool, deadline: float) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from ict_jax.config import StatsSection
    from ict_jax.rl.token_stats import stats_from_hidden

    s = shapes(smoke)
    B, T, V, D = s["stats_rows"], s["stats_T"], s["stats_vocab"], (64 if smoke else 896)
    chunk = 8 if smoke else StatsSection().chunk
    dtype = jnp.bfloat16 if s["dtype"] == "bfloat16" else jnp.float32
    rng = np.random.default_rng(0)
    hidden = jnp.asarray(rng.standard_normal((B, T, D), np.float32), dtype)
    unembed = jnp.asarray(rng.standard_normal((D, V), np.float32) * 0.05, dtype)
    tokens = jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32)
    valid = jnp.ones((B, T), jnp.float32)

    def stats(h, w, t, v):
        r = stats_from_hidden(h, w, t, v, group_size=B, temperature=1.0, chunk=chunk,
                              compute=("logp", "H1", "H2", "js"))
        return r.logp, r.H1, r.H2, r.js

    t0 = time.perf_counter()
    compiled = jax.jit(stats).lower(hidden, unembed, tokens, valid).compile()
    compile_s = time.perf_counter() - t0
    dump_hlo("stats", compiled)
    times = timed(lambda: compiled(hidden, unembed, tokens, valid), 5 if not smoke else 2, deadline)
    pass_s = median(times)
    return dict(stage="stats", rows=B, positions=T, tokens=B * T, vocab=V, hidden=D, chunk=chunk,
                dtype=str(jnp.dtype(dtype)), compile_s=compile_s, runs_s=times, pass_ms=pass_s * 1e3,
                temporaries=int(compiled.memory_analysis().temp_size_in_bytes), peak_memory=peak_memory(),
                **device_info())


def stage_memory(smoke: bool, deadline: float, out: Path) -> dict[str, Any]:
    from ict_jax.aot.compile import compile_run, get_target

    cfg = train_config("0p5b", smoke)
    local = get_target("local")  # its first device, where the train stage ran (a lent machine has one)
    (rep,), source = compile_run(cfg, dataclasses.replace(local, devices=local.devices[:1]), ("step",))
    measured = None
    train = out / "train_0p5b.json"
    if train.exists():
        measured = json.loads(train.read_text()).get("peak_memory")
    return dict(stage="memory", program="step", model=source, predicted_live=rep.live,
                predicted=dict(arguments=rep.arguments, temporaries=rep.temporaries, outputs=rep.outputs,
                               aliased=rep.aliased, code=rep.code),
                measured_peak=measured, ratio=None if not measured or not rep.live else measured / rep.live,
                compile_s=rep.compile_s, **device_info())


def run_stage(name: str, smoke: bool, out: Path, stage_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + 0.6 * stage_s  # leave the rest for compiles already counted
    base, settings = VARIANTS.get(name, (name, {}))
    rec = _run_base(base, name, settings, smoke, out, deadline)
    if name in VARIANTS:
        rec.update(variant_of=base, settings=settings)
    return rec


def _run_base(base: str, name: str, settings: dict[str, Any], smoke: bool, out: Path, deadline: float):
    attention = settings.get("model.attention")
    if base in ("train_0p5b", "train_1p5b"):
        return stage_train(base[len("train_"):], smoke, deadline, attention, name=name)
    if base == "rollout":
        return stage_rollout(smoke, deadline, unroll=settings.get("unroll_layers"), attention=attention, name=name)
    if base == "torch":
        return stage_torch(smoke, deadline)
    if base == "stats":
        return stage_stats(smoke, deadline)
    if base == "memory":
        return stage_memory(smoke, deadline, out)
    if base == "attention":
        return stage_attention(smoke, deadline)
    raise ValueError(f"unknown stage {name!r}; stages: {', '.join(STAGES)}")


# ------------------------------------------------------------------------------------------------
# The table
# ------------------------------------------------------------------------------------------------
def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def _gib(x: float | None) -> str:
    from ict_jax.memory import fmt_bytes

    return "-" if x is None else fmt_bytes(x)


def summary_rows(results: dict[str, dict]) -> list[tuple[str, str]]:
    rows = []
    for name in STAGES:
        r = results.get(name)
        if r is None:
            continue
        if "error" in r or "skipped" in r:
            rows.append((name, f"{'skipped' if 'skipped' in r else 'FAILED'}: {r.get('skipped') or r.get('error')}"))
        elif name.startswith("train_"):
            roof = r["roofline"]
            rows.append((name, f"{r['step_s']:.3f} s a step, {r['tokens_per_s']:,.0f} tok/s, MFU {_pct(r['mfu_6nd'])} "
                               f"(6ND) / {_pct(r['mfu_hlo'])} (HLO flops {r['hlo_flops'] / r['model_flops']:.2f}x 6ND); "
                               f"ceiling {_pct(roof['mfu_ceiling'])}; peak {_gib(r['peak_memory'])}; "
                               f"compile {r['compile_s']:.0f} s"
                               + (f"; train.micro_batches {r['micro_batches']}" if r.get("micro_batches", 1) > 1 else "")))
        elif name == "rollout" or VARIANTS.get(name, ("",))[0] == "rollout":
            rows.append((name, f"{r['tokens_per_s']:,.0f} tok/s ({r['rows']} rows x {r['new_tokens']}); memory roofline "
                               + ("-" if r["memory_roofline_tokens_per_s"] is None else
                                  f"{r['memory_roofline_tokens_per_s']:,.0f} tok/s ({_pct(r['roofline_fraction'])} of it)")
                               + f"; decode step reads {r['decode_step_ratio'] or 0:.2f}x weights + KV"))
        elif name == "torch":
            jax_tps = results.get("rollout", {}).get("tokens_per_s")
            ratio = f"; JAX / torch {jax_tps / r['tokens_per_s']:.2f}x" if jax_tps else ""
            rows.append((name, f"{r['tokens_per_s']:,.0f} tok/s on {r['device']}{ratio}"))
        elif name == "stats":
            rows.append((name, f"{r['pass_ms']:.1f} ms a pass ({r['tokens']:,} tokens x {r['vocab']:,}), temporaries "
                               f"{_gib(r['temporaries'])}, peak {_gib(r['peak_memory'])}"))
        elif name == "memory":
            rows.append((name, f"predicted {_gib(r['predicted_live'])} live, measured peak {_gib(r['measured_peak'])}"
                               + ("" if r["ratio"] is None else f" ({r['ratio']:.2f}x)")))
        elif name == "attention":
            diff = max(r["grad_max_diff"].values())
            rows.append((name, f"{r['implementation']} {r['ms'][r['implementation']]:.2f} ms vs dense "
                               f"{r['ms']['dense']:.2f} ms ({r['speedup']:.2f}x) a layer's value_and_grad, "
                               f"{r['rows']} rows x {r['positions']}; max |grad - dense| {diff:.2e}"))
        base = results.get(VARIANTS[name][0], {}) if name in VARIANTS and rows and rows[-1][0] == name else {}
        if base.get("tokens_per_s") and r.get("tokens_per_s"):  # a variant beside the program it varies
            rows[-1] = (name, rows[-1][1] + f"; {r['tokens_per_s'] / base['tokens_per_s']:.2f}x the speed of "
                                            f"{VARIANTS[name][0]}")
    return rows


def render(results: dict[str, dict]) -> str:
    rows = summary_rows(results)
    width = max((len(n) for n, _ in rows), default=5)
    return "\n".join(f"{n:<{width}}  {line}" for n, line in rows)


# ------------------------------------------------------------------------------------------------
# Driver
# ------------------------------------------------------------------------------------------------
def default_out() -> Path:
    return Path(os.environ["OUT"]) / "accelerator" if os.environ.get("OUT") else ROOT / "benchmarks/results/accelerator"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, on the CPU, in seconds")
    ap.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated, from {', '.join(STAGES)}")
    ap.add_argument("--out", type=Path, default=None, help="folder for the JSON (default $OUT/accelerator, else "
                                                           "benchmarks/results/accelerator)")
    ap.add_argument("--stage-s", type=float, default=None, help="seconds each stage may take (default: per stage)")
    ap.add_argument("--total-s", type=float, default=TOTAL_S, help="seconds the whole run may take")
    ap.add_argument("--in-process", action="store_true",
                    help="run the stages in this process (no hard time limit; what the tests use)")
    ap.add_argument("--dump-hlo", type=Path, default=None, metavar="DIR",
                    help="write each compiled program's optimised HLO text to DIR/<stage>.hlo.txt.gz "
                         "(default: <out>/hlo)")
    ap.add_argument("--no-hlo", action="store_true", help="write no HLO text")
    ap.add_argument("--stage", default=None, help=argparse.SUPPRESS)  # a child process: run this stage only
    args = ap.parse_args(argv)
    stages = [s for s in args.stages.split(",") if s]
    bad = [s for s in stages if s not in STAGES]
    if bad:
        ap.error(f"--stages: unknown {', '.join(bad)}; stages: {', '.join(STAGES)}")
    args.stage_list = stages
    args.out = args.out or default_out()
    args.dump_hlo = None if args.no_hlo else (args.dump_hlo or args.out / "hlo")
    return args


def stage_limit(args: argparse.Namespace, name: str) -> float:
    return args.stage_s if args.stage_s is not None else (180.0 if args.smoke else STAGE_S[name])


def _setup_env(smoke: bool) -> None:
    if smoke:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # peaks from memory_stats, torch beside


def child(args: argparse.Namespace) -> int:
    global DUMP_DIR
    _setup_env(args.smoke)
    DUMP_DIR = args.dump_hlo
    name = args.stage
    try:
        rec = run_stage(name, args.smoke, args.out, stage_limit(args, name))
    except Exception as e:  # noqa: BLE001 - the record says what failed; other stages go on
        import traceback

        rec = dict(stage=name, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-4000:])
    (args.out / f"{name}.json").write_text(json.dumps(rec, indent=2, default=str))
    return 0 if "error" not in rec else 1


def main(argv: list[str] | None = None) -> int:
    global DUMP_DIR
    args = parse_args(argv)
    DUMP_DIR = args.dump_hlo
    args.out.mkdir(parents=True, exist_ok=True)
    if args.stage:
        return child(args)
    from ict_jax.experiments.provenance import machine  # the host; each stage's record names its device

    host = machine()
    start = time.monotonic()
    results: dict[str, dict] = {}
    for name in args.stage_list:
        left = args.total_s - (time.monotonic() - start)
        limit = min(stage_limit(args, name), left)
        path = args.out / f"{name}.json"
        path.unlink(missing_ok=True)
        if limit < 10:
            rec = dict(stage=name, skipped=f"the run's {args.total_s:.0f} s were spent")
        elif args.in_process:
            _setup_env(args.smoke)
            t0, c0 = time.monotonic(), time.process_time()
            try:
                rec = run_stage(name, args.smoke, args.out, limit)
            except Exception as e:  # noqa: BLE001 - recorded; the other stages go on
                rec = dict(stage=name, error=f"{type(e).__name__}: {e}")
            rec.update(wall_s=time.monotonic() - t0, cpu_s=time.process_time() - c0)
        else:
            cmd = [sys.executable, __file__, "--stage", name, "--out", str(args.out), "--stage-s", str(limit)]
            cmd += ["--smoke"] if args.smoke else []
            cmd += ["--dump-hlo", str(args.dump_hlo)] if args.dump_hlo else ["--no-hlo"]
            t0 = time.monotonic()
            try:
                subprocess.run(cmd, timeout=limit, check=False)
                rec = json.loads(path.read_text()) if path.exists() else dict(stage=name, error="no record written")
            except subprocess.TimeoutExpired:
                rec = dict(stage=name, error=f"cut at its time limit of {limit:.0f} s")
            rec.setdefault("wall_s", time.monotonic() - t0)
        path.write_text(json.dumps(rec, indent=2, default=str))
        results[name] = rec
        (args.out / "accelerator.json").write_text(json.dumps(dict(smoke=args.smoke, machine=host, stages=results), indent=2,
                                                              default=str))
        print(f"[accelerator] {name}: {'done' if 'error' not in rec and 'skipped' not in rec else 'not done'} "
              f"({time.monotonic() - start:.0f} s so far)", flush=True)
    print(render(results))
    return 0 if all("error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
