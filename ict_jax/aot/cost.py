"""Counting a compiled program's matmul FLOPs and the bytes its instructions read and write, from its
HLO text, every loop's trip count multiplied in (the roofline of ``ict-jax compile``, docs/tpu.md
"Roofline"; :mod:`ict_jax.aot.roofline` turns the counts into time bounds).

:func:`cost` walks the computations that :func:`ict_jax.aot.hlo.parse_hlo` read, weighted by
:func:`ict_jax.aot.hlo.multiplicity` (``compiled.cost_analysis()`` counts a loop body once). FLOPs: the
``dot``, ``convolution`` and GEMM custom-call instructions, fused ones too (:func:`dot_flops`; on TPU,
batched matmuls compile to strided, lhs-dilated convolutions, and only kernel taps on a real input
element count). Bytes: the operands and results of the instructions of control computations (the
entry, loop bodies, called computations), with slices, in-place dynamic-update-slices and fusions that
read only a slice of an operand counted at what they touch (:func:`instruction_bytes`).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Sequence

from ict_jax.aot.hlo import Array, HloModule, Instruction, called, callees, multiplicity, operand_names

#: Instructions that move no data of their own: aliases, tuples, constants, and control flow whose called
#: computations are counted themselves (an async ``-done`` is counted at its ``-start``).
NO_TRAFFIC = frozenset({"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "call",
                        "conditional", "after-all", "partition-id", "replica-id", "opt-barrier", "add-dependency",
                        "domain", "async-start", "async-update"})
#: Instructions that read only the part of their first operand they return.
SLICING = frozenset({"slice", "dynamic-slice", "gather"})
_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([0-9,]*)\}")
_GEMM_CONTRACTING = re.compile(r'"lhs_contracting_dimensions":\[([^\]]*)\]')
_DIM_LABELS = re.compile(r"dim_labels=([0-9a-z]+)_([0-9a-z]+)->([0-9a-z]+)")
_WINDOW = re.compile(r"window=\{([^}]*)\}")
_PARAM_INDEX = re.compile(r"^parameter\((\d+)\)")


@dataclasses.dataclass(frozen=True)
class Cost:
    """Matmul FLOPs and bytes accessed of (part of) a program, per device per run."""

    flops: float = 0.0
    bytes: float = 0.0

    def __add__(self, other: "Cost") -> "Cost":
        return Cost(self.flops + other.flops, self.bytes + other.bytes)

    def __mul__(self, n: float) -> "Cost":
        return Cost(self.flops * n, self.bytes * n)


class Symbols:
    """Instructions by name, per computation (built on first use)."""

    def __init__(self, module: HloModule):
        self.module = module
        self.tables: dict[str, dict[str, Instruction]] = {}

    def __call__(self, comp: str) -> dict[str, Instruction]:
        if comp not in self.tables:
            self.tables[comp] = {ins.name: ins for ins in self.module.computations[comp]}
        return self.tables[comp]

    def operands(self, comp: str, ins: Instruction) -> list[Instruction | None]:
        table = self(comp)
        return [table.get(n) for n in operand_names(ins)]


def _nbytes(ins: Instruction | None) -> int:
    return 0 if ins is None else ins.bytes


def computation_roles(module: HloModule) -> tuple[set[str], set[str]]:
    """(control computations, fused computations). Control: the entry and what ``while``, ``call``,
    ``conditional`` and async wrappers run (their instructions touch memory); fused: the bodies of
    ``fusion`` instructions (their instructions work in registers; the fusion's operands and results are
    the traffic). Reducers (``to_apply`` of reduce, all-reduce, sort, scatter...) are neither."""
    control, fused = {module.entry}, set()
    for _, ins in module.instructions():
        for kind, callee in callees(module, ins):
            if ins.opcode == "fusion":
                fused.add(callee)
            elif kind in ("body", "condition", "branch", "true_computation", "false_computation") or (
                    ins.opcode == "call" or ins.opcode.startswith("async")):
                control.add(callee)
    return control, fused


def dot_flops(ins: Instruction, operands: Sequence[Instruction | None]) -> float:
    """2 x multiply-adds of a ``dot``, a ``convolution`` or a cuBLAS GEMM custom call (0 for anything
    else): 2 x result elements x the contracted size (a convolution: its kernel's elements per output
    feature)."""
    if not ins.arrays:
        return 0.0
    out = ins.arrays[0].elements
    lhs = operands[0].arrays[0] if operands and operands[0] is not None and operands[0].arrays else None
    if ins.opcode == "dot" and lhs is not None:
        m = _CONTRACTING.search(ins.text)
        dims = [int(d) for d in m.group(1).split(",") if d] if m else []
        return 2.0 * out * math.prod(lhs.dims[d] for d in dims)
    if ins.opcode == "convolution" and len(operands) > 1 and operands[1] is not None and operands[1].arrays:
        return _convolution_flops(ins, lhs, operands[1].arrays[0])
    if ins.opcode == "custom-call" and lhs is not None and ("gemm" in ins.text or "matmul" in ins.text):
        m = _GEMM_CONTRACTING.search(ins.text)
        if m:
            dims = [int(d) for d in re.findall(r"\d+", m.group(1))]
            return 2.0 * out * math.prod(lhs.dims[d] for d in dims)
    return 0.0


def _window_pairs(size_in: int, size_out: int, k: int, stride: int, pad_lo: int, lhs_dil: int, rhs_dil: int) -> int:
    """Pairs (output position, kernel position) of one spatial dimension whose input position is a real
    element (not padding, not a hole of the lhs dilation): the multiply-adds that dimension contributes."""
    import numpy as np

    o = np.arange(size_out)[:, None]
    kk = np.arange(k)[None, :]
    pos = o * stride + kk * rhs_dil - pad_lo
    return int(np.count_nonzero((pos >= 0) & (pos <= (size_in - 1) * lhs_dil) & (pos % lhs_dil == 0)))


def _convolution_flops(ins: Instruction, lhs: Array | None, rhs: Array) -> float:
    """2 x output batch x output features x the kernel's input features x, per spatial dimension, the
    (output, kernel) position pairs that meet a real input element (XLA's TPU backend writes batched
    matmuls as convolutions with strides, padding and lhs dilation: counting every kernel position would
    count the holes)."""
    m = _DIM_LABELS.search(ins.text)
    if lhs is None or not m or not ins.arrays:
        return 0.0
    lhs_l, rhs_l, out_l = m.groups()
    out = ins.arrays[0]
    if len(lhs_l) != len(lhs.dims) or len(rhs_l) != len(rhs.dims) or len(out_l) != len(out.dims):
        return 0.0
    flops = 2.0 * out.dims[out_l.index("b")] * out.dims[out_l.index("f")] * rhs.dims[rhs_l.index("i")]
    spatial = sorted(c for c in out_l if c.isdigit())
    w = _WINDOW.search(ins.text)
    attrs = dict(kv.split("=", 1) for kv in (w.group(1).split() if w else []) if "=" in kv)

    def field(name: str, default: int) -> list:
        return attrs[name].split("x") if name in attrs else [default] * len(spatial)

    pads = field("pad", "0_0")
    for n, d in enumerate(spatial):
        flops *= _window_pairs(lhs.dims[lhs_l.index(d)], out.dims[out_l.index(d)], rhs.dims[rhs_l.index(d)],
                               int(field("stride", 1)[n]), int(str(pads[n]).split("_")[0]),
                               int(field("lhs_dilate", 1)[n]), int(field("rhs_dilate", 1)[n]))
    return flops


def _param_reads(module: HloModule, syms: Symbols, fused: str, depth: int = 0) -> dict[int, int | None]:
    """Per parameter of a fused computation: the bytes it reads of that operand when only part of it is
    read (every use slices it, or it is the buffer a root dynamic-update-slice writes into: 0), None
    when the whole operand is read."""
    instrs = module.computations[fused]
    users: dict[str, list[tuple[Instruction, int]]] = {}
    for ins in instrs:
        for k, name in enumerate(operand_names(ins)):
            users.setdefault(name, []).append((ins, k))
    roots = {ins.name for ins in instrs if ins.root}
    for ins in instrs:  # a root tuple's elements are roots too
        if ins.root and ins.opcode == "tuple":
            roots |= set(operand_names(ins))

    def partial(name: str, depth: int = depth) -> int | None:
        total = 0
        for user, k in users.get(name, []):
            if user.opcode == "bitcast" and depth < 4:
                sub = partial(user.name, depth + 1)
                if sub is None:
                    return None
                total += sub
            elif user.opcode in SLICING and k == 0:
                total += user.bytes
            elif user.opcode == "dynamic-update-slice" and k == 0 and user.name in roots:
                pass  # written in place: its other bytes are not read
            elif user.opcode == "fusion" and depth < 4:  # a nested fusion (TPU): what it reads of its operand k
                callee = called(user, "calls")
                sub = _param_reads(module, syms, callee, depth + 1).get(k) if callee in module.computations else None
                if sub is None:
                    return None
                total += sub
            else:
                return None
        return total

    out = {}
    for ins in instrs:
        m = _PARAM_INDEX.match(ins.text)
        if m:
            out[int(m.group(1))] = partial(ins.name)
    return out


def _written(module: HloModule, syms: Symbols, fused: str, ins: Instruction) -> int:
    """Bytes a fusion writes: its result, except that a root dynamic-update-slice (in place) writes its
    update only."""
    table = syms(fused)
    root = next((i for i in module.computations[fused] if i.root), None)
    if root is None:
        return ins.bytes

    def written(i: Instruction | None) -> int:
        while i is not None and i.opcode == "bitcast":
            i = table.get((operand_names(i) or [""])[0])
        if i is None:
            return 0
        if i.opcode == "dynamic-update-slice":
            ops = operand_names(i)
            return _nbytes(table.get(ops[1])) if len(ops) > 1 else i.bytes
        return i.bytes

    if root.opcode == "tuple":
        return sum(written(table.get(n)) for n in operand_names(root))
    return written(root)


def instruction_bytes(module: HloModule, syms: Symbols, comp: str, ins: Instruction) -> int:
    """Bytes one execution of an instruction of a control computation reads and writes (HBM traffic, to a
    first approximation): its operands and its result, with three exceptions: slicing reads only what
    it returns, a dynamic-update-slice reads and writes only its update (in place), and a fusion (or the
    start of an asynchronous one, XLA GPU's ``fusion-start``, whose result tuple also names its operands)
    reads of each operand only what its fused computation slices of it (:func:`_param_reads`) and writes
    only its result, or the update of a root dynamic-update-slice. Any other asynchronous start (a copy,
    slice or collective) counts as its synchronous form: its operands read and its output written, not the
    operands its result tuple echoes."""
    op = ins.opcode
    if op in NO_TRAFFIC or op.endswith("-done"):
        return 0
    operands = syms.operands(comp, ins)
    if op in SLICING:
        return 2 * ins.bytes + sum(_nbytes(o) for o in operands[1:])
    if op == "dynamic-update-slice":
        return 2 * _nbytes(operands[1] if len(operands) > 1 else None) + sum(_nbytes(o) for o in operands[2:])
    if op in ("fusion", "fusion-start"):  # fusion-start: XLA GPU's asynchronous fusion (its -done is free)
        callee = called(ins, "calls")
        if callee in module.computations:
            reads = _param_reads(module, syms, callee)
            read = sum(_nbytes(o) if reads.get(k) is None else min(reads[k], _nbytes(o))
                       for k, o in enumerate(operands))
            return read + _written(module, syms, callee, ins)
    if op.endswith("-start"):  # asynchronous: its result tuple holds its output beside its operands (echoed)
        read = sum(_nbytes(o) for o in operands)  # and context scalars; its -done moves nothing
        written = max(0, sum(a.bytes for a in ins.arrays if a.dims) - read)
        return 2 * written if op == "slice-start" else read + written
    return sum(_nbytes(o) for o in operands) + ins.bytes


def cost(module: HloModule, mult: dict[str, int] | None = None) -> Cost:
    """Matmul FLOPs (:func:`dot_flops`, in fused computations too) and bytes accessed
    (:func:`instruction_bytes` of every instruction of a control computation, :func:`computation_roles`)
    of a program, each computation weighted by ``mult`` (default :func:`multiplicity`: loop trip counts
    multiplied in, which ``compiled.cost_analysis()`` does not do). Elementwise FLOPs are not counted;
    bytes are an upper-bound style approximation of HBM traffic (no cache reuse between instructions,
    no on-chip memory spaces)."""
    mult = mult if mult is not None else multiplicity(module)[0]
    control, fused = computation_roles(module)
    syms = Symbols(module)
    flops, nbytes = 0.0, 0.0
    for comp, instrs in module.computations.items():
        n = mult.get(comp, 0)
        if not n or (comp not in control and comp not in fused):
            continue
        for ins in instrs:
            if ins.opcode in ("dot", "convolution", "custom-call"):
                flops += n * dot_flops(ins, syms.operands(comp, ins))
            if comp in control:
                nbytes += n * instruction_bytes(module, syms, comp, ins)
    return Cost(flops, nbytes)
