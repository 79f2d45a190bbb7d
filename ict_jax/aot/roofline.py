"""A roofline estimate of one compiled program from its own HLO (docs/tpu.md "Roofline").

Per device and per run of the program: the matmul FLOPs and the bytes accessed counted from the
compiled, partitioned HLO with every loop's trip count multiplied in (:func:`ict_jax.aot.cost.cost`;
``compiled.cost_analysis()`` counts a loop body once), the samplers' data-dependent decode loops counted
at their full length (every row generates ``max_new_tokens``: the worst case), then

- ``compute_s = flops / peak`` and ``memory_s = bytes / HBM bandwidth`` (the chip's figures,
  :mod:`ict_jax.aot.chips`), ``bound_s = max`` of the two: no run of the program on that chip is faster;
- the model's own FLOPs (``6 N tokens`` for a training step, ``2 N tokens`` for a sampler; N = the
  model's parameters, tokens = the rows x positions it processes) and, for a training step, the MFU
  ceiling ``6 N tokens / (chips x peak x bound_s)``: what the step could reach if it ran at the bound;
- for a sampler, the bytes of one decode step of its last (largest) phase against what a step must read
  at least: the weights in the compute dtype and the KV cache's filled slots (``decode_ratio``), and the
  tokens/s ceiling ``rows x new tokens / bound_s``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from ict_jax.aot import cost, hlo
from ict_jax.aot.chips import Chip


@dataclasses.dataclass
class Roofline:
    """A program's counts and bounds, per device per run (a sampler: every row to ``max_new_tokens``)."""

    flops: float  # matmul FLOPs counted from the HLO
    bytes: float  # bytes accessed counted from the HLO
    chip: str | None = None  # the chip whose figures give the times (None: not in the table, e.g. a CPU)
    compute_s: float | None = None
    memory_s: float | None = None
    bound_s: float | None = None
    bound: str | None = None  # "compute" or "memory"
    model_flops: float | None = None  # 6 N tokens (training) or 2 N tokens (samplers), per device
    mfu_ceiling: float | None = None  # training programs: model_flops / (peak x bound_s)
    tokens: int | None = None  # tokens the program processes (all devices)
    tokens_per_s: float | None = None  # tokens / bound_s
    decode_steps: tuple[int, ...] | None = None  # samplers: decode steps assumed per phase
    unknown_loops: int = 0  # data-dependent loops that could not be given a trip count (counted once)
    decode_step_bytes: float | None = None  # bytes of one decode step (last phase), per device
    decode_min_bytes: float | None = None  # weights (compute dtype) + the KV cache a step reads, per device

    @property
    def decode_ratio(self) -> float | None:
        if not self.decode_step_bytes or not self.decode_min_bytes:
            return None
        return self.decode_step_bytes / self.decode_min_bytes

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["decode_ratio"] = self.decode_ratio
        return d


def decode_step_multiplicity(module: hlo.HloModule) -> dict[str, int] | None:
    """How often each computation runs in one iteration of the program's last data-dependent loop (a
    sampler's last decode phase: its largest KV window), everything that iteration calls included;
    None without one."""
    loops = hlo.data_dependent_loops(module)
    body = hlo.called(loops[-1]) if loops else None
    return None if body is None else hlo.multiplicity(module, root=body)[0]


def decode_step_cost(module: hlo.HloModule) -> cost.Cost | None:
    """The cost of one decode step (:func:`decode_step_multiplicity`); None without a decode loop."""
    mult = decode_step_multiplicity(module)
    return None if mult is None else cost.cost(module, mult)


def estimate(module: hlo.HloModule, chip: Chip | None, *, chips: int, model_flops: float | None = None,
             tokens: int | None = None, training: bool = False, decode_steps: Sequence[int] | None = None,
             decode_min_bytes: float | None = None) -> Roofline:
    """The roofline of a compiled program (``module``, per device) on ``chips`` devices of ``chip``.
    ``model_flops`` (all devices) and ``tokens``: what the program computes for the model (training
    programs: ``6 N tokens``; samplers ``2 N tokens``); ``decode_steps``: the decode steps of each phase
    of a sampler (assumed trip counts of its data-dependent loops, in program order);
    ``decode_min_bytes``: the bytes a decode step must read at least, per device."""
    mult, unknown = hlo.multiplicity(module, trips=decode_steps)
    c = cost.cost(module, mult)
    r = Roofline(flops=c.flops, bytes=c.bytes, unknown_loops=unknown, tokens=tokens,
                 decode_steps=tuple(decode_steps) if decode_steps is not None else None,
                 model_flops=None if model_flops is None else model_flops / chips)
    if decode_steps is not None:
        step = decode_step_cost(module)
        r.decode_step_bytes = None if step is None else step.bytes
        r.decode_min_bytes = decode_min_bytes
    if chip is not None:
        r.chip = chip.name
        r.compute_s, r.memory_s = c.flops / chip.peak_flops, c.bytes / chip.hbm_bw
        r.bound_s = max(r.compute_s, r.memory_s)
        r.bound = "compute" if r.compute_s >= r.memory_s else "memory"
        if r.bound_s > 0:
            if training and r.model_flops is not None:
                r.mfu_ceiling = r.model_flops / (chip.peak_flops * r.bound_s)
            if tokens is not None:
                r.tokens_per_s = tokens / r.bound_s
    return r
