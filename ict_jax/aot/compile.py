"""Compile, without running, the programs a training run uses: for a TPU slice (through libtpu, on any
machine) or for the local devices (docs/tpu.md).

A run compiles four programs (three without an SFT warm start), built by the run's own builder
(:func:`ict_jax.train.programs.build_programs`, which training calls too: what compile checks is what
training runs):

- ``sft``: the SFT step of the warm start (:func:`ict_jax.rl.sft.make_sft_step`), ``train.sft_batch_size``
  rows of ``rollout.max_prompt_len + max_new_tokens`` tokens, with the SFT optimizer's state (the only
  optimizer state alive during the warm start); compiled by default when ``train.sft_steps > 0``
  (:func:`run_programs`);
- ``step``: :func:`ict_jax.rl.train_step.make_train_step` at the recipe's batch geometry
  (P x G rows, the largest prompt bucket + ``max_new_tokens``), with the reference parameters when
  ``kl_coef > 0``; by default its largest response bucket (``max_new_tokens``: the memory a run needs),
  any other with ``response_len`` (a run compiles one step per bucket it meets, docs/loss.md);
- ``generate``: the rollout sampler (:func:`ict_jax.sampling.sampler.make_generate_fn`) at P prompts x
  G samples with its KV cache (P / ``rollout.chunks`` prompts a call when the rollout is chunked);
- ``eval``: the evaluation sampler (P prompts x ``data.eval_n`` samples, the evaluation temperature
  and top-p).

Every argument is an abstract ``jax.ShapeDtypeStruct`` carrying the sharding the run would give it
(the rule table on the recipe's mesh): nothing is allocated. ``Compiled.memory_analysis()`` gives the
per-chip bytes; the compiled HLO gives the collectives and the memory-discipline checks
(:func:`discipline_checks`). A TPU program that does not fit fails to compile with
``RESOURCE_EXHAUSTED``; the report keeps the compiler's numbers.

The model comes from the run's model source (``train.model_source.resolve_model``, as training's), with
``compute_dtype: auto`` resolved for the target (bfloat16 on TPU and GPU, float32 on CPU), not for the
machine that compiles.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import math
import os
import re
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.compilation_cache import compilation_cache
from jax.sharding import NamedSharding, PartitionSpec

from ict_jax.aot import hlo, roofline
from ict_jax.aot.breakdown import breakdown
from ict_jax.aot.chips import chip_for
from ict_jax.config import Config, ConfigError, parse_topology
from ict_jax.install import install_line
from ict_jax.memory import fmt_bytes
from ict_jax.model.config import ModelConfig
from ict_jax.platform import accelerator_type, tpu_chips_present
from ict_jax.rl.token_stats import block_size
from ict_jax.rl.train_step import StepPlan, old_pass_chunks
from ict_jax.sampling.sampler import cache_chunks, decode_steps
from ict_jax.sharding import make_mesh
from ict_jax.train.checkpoints import abstract_train_state
from ict_jax.train.model_source import resolve_model
from ict_jax.train.preflight import SAMPLERS, MachineBudget, machine_budget, program_memory, resident_bytes
from ict_jax.train.programs import (
    PLACEHOLDER_IDS,
    PROGRAM_NAMES,
    Optimizers,
    TokenIds,
    kv_cache_dtype,
    per_device_bytes,
    prompt_len,
    sampler_fn,
    sampler_prompts,
    sft_len,
)
from ict_jax.train.programs import build_programs as build_run_programs

#: Every program a run may compile, in the order a run executes them (``train.programs``); a run of a config
#: compiles :func:`run_programs`.
PROGRAMS = PROGRAM_NAMES
TPU_EXTRA = install_line("tpu")
GIB = 1024 ** 3


class TpuUnavailable(ValueError):
    """Compiling for a TPU topology needs libtpu (the ``tpu`` extra)."""


# ------------------------------------------------------------------------------------------------
# Targets
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Target:
    """The devices a program is compiled for: a TPU topology (abstract devices) or the local ones."""

    name: str  # "v5e:2x4", ... or "local"
    platform: str  # "tpu", "cpu", "gpu"
    devices: tuple[Any, ...]
    device_kind: str
    hbm_bytes: int | None  # per device: what a program may use (local CPU: the host's share); None = unknown
    generation: str | None = None  # "v5e", ... for TPU topologies
    budget: MachineBudget | None = None  # local devices: how hbm_bytes was found (train.preflight)

    @property
    def chips(self) -> int:
        return len(self.devices)


_HBM_CACHE: dict[str, int | None] = {}
_AVAILABLE = re.compile(r"exceeds available HBM \(([\d.]+)([KMGT])\)")
_TEMPS = re.compile(r"HLO temporaries \(([\d.]+)([KMGT])\)")
_UNIT = {"K": 1024, "M": 1024 ** 2, "G": 1024 ** 3, "T": 1024 ** 4}


def _size(m: re.Match | None) -> int | None:
    return None if m is None else int(float(m.group(1)) * _UNIT[m.group(2)])


def hbm_bytes(devices: Sequence[Any]) -> int | None:
    """Per-device memory the compiler lets a program use. Local devices: ``memory_stats()``'s
    ``bytes_limit`` (None on CPU). Abstract TPU devices have no memory stats: a tiny program that
    asks for 1 TiB of temporaries is compiled, and the compiler's RESOURCE_EXHAUSTED message names
    the available HBM (cached per device kind; well under a second)."""
    dev = devices[0]
    kind = f"{dev.platform}:{dev.device_kind}"
    if kind in _HBM_CACHE:
        return _HBM_CACHE[kind]
    limit = None
    try:
        stats = dev.memory_stats()
        limit = int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None
    except Exception:  # noqa: BLE001 - compile-only devices raise; probe the compiler below
        stats = None
    if limit is None and dev.platform == "tpu":
        mesh = jax.sharding.Mesh(np.asarray([dev]), ("x",))
        x = jax.ShapeDtypeStruct((1 << 20,), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec()))
        probe = jax.jit(lambda a: jnp.sort(a[:, None] * jnp.arange(1 << 18, dtype=jnp.float32)[None, :], axis=0),
                        out_shardings=NamedSharding(mesh, PartitionSpec()))
        try:
            with without_persistent_cache(True):
                probe.lower(x).compile()
        except Exception as e:  # noqa: BLE001 - the expected RESOURCE_EXHAUSTED carries the number
            limit = _size(_AVAILABLE.search(str(e)))
    _HBM_CACHE[kind] = limit
    return limit


def get_target(name: str | None) -> Target:
    """``name``: a TPU topology (``v5e:2x4``, ``v5p:2x2x1``, ...; needs libtpu, see :data:`TPU_EXTRA`)
    or ``None`` / ``"local"`` for this machine's devices. Raises ValueError (one line) for an unknown
    topology and :class:`TpuUnavailable` without libtpu."""
    if name in (None, "local"):
        devs = tuple(jax.devices())
        machine = machine_budget(devs)  # the memory pre-flight's budget: the same numbers as training's
        limit = machine.per_device if machine is not None else hbm_bytes(devs)
        return Target("local", devs[0].platform, devs, devs[0].device_kind, limit, budget=machine)
    try:
        gen, dims = parse_topology(name)
    except ConfigError as e:
        raise ValueError(f"--topology: {e}") from None
    if importlib.util.find_spec("libtpu") is None:
        raise TpuUnavailable(f"compiling for the TPU topology {name!r} needs libtpu: {TPU_EXTRA}")
    # libtpu takes a machine-wide lock file when it loads; compiling touches no chip, so several
    # compiling processes (a test suite beside a --fit search) may share it
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    if not tpu_chips_present() and not {"TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES"} & set(os.environ):
        # off a TPU VM libtpu looks for its slice in these variables and prints five lines of warnings
        # when they are unset; name the slice being compiled for and this host (compiling only)
        os.environ["TPU_ACCELERATOR_TYPE"] = accelerator_type(gen, math.prod(dims))
        os.environ["TPU_WORKER_HOSTNAMES"] = "localhost"
    try:  # topology_devices imports jax.experimental.topologies here: it loads the TPU compiler plugin
        devs = tuple(topology_devices(name, dims))
    except Exception as e:  # noqa: BLE001 - libtpu rejects the name: its message, one line
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"--topology {name!r}: libtpu does not accept it: {msg}") from None
    return Target(name, "tpu", devs, devs[0].device_kind, hbm_bytes(devs), gen)


_HOST_BOUNDS = "not divisible by the given (or default) chips_per_host_bounds"


def topology_devices(name: str, dims: Sequence[int]) -> list[Any]:
    """The abstract devices of the TPU topology ``name`` (its chip grid ``dims``). libtpu lays a topology
    out over hosts of 2x2x1 chips by default and rejects a smaller one (``v5p:1x1x1``, ``v5e:1x1``: "not
    divisible by ... chips_per_host_bounds"); such a slice is one host holding all its chips, so it is
    asked for again with ``chips_per_host_bounds`` = its own grid."""
    from jax.experimental import topologies

    try:
        return topologies.get_topology_desc(platform="tpu", topology_name=name).devices
    except Exception as e:  # noqa: BLE001 - libtpu's INVALID_ARGUMENT
        if _HOST_BOUNDS not in str(e):
            raise
    bounds = list(dims) + [1] * (3 - len(dims))
    return topologies.get_topology_desc(platform="tpu", topology_name=name, chips_per_host_bounds=bounds).devices


def with_run_budget(target: Target, cfg: Config) -> Target:
    """A local CPU target's budget as the pre-flight of a run of ``cfg`` reads it: its reward worker
    processes (``rl.reward.workers``) share the host's memory. Other targets unchanged."""
    if target.budget is None or target.platform != "cpu":
        return target
    machine = machine_budget(target.devices, reward_workers=cfg.rl.reward.workers)
    return dataclasses.replace(target, hbm_bytes=machine.per_device, budget=machine)


# ------------------------------------------------------------------------------------------------
# The run's shapes
# ------------------------------------------------------------------------------------------------
def target_model_config(cfg: Config, platform: str) -> tuple[ModelConfig, str]:
    """(the model's architecture for ``cfg`` compiled on ``platform``, where it came from), from the model
    source (:func:`ict_jax.train.model_source.resolve_model`, the one training builds from).

    ``model.path``, when it is a local Hugging Face directory or a ``.gguf`` file, gives the
    architecture; otherwise ``model.preset`` does (the recipes name a placeholder path), sized to the
    run's tokenizer as training sizes it. ``auto`` compute dtype and attention resolve for the target platform. With
    ``model.lora.enabled`` it carries the adapters: the train state is then the adapters and the frozen
    base."""
    source = resolve_model(cfg, platform=platform, missing="preset")
    mc = source.config
    where = f"checkpoint {source.path}" if source.kind != "preset" else source.where
    if mc.lora is not None:
        where += (f"; LoRA rank {mc.lora.rank} on {', '.join(mc.lora.targets)} ({mc.num_adapter_params():,} "
                  "adapter parameters train, the base is frozen)")
    return mc, where


def run_token_ids(cfg: Config) -> TokenIds:
    """The EOS and pad ids of the run's tokenizer (:func:`~ict_jax.train.model_source.resolve_model`), or
    placeholders when it is not on this machine (a recipe's): constants of the samplers that change
    neither their memory nor their collectives."""
    try:
        return TokenIds.of(resolve_model(cfg).tokenizer())
    except (OSError, ValueError):
        return PLACEHOLDER_IDS


def run_mesh(cfg: Config, target: Target) -> jax.sharding.Mesh:
    """The recipe's ``(data, fsdp, tensor)`` mesh over the target's devices (ValueError, one line, when
    it does not divide them)."""
    m = cfg.mesh
    try:
        return make_mesh(m.data, m.fsdp, m.tensor, devices=target.devices)
    except ValueError as e:
        raise ValueError(f"mesh data={m.data}, fsdp={m.fsdp}, tensor={m.tensor} on {target.name} "
                         f"({target.chips} devices): {e}") from None


def _stacked_sizes(params: Any, num_layers: int, hidden: int) -> set[int]:
    """Element counts of the weight matrices stacked on a leading ``layers`` axis (per layer more than
    ``hidden`` elements: norms and biases, a few KiB, are left out)."""
    return {int(np.prod(a.shape)) for a in jax.tree.leaves(params)
            if a.ndim >= 3 and a.shape[0] == num_layers and np.prod(a.shape[1:]) > hidden}


@dataclasses.dataclass
class CompileJob:
    """One program of a run to compile and check: ``lower()`` -> ``jax.stages.Lowered`` (the run's own
    program, ``train.programs``), with what the report and the discipline checks need."""

    name: str
    lower: Callable[[], Any]
    resident: int  # per-device bytes of the run's arrays alive during it that are not its arguments
    expected_args: int  # per-device bytes of its arguments, from their shardings
    info: dict[str, Any]  # shapes the discipline checks need


def run_programs(cfg: Config) -> tuple[str, ...]:
    """The programs ``ict-jax compile`` compiles for a run of ``cfg`` by default: the SFT step when the run
    has SFT steps (``train.sft_steps > 0``), then the train step and the two samplers."""
    return (("sft",) if cfg.train.sft_steps > 0 else ()) + ("step", "generate", "eval")


def build_programs(cfg: Config, mc: ModelConfig, mesh: jax.sharding.Mesh,
                   names: Sequence[str] = PROGRAMS, response_len: int | None = None) -> list[CompileJob]:
    """The named programs of a run of ``cfg`` on ``mesh``, built by the run's own builder
    (:func:`ict_jax.train.programs.build_programs`) from an abstract train state. ``response_len``: the
    response bucket the step is built at (default ``rollout.max_new_tokens``, the largest)."""
    unknown = [n for n in names if n not in PROGRAMS]
    if unknown:
        raise ValueError(f"unknown program {unknown[0]!r}; known: {', '.join(PROGRAMS)}")
    optimizers = Optimizers.of(cfg)
    state = abstract_train_state(cfg, mc, mesh=mesh, tx=optimizers.rl)
    ids = run_token_ids(cfg)
    run = build_run_programs(cfg, mesh, mc, state, ids, optimizers=optimizers)
    platform = mesh.devices.flat[0].platform
    ref = run.step.abstract()[2]
    state_bytes = {"params": per_device_bytes(state.params), "opt_state": per_device_bytes(state.opt_state),
                   "ref": per_device_bytes(ref) if ref is not None else 0,
                   "frozen": per_device_bytes(state.frozen) if state.frozen is not None else 0}  # a LoRA base
    batch_shards = mesh.shape["data"] * mesh.shape["fsdp"]
    P, G, Lp, N = cfg.train.prompts_per_step, cfg.rollout.num_samples, prompt_len(cfg), cfg.rollout.max_new_tokens
    bucket = N if response_len is None else int(response_len)  # the step's response bucket
    if not 1 <= bucket <= N:
        raise ValueError(f"response_len {bucket}: the step's response bucket is 1..rollout.max_new_tokens={N}")
    # rows a pass processes at once: a gradient micro-batch, or a chunk of the old-policy pass (whole groups)
    plan = StepPlan.from_config(cfg, optimizers.rl, batch_shards=batch_shards)
    pass_rows = P * G // old_pass_chunks(plan, P)  # at least a micro-batch's rows
    # element counts of the stacked [layers, ...] weights, whole or with the tensor axis still split
    stacked = {n // d for n in _stacked_sizes(state.model_state(), mc.num_layers, mc.hidden_size)
               for d in (1, mesh.shape["tensor"])}
    common = dict(num_layers=mc.num_layers, vocab=mc.vocab_size, hidden=mc.hidden_size, devices=mesh.size,
                  stacked=stacked, state_bytes=state_bytes,
                  batch_shards=batch_shards, tensor=mesh.shape["tensor"], prompt_len=Lp, new_tokens=N)
    kv_bytes = jnp.dtype(kv_cache_dtype(cfg) or mc.resolved_compute_dtype(platform)).itemsize
    n_params, tensor = mc.num_params(), mesh.shape["tensor"]
    out = []
    for name in names:
        program = run.by_name()[name]
        args = program.abstract()
        if name == "step":
            shape = run.step_shape(bucket)
            tokens = P * G * (Lp + bucket)
            info = dict(common, rows=pass_rows // batch_shards, positions=bucket,
                        block=block_size(bucket, cfg.stats.chunk), tokens=tokens, model_flops=6.0 * n_params * tokens)
            out.append(CompileJob(name, functools.partial(program.lower, shape), 0, per_device_bytes(args), info))
            continue
        if name == "sft":  # one batch, no micro-batches; the log-probs of every position after the first
            positions = sft_len(cfg) - 1
            tokens = cfg.train.sft_batch_size * sft_len(cfg)
            info = dict(common, rows=cfg.train.sft_batch_size // batch_shards, positions=positions,
                        block=block_size(positions, cfg.stats.chunk), tokens=tokens,
                        model_flops=6.0 * n_params * tokens)
            out.append(CompileJob(name, program.lower, 0, per_device_bytes(args), info))
            continue
        rows = sampler_prompts(name, cfg) * (cfg.data.eval_n if name == "eval" else G)
        # the sampler says how it holds its KV cache (chunks of an unrolled, phased decode) for its settings
        settings = sampler_fn(name, cfg, state.graphdef, mesh, ids, platform).settings
        kv_local = mc.num_kv_heads // tensor if mc.num_kv_heads % tensor == 0 else mc.num_kv_heads
        # what a decode step must read at least: the weights in the compute dtype (all of them: FSDP
        # gathers them; the head, not the embedding table, of an untied model) and the filled KV cache
        weights = (n_params - (0 if mc.tie_word_embeddings else mc.vocab_size * mc.hidden_size)) / tensor
        compute_bytes = jnp.dtype(mc.resolved_compute_dtype(platform)).itemsize
        kv_read = 2 * mc.num_layers * rows // batch_shards * kv_local * (Lp + N - 1) * mc.resolved_head_dim * kv_bytes
        info = dict(common, rows=rows // batch_shards, positions=N, block=1, cache_slots=Lp + N - 1,
                    cache_chunks=cache_chunks(settings, mc.num_layers, Lp, backend=platform),
                    kv_heads=mc.num_kv_heads, head_dim=mc.resolved_head_dim, kv_bytes=kv_bytes,
                    tokens=rows * N, model_flops=2.0 * n_params * rows * N,
                    decode_steps=decode_steps(N, settings.min_response_bucket),
                    decode_min_bytes=weights * compute_bytes + kv_read)
        out.append(CompileJob(name, program.lower, resident_bytes(run, name), per_device_bytes(args), info))
    return out


# ------------------------------------------------------------------------------------------------
# Compiling and reporting
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Check:
    """One memory-discipline check of a compiled program (docs/tpu.md)."""

    name: str
    ok: bool
    detail: str


@dataclasses.dataclass
class ProgramReport:
    """Per-device memory (bytes), fit, compile time, collectives and checks of one compiled program."""

    program: str
    target: str
    mesh: dict[str, int]
    compiled: bool
    fits: bool
    hbm: int | None
    arguments: int | None = None
    temporaries: int | None = None
    outputs: int | None = None
    aliased: int | None = None
    code: int | None = None
    resident: int = 0
    expected_arguments: int = 0
    positions: int | None = None  # response positions: the step's bucket, the samplers' max_new_tokens
    lower_s: float = 0.0
    compile_s: float = 0.0
    error: str | None = None
    collectives: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    unknown_loops: int = 0
    checks: list[Check] = dataclasses.field(default_factory=list)
    roofline: roofline.Roofline | None = None  # counted from the compiled HLO (docs/tpu.md "Roofline")
    # the roofline's bytes and FLOPs by category (aot.breakdown): {category: {"bytes": b, "flops": f}}
    breakdown: dict[str, dict[str, float]] | None = None
    note: str | None = None  # a decision the compile made as the run would (rollout.gather_weights auto)

    @property
    def live(self) -> int | None:
        """Peak per-device bytes: arguments + outputs - aliased + temporaries + code, plus the run's
        other resident arrays (``resident``)."""
        if not self.compiled:
            return None
        return (self.arguments + self.outputs - self.aliased + self.temporaries + self.code + self.resident)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["live"] = self.live
        d["roofline"] = None if self.roofline is None else self.roofline.to_dict()
        return d


def _gathers(items: list[hlo.Collective], op: str = "all-gather") -> list[hlo.Collective]:
    return [c for c in items if c.op == op]


def discipline_checks(program: CompileJob, module: hlo.HloModule, items: list[hlo.Collective],
                      arguments: int) -> list[Check]:
    """docs/tpu.md "Memory discipline" on one compiled program:

    - ``arguments``: the program's per-device parameters hold exactly the bytes of the inputs' shards
      (so the parameters, the optimizer state and the reference are held 1/fsdp a device);
    - ``no [rows, T, V]``: no array with a vocabulary dimension (the embedding, the unembedding and
      their gradients aside) holds more vocabulary rows than one block of the statistics,
      ``[rows, stats.chunk positions, V]`` (step, sft), or one decode step's ``[rows, V]`` (samplers):
      the dense logits of a batch's positions never exist;
    - ``layer-wise gathers`` (step, sft): no all-gather returns a stacked ``[layers, ...]`` weight: FSDP
      gathers one layer at a time inside the layer scan; the largest all-gather is at most the
      embedding or one layer's weights;
    - ``kv cache`` (generate, eval): an array of the expected per-device cache shape
      ``[layers, rows, kv_heads, slots, head_dim]`` is in the program, or one layer's
      ``[rows, kv_heads, slots, head_dim]`` where the compiler unrolled the layer loop.
    """
    i = program.info
    taken = sum(a.bytes for a in hlo.entry_parameters(module))
    checks = [Check("arguments", taken == program.expected_args,
                    f"{fmt_bytes(taken)} of parameters a device ({fmt_bytes(arguments)} with layout padding) vs "
                    f"{fmt_bytes(program.expected_args)} from the shardings")]
    V, D = i["vocab"], i["hidden"]
    widths = {V, V // i["tensor"] if V % i["tensor"] == 0 else V}  # whole, or split over the tensor axis
    shards = {D // k for k in range(1, i["devices"] + 1) if D % k == 0 and i["devices"] % k == 0}

    def vocab_rows(a: hlo.Array) -> int:  # the array as [vocabulary rows, V]
        return a.elements // max(w for w in widths if w in a.dims)

    def weight(a: hlo.Array) -> bool:  # the (un)embedding or its gradient: [V, D] or a shard, maybe reshaped
        return vocab_rows(a) in shards

    hits = [a for w in widths for a, _, _ in hlo.arrays_with_dim(module, w) if not weight(a)]
    biggest = max(hits, key=vocab_rows, default=None)
    n = vocab_rows(biggest) if biggest is not None else 0
    block = i["block"]  # positions a statistics block holds (1: a decode step)
    what = (f"a statistics block [{i['rows']} rows x {block} positions]" if block > 1
            else f"one decode step's [{i['rows']} rows]")
    dense = f"; stats.chunk covers all {i['positions']} positions" if block >= i["positions"] else ""
    checks.append(Check("no [rows, T, V]", n <= i["rows"] * block,
                        f"largest vocabulary-wide array (weights aside) {biggest if biggest is not None else '-'}: "
                        f"{n:,} vocabulary rows; at most {what} = {i['rows'] * block:,}{dense}"))
    if program.name in ("step", "sft"):
        L = i["num_layers"]
        # a gather that runs inside a layer loop (a while of L trips) is one layer's, whatever its shape (a tiny
        # model's one-layer [4, 16, 64] may be laid out as [2, 2, 16, 64] beside a stacked [2, 64, 2, 16])
        per_layer = _inside_loops(module, L)
        stacked = [c for c in _gathers(items) if c.result.dims[:1] == (L,) and c.result.elements in i["stacked"]
                   and c.computation not in per_layer]
        largest = max((c.bytes for c in _gathers(items)), default=0)
        checks.append(Check("layer-wise gathers", not stacked,
                            f"{len(stacked)} all-gathers of stacked [{L}, ...] weights"
                            + (f" (e.g. {stacked[0].result})" if stacked else "")
                            + f"; largest all-gather {fmt_bytes(largest)}"))
    else:
        rows, heads = i["rows"], i["kv_heads"]
        kv_local = heads // i["tensor"] if heads % i["tensor"] == 0 else heads
        want = (i["num_layers"], rows, kv_local, i["cache_slots"], i["head_dim"])
        dims = {a.dims for _, ins in module.instructions() for a in ins.arrays}
        # the stacked cache, or one layer's (a compiler that unrolls the layer loop splits the stack), or
        # one layer's chunks (the unrolled decode phases)
        chunks = [want[1:3] + (n, want[4]) for n in i.get("cache_chunks") or ()]
        found = want in dims or want[1:] in dims or bool(chunks and all(c in dims for c in chunks))
        size = int(np.prod(want)) * i["kv_bytes"]
        where = ("" if want in dims else ": one layer's [rows, kv_heads, slots, head_dim] in the program"
                 if want[1:] in dims else f": one layer's in chunks of {', '.join(str(c[2]) for c in chunks)} slots, "
                 "one a decode phase" if found else ": no array of that shape in the program")
        checks.append(Check("kv cache", found, f"[{', '.join(map(str, want))}] x 2 (k, v) = {fmt_bytes(2 * size)} "
                            f"a device{where}"))
    return checks


def _inside_loops(module: hlo.HloModule, trips: int) -> set[str]:
    """The computations that run inside a ``while`` loop of ``trips`` iterations (its body and what it
    calls, nested loops included)."""
    inside: set[str] = set()
    todo = [hlo.called(ins, "body") for _, ins in module.instructions()
            if ins.opcode == "while" and hlo.trip_count(module, ins) == trips]
    while todo:
        comp = todo.pop()
        if comp is None or comp in inside or comp not in module.computations:
            continue
        inside.add(comp)
        todo += [callee for ins in module.computations[comp] for _, callee in hlo.callees(module, ins)]
    return inside


@contextlib.contextmanager
def without_persistent_cache(off: bool):
    """The persistent compilation cache cannot serve programs compiled for a topology's abstract devices
    (reading an entry warns "PjRtCompiler must be constructed with a Client", docs/tpu.md): off for
    those compiles, restored after."""
    if not off:
        yield
        return
    was = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()  # JAX decides once whether the cache is used; decide again
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", was)
        compilation_cache.reset_cache()


def compile_program(program: CompileJob, target: Target, mesh: jax.sharding.Mesh, *, analyse: bool = True,
                    dump_dir: str | Path | None = None) -> ProgramReport:
    """Lower and compile one program; a program that does not fit gives ``compiled=False`` with the
    compiler's message and numbers (``temporaries`` from RESOURCE_EXHAUSTED when it names them).
    ``dump_dir``: write the compiled HLO text to ``<dump_dir>/<program>.hlo.txt``."""
    rep = ProgramReport(program=program.name, target=target.name, mesh=dict(mesh.shape), compiled=False,
                        fits=False, hbm=target.hbm_bytes, resident=program.resident,
                        expected_arguments=program.expected_args, positions=program.info.get("positions"))
    t0 = time.perf_counter()
    lowered = program.lower()
    rep.lower_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    try:
        with without_persistent_cache(target.generation is not None):
            compiled = lowered.compile()
    except Exception as e:  # only an out-of-memory failure is a result; anything else re-raises
        rep.compile_s = time.perf_counter() - t0
        text = str(e)
        if "RESOURCE_EXHAUSTED" not in text:
            raise
        rep.error = next((line for line in text.splitlines() if "RESOURCE_EXHAUSTED" in line), text.splitlines()[0])
        rep.temporaries = _size(_TEMPS.search(text))
        rep.hbm = _size(_AVAILABLE.search(text)) or rep.hbm
        return rep
    rep.compile_s = time.perf_counter() - t0
    rep.compiled = True
    mem = program_memory(program.name, compiled)
    rep.arguments, rep.temporaries, rep.outputs = mem.arguments, mem.temporaries, mem.outputs
    rep.aliased, rep.code = mem.aliased, mem.code
    rep.fits = rep.hbm is None or rep.live <= rep.hbm
    text = compiled.as_text() if (analyse or dump_dir) else ""
    if dump_dir is not None:
        Path(dump_dir).mkdir(parents=True, exist_ok=True)
        (Path(dump_dir) / f"{program.name}.hlo.txt").write_text(text)
    if analyse:
        module = hlo.parse_hlo(text)
        mult, rep.unknown_loops = hlo.multiplicity(module)
        items = hlo.collectives(module, mult)
        rep.collectives = hlo.summarize_collectives(items)
        rep.checks = discipline_checks(program, module, items, rep.arguments)
        i = program.info
        rep.roofline = roofline.estimate(module, chip_for(target.generation, target.device_kind), chips=mesh.size,
                                         model_flops=i.get("model_flops"), tokens=i.get("tokens"),
                                         training=program.name in ("step", "sft"),
                                         decode_steps=i.get("decode_steps"),
                                         decode_min_bytes=i.get("decode_min_bytes"))
        rep.breakdown = {k: {"bytes": c.bytes, "flops": c.flops} for k, c in breakdown(module, text, mult).items()}
    return rep


def gathering_decided(cfg: Config, mesh: jax.sharding.Mesh, name: str) -> bool:
    """Whether program ``name`` is a sampler whose ``rollout.gather_weights: auto`` a run decides by its fit:
    on an FSDP mesh, built without gathering when the gathered one does not fit
    (:func:`ict_jax.train.preflight.compile_and_check_gathering`)."""
    return name in SAMPLERS and cfg.rollout.gather_weights == "auto" and mesh.shape["fsdp"] > 1


def compile_run(cfg: Config, target: Target, programs: Sequence[str] | None = None, *,
                on_report: Callable[[ProgramReport], None] | None = None, analyse: bool = True,
                dump_dir: str | Path | None = None, on_start: Callable[[str], None] | None = None,
                response_len: int | None = None) -> tuple[list[ProgramReport], str]:
    """Compile ``programs`` (default :func:`run_programs`) of a run of ``cfg`` for ``target`` -> (reports,
    the model's source).
    ``on_start(name)`` is called as each program starts, ``on_report(report)`` as it ends (progress).
    ``response_len``: the step's response bucket (default the largest, ``rollout.max_new_tokens``)."""
    mc, source = target_model_config(cfg, target.platform)
    mesh = run_mesh(cfg, target)
    reports = []
    for program in build_programs(cfg, mc, mesh, run_programs(cfg) if programs is None else programs, response_len):
        if on_start is not None:
            on_start(program.name)
        rep = compile_program(program, target, mesh, analyse=analyse, dump_dir=dump_dir)
        if not rep.fits and gathering_decided(cfg, mesh, program.name):  # as the run's pre-flight decides
            first = (f"{fmt_bytes(rep.live)} live a device" if rep.compiled else
                     f"{fmt_bytes(rep.temporaries) + ' of temporaries' if rep.temporaries else 'out of memory'}"
                     ) + f" > {fmt_bytes(rep.hbm)}"
            off = cfg.replace(**{"rollout.gather_weights": False})
            (again,) = build_programs(off, mc, mesh, [program.name], response_len)
            rep = compile_program(again, target, mesh, analyse=analyse, dump_dir=dump_dir)
            rep.note = f"rollout.gather_weights auto: off, since gathering the weights does not fit ({first})"
        reports.append(rep)
        if on_report is not None:
            on_report(rep)
    return reports, source
