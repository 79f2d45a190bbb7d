"""``ict-jax compile --fit``: the cheapest settings under which every program of a run fits a target
(docs/tpu.md "--fit").

The knobs are the ones that change memory but not the method (docs/method.md): the mesh (how the
chips split into ``data`` and ``fsdp``, and ``tensor``), ``train.micro_batches`` (gradient
accumulation: the loss uses the mini-batch's denominators, so the gradient is that of one batch),
``model.remat`` and ``stats.chunk``. The batch geometry (P, G, mini-batches, lengths) stays the
recipe's.

No brute force: every candidate gets an analytic per-device memory estimate (:func:`estimate_memory`)
and an analytic step time (:func:`estimate_seconds`: FLOPs over the chips' peak plus the FSDP
gathers and gradient reductions over the inter-chip bandwidth). Candidates are tried cheapest first;
one whose estimate exceeds the HBM is skipped without compiling; the rest are compiled to confirm,
and the estimate is rescaled by what each compile measured (a candidate compiled too big raises every
later estimate by the same factor). The first candidate whose programs all compile and fit wins.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Callable, Sequence

from ict_jax.aot.chips import Chip, chip_for
from ict_jax.aot.compile import (
    ProgramReport,
    Target,
    build_programs,
    compile_program,
    fmt_bytes,
    prompt_len,
    run_programs,
    sft_len,
    target_model_config,
)
from ict_jax.config import Config
from ict_jax.model.config import ModelConfig
from ict_jax.sharding import make_mesh

REMATS = ("none", "block", "full")
CHUNKS = (128, 64, 32)
#: generate's row chunking (``rollout.chunks``): sequential sampler calls of P / chunks prompts
ROLLOUT_CHUNKS = (1, 2, 4, 8)
#: Fraction of peak FLOP/s the estimate assumes (ranks candidates; not a prediction of MFU).
MFU = 0.4
#: Extra forward passes of the gradient pass per remat mode (recomputation in the backward pass).
REMAT_EXTRA = {"none": 0.0, "block": 0.1, "full": 1.0}
#: Fixed cost of one iteration of a compiled loop (a layer, a statistics block): favours fewer, larger
#: micro-batches and blocks when the FLOPs are equal.
LOOP_S = 20e-6
#: Figures assumed for a target the chip table (``aot.chips``) does not know (a CPU): they only rank.
_UNKNOWN_CHIP = Chip("unknown", 100e12, 800e9, 100e9, (), "placeholder for ranking")


@dataclasses.dataclass(frozen=True)
class Candidate:
    overrides: dict[str, Any]
    memory: int  # estimated peak bytes a device, largest program
    seconds: float  # estimated step time

    def line(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.overrides.items())


@dataclasses.dataclass
class FitResult:
    target: str
    best: Candidate | None
    tried: list[dict[str, Any]]
    reports: list[ProgramReport]
    mesh: dict[str, int]
    model_source: str
    candidates: int
    headroom: float
    lora: bool = False  # the run trains LoRA adapters (model.lora.enabled)
    sft: bool = False  # the SFT step was among the programs (train.sft_batch_size is not a knob here)

    def to_dict(self) -> dict[str, Any]:
        return {"target": self.target, "candidates": self.candidates, "headroom": self.headroom, "tried": self.tried,
                "best": None if self.best is None else dict(overrides=self.best.overrides,
                                                              estimated_memory=self.best.memory,
                                                              estimated_seconds=self.best.seconds)}


# ------------------------------------------------------------------------------------------------
# Analytic model
# ------------------------------------------------------------------------------------------------
def _layer_params(mc: ModelConfig) -> int:
    d, f, hd = mc.hidden_size, mc.intermediate_size, mc.resolved_head_dim
    return d * (mc.num_heads + 2 * mc.num_kv_heads) * hd + mc.num_heads * hd * d + 3 * d * f


def _mesh_sizes(ov: dict[str, Any]) -> tuple[int, int, int]:
    return ov["mesh.data"], ov["mesh.fsdp"], ov["mesh.tensor"]


def estimate_memory(cfg: Config, mc: ModelConfig, ov: dict[str, Any]) -> dict[str, int]:
    """Per-device bytes of each program under the overrides ``ov`` (mesh, micro_batches, remat, chunk):
    the state's shards, the gradient and optimizer temporaries, the saved activations of the
    gradient pass by remat mode, one layer's attention and MLP working set, the statistics block, and
    the sampler's KV cache; the SFT step holds the parameters, its own optimizer state (RL's and the
    reference do not exist yet) and one batch of ``train.sft_batch_size`` rows. An estimate to order and
    prune candidates; compiling decides."""
    data, fsdp, tensor = _mesh_sizes(ov)
    shards = data * fsdp
    pb, cb = (4 if mc.param_dtype == "float32" else 2), (4 if mc.resolved_compute_dtype() == "float32" else 2)
    n = mc.num_params()
    L, D, F, V = mc.num_layers, mc.hidden_size, mc.intermediate_size, mc.vocab_size
    H, KV, hd = mc.num_heads, mc.num_kv_heads, mc.resolved_head_dim
    weight_shard = n / (fsdp * tensor)
    # what trains: every weight, or with LoRA the adapters (the base frozen, in its own dtype; no reference copy)
    trained = mc.num_adapter_params() / (fsdp * tensor) if mc.lora is not None else weight_shard
    base_b = 4 if mc.base_param_dtype == "float32" else 2
    params = weight_shard * base_b + trained * pb if mc.lora is not None else weight_shard * pb
    opt = trained * 8
    ref = weight_shard * cb if cfg.rl.loss.kl_coef > 0 and mc.lora is None else 0
    t = cfg.train
    P, G, Lp, N = t.prompts_per_step, cfg.rollout.num_samples, prompt_len(cfg), cfg.rollout.max_new_tokens
    T = Lp + N
    micro = ov["train.micro_batches"]
    chunks = t.mini_batches * micro
    rows = P * G / chunks / shards  # rows a device per micro-batch
    per_mini = P // t.mini_batches  # the old-policy pass: chunks of whole groups per shard
    k = max((d for d in range(1, micro + 1) if per_mini % d == 0 and (per_mini // d) % shards == 0), default=1)
    old_rows = P * G / (t.mini_batches * k) / shards
    heads, f_loc = H / tensor, F / tensor

    def keys(T: int) -> int:  # the key positions of a layer's score matrix held at once (model.attention)
        return min(mc.attention_block, T) if mc.attention == "blocked" else T

    def saved_at(T: int) -> float:  # a row's activations kept for the backward pass, per layer
        kept = 0 if mc.attention == "blocked" else heads * T * (4 + cb)  # the probabilities (blocked: recomputed)
        return {"none": T * (cb * (4 * D + 2 * KV * hd + 3 * f_loc) + kept),
                "block": T * cb * (3 * D + 2 * KV * hd + 2 * f_loc),
                "full": T * cb * D}[ov["model.remat"]]

    def backward(rows: float, T: int) -> float:  # one layer's working set of a backward pass
        return rows * (heads * T * keys(T) * (8 + cb) + T * f_loc * cb * 4 + T * D * 4 * 4)

    saved = saved_at(T)
    no_grad_forward = old_rows * (heads * T * keys(T) * (4 + cb) + T * f_loc * cb * 3 + T * D * 4 * 3)
    layer_work = max(backward(rows, T), no_grad_forward)
    head = rows * ov["stats.chunk"] * V / tensor * 4 * 5 + V * D * cb / tensor
    grads = trained * 4 * 4  # accumulator, a micro-batch's gradient, the optimizer's update temporaries
    per_token = P * G / shards * N * 4 * 24  # logp_old/ref, u, masks, statistics of the whole rollout batch
    gathered = 2 * _layer_params(mc) / tensor * cb
    step = (params + opt + ref + grads + rows * L * saved + layer_work + head + per_token + gathered
            + P * G / shards * T * 4 * 3)
    out = {"step": int(step)}
    for name, g in (("generate", G), ("eval", cfg.data.eval_n)):
        prompts = P / ov.get("rollout.chunks", 1) if name == "generate" else P  # generate's row chunking
        r = prompts * g / shards
        cache = 2 * L * r * KV / (tensor if KV % tensor == 0 else 1) * (Lp + N - 1) * hd * cb
        prefill = prompts / shards * (heads * Lp * (Lp + N) * (4 + cb) + Lp * (f_loc * cb * 3 + D * 4 * 3))
        out[name] = int(params + opt + ref + cache + prefill + r * V * 4 * 4 + gathered + V * D * cb)
    Ts, sft_rows = sft_len(cfg), t.sft_batch_size / shards  # one batch, no micro-batches
    sft_head = sft_rows * min(ov["stats.chunk"], Ts - 1) * V / tensor * 4 * 5 + V * D * cb / tensor
    out["sft"] = int(params + opt + grads + sft_rows * L * saved_at(Ts) + backward(sft_rows, Ts) + sft_head
                     + gathered + sft_rows * Ts * 4 * 3)
    return out


def nograd_passes(mini_batches: int, micro_batches: int) -> int:
    """The step's no-grad forwards of the policy (``rl.train_step``): none when fused (one mini-batch of
    one micro-batch), one with one mini-batch of several micro-batches (the old-policy pass is the
    statistics pass, ``StepPlan.shared_nograd``), else two (the old policy, then each mini-batch's
    statistics: counted once, as a whole batch's)."""
    if mini_batches * micro_batches == 1:
        return 0
    return 1 if mini_batches == 1 else 2


def step_flops(cfg: Config, mc: ModelConfig, ov: dict[str, Any]) -> float:
    """FLOPs of one step, analytically (``cost_analysis`` counts a loop body once): 2 x matmul
    parameters x tokens per forward, plus attention (4 T H hd a token a layer, the full T x T score
    matrix) and the vocabulary head over the response positions; a backward pass is twice a forward.
    Passes: the reference (kl_coef > 0), the old policy and the statistics pass (not fused; one pass
    with one mini-batch, :func:`nograd_passes`), the gradient pass with its remat recomputation."""
    P, G, Lp, N = cfg.train.prompts_per_step, cfg.rollout.num_samples, prompt_len(cfg), cfg.rollout.max_new_tokens
    T, B = Lp + N, P * G
    L, H, hd, D, V = mc.num_layers, mc.num_heads, mc.resolved_head_dim, mc.hidden_size, mc.vocab_size
    body = B * T * (2 * L * _layer_params(mc) + 4 * L * T * H * hd)
    head = B * N * 2 * D * V
    t = cfg.train
    fwd = body + head
    passes = (cfg.rl.loss.kl_coef > 0) + nograd_passes(t.mini_batches, ov["train.micro_batches"])
    grad = 3 * fwd + REMAT_EXTRA[ov["model.remat"]] * body
    return passes * fwd + grad


def estimate_seconds(cfg: Config, mc: ModelConfig, ov: dict[str, Any], target: Target) -> float:
    """Step time: FLOPs / (chips x peak x :data:`MFU`), plus the bytes a device moves over ICI / its ICI
    bandwidth (FSDP weight gathers per pass and micro-batch, the gradient reduce-scatter or
    all-reduce, tensor parallelism's two activation all-reduces a layer), plus :data:`LOOP_S` per
    loop iteration. Passes are counted as in :func:`step_flops`, the backward pass as two. Generate's
    row chunking (``rollout.chunks`` = c) adds c - 1 decode loops: N steps, each reading a chip's share
    of the weights gathered over fsdp (memory-bound) from HBM."""
    spec = chip_for(target.generation, target.device_kind) or _UNKNOWN_CHIP
    data, fsdp, tensor = _mesh_sizes(ov)
    compute = step_flops(cfg, mc, ov) / (target.chips * spec.peak_flops * MFU)
    n, t = mc.num_params(), cfg.train
    chunks = t.mini_batches * ov["train.micro_batches"]
    cb = 4 if mc.resolved_compute_dtype() == "float32" else 2
    passes = (cfg.rl.loss.kl_coef > 0) + nograd_passes(t.mini_batches, ov["train.micro_batches"]) + 2 + (
        ov["model.remat"] == "full")
    gather = 0.0 if fsdp == 1 else passes * chunks * n / tensor * cb * (fsdp - 1) / fsdp
    reduce = chunks * n / tensor * 4 * (data * fsdp - 1) / (data * fsdp) * (2 if fsdp == 1 else 1)
    P, G, N = t.prompts_per_step, cfg.rollout.num_samples, cfg.rollout.max_new_tokens
    tokens = P * G * (prompt_len(cfg) + N) / (data * fsdp)  # a device's rows x positions over the whole step
    activations = 0.0 if tensor == 1 else (passes + 1) * 2 * mc.num_layers * tokens * mc.hidden_size * cb * 2 * (
        tensor - 1) / tensor
    loops = (passes + 1) * chunks * (mc.num_layers + -(-N // ov["stats.chunk"]))
    decode = (ov.get("rollout.chunks", 1) - 1) * N * (n / tensor * cb / spec.hbm_bw + mc.num_layers * LOOP_S)
    return compute + (gather + reduce + activations) / spec.ici_bytes + loops * LOOP_S + decode


# ------------------------------------------------------------------------------------------------
# Candidates and search
# ------------------------------------------------------------------------------------------------
def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_settings(cfg: Config, mc: ModelConfig, chips: int) -> list[dict[str, Any]]:
    """Every (mesh, micro_batches, remat, chunk, rollout chunks) the recipe's geometry allows on ``chips``
    devices (``rl.train_step.check_batch_geometry``): a mini-batch holds whole groups per shard, a
    micro-batch (possibly part of a group) as many rows on every shard; tensor divides the heads and KV
    heads; chunk at most the response length; a generate call of P / rollout chunks prompts whole
    prompts on every shard."""
    t, N, G = cfg.train, cfg.rollout.max_new_tokens, cfg.rollout.num_samples
    per_mini = t.prompts_per_step // t.mini_batches
    out = []
    tensors = [k for k in _divisors(chips) if mc.num_kv_heads % k == 0 and mc.num_heads % k == 0]
    chunks = sorted({c for c in CHUNKS if c <= N} | ({N} if N < min(CHUNKS) else set()), reverse=True)
    for tensor in tensors:
        for fsdp in _divisors(chips // tensor):
            data = chips // tensor // fsdp
            shards = data * fsdp
            for micro in _divisors(per_mini * G):
                fused = t.mini_batches * micro == 1
                if (t.prompts_per_step if fused else per_mini) % shards or (per_mini * G // micro) % shards:
                    continue
                rollout_chunks = [c for c in ROLLOUT_CHUNKS if t.prompts_per_step % c == 0
                                  and (t.prompts_per_step // c) % shards == 0]
                for remat, chunk, rc in itertools.product(REMATS, chunks, rollout_chunks):
                    out.append({"mesh.data": data, "mesh.fsdp": fsdp, "mesh.tensor": tensor,
                                "train.micro_batches": micro, "model.remat": remat, "stats.chunk": chunk,
                                "rollout.chunks": rc})
    return out


def search(cfg: Config, target: Target, *, programs: Sequence[str] | None = None, max_compiles: int = 4,
           headroom: float = 0.05, log: Callable[[str], None] | None = None) -> FitResult:
    """The cheapest candidate (estimated step time) whose ``programs`` (default: those the run executes,
    ``aot.compile.run_programs``) all compile and leave ``headroom``
    (a fraction of the HBM) free on ``target``. Until a compile has missed, candidates estimated up to
    10% above that budget are compiled (the estimate errs both ways); after a miss, only those whose
    estimate, scaled by the largest measured / estimated ratio so far, is within the budget."""
    log = log or (lambda line: None)
    programs = run_programs(cfg) if programs is None else tuple(programs)
    sft = "sft" in programs
    if not 0 <= headroom < 1:
        raise ValueError(f"headroom {headroom}: must be in [0, 1)")
    mc0, source = target_model_config(cfg, target.platform)
    settings = candidate_settings(cfg, mc0, target.chips)
    budget = None if target.hbm_bytes is None else int(target.hbm_bytes * (1 - headroom))
    scored = []
    for ov in settings:
        mc = mc0.replace(remat=ov["model.remat"])
        mem = estimate_memory(cfg.replace(**{"stats.chunk": ov["stats.chunk"]}), mc, ov)
        scored.append(Candidate(ov, max(mem[p] for p in programs), estimate_seconds(cfg, mc, ov, target)))
    scored.sort(key=lambda c: (c.seconds, c.memory))
    log(f"--fit: {len(scored)} settings of (mesh, micro_batches, remat, stats.chunk, rollout.chunks) on "
        f"{target.name}; cheapest first, compiled to confirm (at most {max_compiles})")
    scale, slack, tried = 1.0, 1.1, []
    for cand in scored:
        if len(tried) >= max_compiles:
            break
        if budget is not None and cand.memory * scale > slack * budget:
            continue
        trial = cfg.replace(**cand.overrides)
        mc = mc0.replace(remat=cand.overrides["model.remat"])
        devices = target.devices
        mesh = make_mesh(*(cand.overrides[f"mesh.{a}"] for a in ("data", "fsdp", "tensor")), devices=devices)
        reports = []
        for program in build_programs(trial, mc, mesh, programs):
            rep = compile_program(program, target, mesh)
            reports.append(rep)
            if not rep.fits:
                break
        measured = max((r.live if r.compiled else (r.temporaries or 0) + r.expected_arguments + r.resident)
                       for r in reports)
        est = cand.memory
        ok = (all(r.fits for r in reports) and len(reports) == len(programs)
              and (budget is None or measured <= budget))
        tried.append({"overrides": cand.overrides, "estimated_memory": est, "estimated_seconds": cand.seconds,
                      "measured_memory": measured, "fits": ok,
                      "compile_s": round(sum(r.compile_s for r in reports), 1)})
        verdict = "fits" if ok else ("over the headroom" if all(r.fits for r in reports) else "does not fit")
        log(f"  tried {cand.line()}: estimated {fmt_bytes(est)}, compiled {fmt_bytes(measured)} "
            f"({verdict}), {sum(r.compile_s for r in reports):.0f} s")
        if ok:
            return FitResult(target.name, cand, tried, reports, dict(mesh.shape), source, len(scored), headroom,
                             cfg.model.lora.enabled, sft)
        if measured and est:  # the estimate was off: trust it less from here on
            scale, slack = max(scale, measured / est), 1.0
    return FitResult(target.name, None, tried, [], {}, source, len(scored), headroom, cfg.model.lora.enabled, sft)


def no_fit_hint(lora: bool, sft: bool = False) -> str:
    """What to change when no setting :func:`candidate_settings` varies fits (the pre-flight's refusal and
    ``--fit`` say it): the knobs it does not vary (with the SFT step among the programs, ``sft``, its batch
    too), and LoRA adapters unless the run (``lora``) has them."""
    return ("lower " + ("train.sft_batch_size, " if sft else "")
            + "train.prompts_per_step, rollout.num_samples or rollout.max_new_tokens"
            + ("" if lora else ", or train LoRA adapters (model.lora.enabled=true)"))


def format_fit(result: FitResult) -> str:
    if result.best is None:
        if not result.tried:  # every candidate's estimate was over the budget: nothing was worth compiling
            return (f"--fit: none of the {result.candidates} settings of micro_batches, remat, stats.chunk, "
                    f"rollout.chunks or the mesh is estimated to fit {result.target} with {result.headroom:.0%} "
                    f"headroom, so none was compiled; {no_fit_hint(result.lora, result.sft)}")
        return (f"--fit: none of the {len(result.tried)} settings compiled fits {result.target} with "
                f"{result.headroom:.0%} headroom; {no_fit_hint(result.lora, result.sft)}")
    b = result.best
    live = max(r.live for r in result.reports)
    return (f"--fit: the cheapest setting that fits {result.target} with {result.headroom:.0%} headroom: "
            f"{fmt_bytes(live)} live a device at most (estimated step {b.seconds:.1f} s at {MFU:.0%} of peak)\n"
            f"  {b.line()}")



def current_overrides(cfg: Config, mesh: dict[str, int]) -> dict[str, Any]:
    """The run's own values of the knobs :func:`candidate_settings` varies (``mesh``: its resolved shape)."""
    return {"mesh.data": mesh["data"], "mesh.fsdp": mesh["fsdp"], "mesh.tensor": mesh["tensor"],
            "train.micro_batches": cfg.train.micro_batches, "model.remat": cfg.model.remat,
            "stats.chunk": cfg.stats.chunk, "rollout.chunks": cfg.rollout.chunks}


def estimated_fit(cfg: Config, target: Target, mesh: dict[str, int], measured: dict[str, int],
                  allowance: int) -> Candidate | None:
    """Without compiling: the cheapest setting (:func:`candidate_settings`, by estimated step time) whose
    estimated memory fits ``allowance`` bytes a device, the estimates scaled by how far they were from
    ``measured`` (program -> compiled bytes a device at the run's own settings) so that the run's own
    setting is estimated at what it measured. None when no candidate is estimated to fit. The answer
    the memory pre-flight gives in seconds; ``ict-jax compile --fit`` confirms by compiling."""
    mc0, _ = target_model_config(cfg, target.platform)
    own = current_overrides(cfg, mesh)
    est = estimate_memory(cfg, mc0.replace(remat=cfg.model.remat), own)
    scale = max((measured[p] / est[p] for p in measured if est.get(p)), default=1.0)
    best = None
    for ov in candidate_settings(cfg, mc0, target.chips):
        if ov == own:
            continue
        mc = mc0.replace(remat=ov["model.remat"])
        mem = estimate_memory(cfg.replace(**{"stats.chunk": ov["stats.chunk"]}), mc, ov)
        need = max(mem[p] for p in measured) * scale
        if need > allowance:
            continue
        cand = Candidate(ov, int(need), estimate_seconds(cfg, mc, ov, target))
        if best is None or (cand.seconds, cand.memory) < (best.seconds, best.memory):
            best = cand
    return best


def changed(candidate: Candidate, cfg: Config, mesh: dict[str, int]) -> str:
    """The candidate's settings that differ from the run's: ``train.micro_batches=4 model.remat=full``."""
    own = current_overrides(cfg, mesh)
    return " ".join(f"{k}={v}" for k, v in candidate.overrides.items() if own.get(k) != v)
