"""Reading a compiled program's HLO text: its computations, how often each runs, its collectives and
its arrays (docs/tpu.md "Memory discipline").

``compiled.as_text()`` of a ``jax.stages.Compiled`` is the optimised, partitioned (per-device) HLO
module. :func:`parse_hlo` splits it into computations and instructions; :func:`multiplicity` follows
the call graph from the entry computation and multiplies in the trip count of every ``while`` loop it
can read (a loop whose condition compares its counter with a constant, as ``lax.scan`` compiles; a
data-dependent loop, like the sampler's decode loop, counts once and is reported as unknown), which
``compiled.cost_analysis()`` does not do (it counts a loop body once). :func:`collectives` lists the
all-gather, all-reduce, reduce-scatter, all-to-all and collective-permute instructions with their
per-device result bytes. :func:`cost` counts a program's matmul FLOPs and the bytes its instructions
read and write, loop trip counts multiplied in (the roofline of ``ict-jax compile``, docs/tpu.md
"Roofline").
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Iterable, Sequence

#: The collective operations reported, in this order.
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")

#: Bytes per element of HLO primitive types (sub-byte types round up to one byte).
DTYPE_BYTES = {
    "pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3b11fnuz": 1,
    "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
    "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}
_ARRAY = re.compile(r"\b(" + "|".join(sorted(DTYPE_BYTES, key=len, reverse=True)) + r")\[([0-9,]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*(\(.*)?\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_CALLS = re.compile(r"\b(calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"\bbranch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


@dataclasses.dataclass(frozen=True)
class Array:
    """One array of an instruction's result: dtype, dimensions (per device), bytes."""

    dtype: str
    dims: tuple[int, ...]

    @property
    def elements(self) -> int:
        return math.prod(self.dims)

    @property
    def bytes(self) -> int:
        return self.elements * DTYPE_BYTES[self.dtype]

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(map(str, self.dims))}]"


@dataclasses.dataclass(frozen=True)
class Instruction:
    name: str
    opcode: str
    arrays: tuple[Array, ...]  # the result (one array, or the elements of a tuple result)
    text: str  # the rest of the line after the result type (operands and attributes)
    root: bool = False

    @property
    def bytes(self) -> int:
        return sum(a.bytes for a in self.arrays)


@dataclasses.dataclass
class HloModule:
    computations: dict[str, list[Instruction]]
    entry: str

    def instructions(self) -> Iterable[tuple[str, Instruction]]:
        for comp, instrs in self.computations.items():
            for ins in instrs:
                yield comp, ins


def _split_type(rest: str) -> tuple[str, str]:
    """``"(f32[2], s32[]) tuple(%a, %b), x=1"`` -> (type text, remainder starting at the opcode)."""
    rest = rest.strip()
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                return rest[:i + 1], rest[i + 1:].strip()
    head, _, tail = rest.partition(" ")
    return head, tail.strip()


def parse_arrays(type_text: str) -> tuple[Array, ...]:
    """Every ``dtype[dims]`` in an HLO type (layouts and memory-space annotations ignored)."""
    return tuple(Array(dt, tuple(int(d) for d in dims.split(",") if d)) for dt, dims in _ARRAY.findall(type_text))


def parse_hlo(text: str) -> HloModule:
    """Split HLO text into computations of :class:`Instruction`."""
    comps: dict[str, list[Instruction]] = {}
    entry, current = None, None
    for line in text.splitlines():
        if current is None:
            m = _HEADER.match(line)
            if m and not line.startswith(" "):
                current = m.group(2)
                comps[current] = []
                if m.group(1):
                    entry = current
            continue
        if line.strip() == "}":
            current = None
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        type_text, rest = _split_type(m.group(3))
        opcode = rest.split("(", 1)[0].strip()
        comps[current].append(Instruction(name=m.group(2), opcode=opcode, arrays=parse_arrays(type_text),
                                          text=rest, root=bool(m.group(1))))
    if entry is None:
        raise ValueError("HLO text has no ENTRY computation")
    return HloModule(comps, entry)


def trip_count(module: HloModule, ins: Instruction) -> int | None:
    """The trip count of a ``while`` instruction: from its backend config, else from a condition of the
    form ``counter < constant`` (how ``lax.scan`` and ``fori_loop`` compile); None when unknown."""
    m = _TRIP.search(ins.text)
    if m:
        return int(m.group(1))
    cond = called(ins, "condition")
    body = module.computations.get(cond or "", [])
    consts = {}
    for c in body:
        if c.opcode == "constant" and len(c.arrays) == 1 and c.arrays[0].dims == ():
            v = re.match(r"constant\((-?\d+)\)", c.text)
            if v:
                consts[c.name] = int(v.group(1))
    for c in body:
        if c.root and c.opcode == "compare" and "direction=LT" in c.text:
            operands = re.findall(r"%([\w.\-]+)", c.text.split(")", 1)[0])
            if len(operands) == 2 and operands[1] in consts:
                return max(consts[operands[1]], 0)
    return None


def _callees(module: HloModule, ins: Instruction) -> list[tuple[str, str]]:
    """(attribute, computation) for every computation ``ins`` calls (branches as ``branch``)."""
    out = [(kind, callee) for kind, callee in _CALLS.findall(ins.text) if callee in module.computations]
    for group in _BRANCHES.findall(ins.text):
        out += [("branch", c) for c in re.findall(r"%?([\w.\-]+)", group) if c in module.computations]
    return out


def called(ins: Instruction, kind: str = "body") -> str | None:
    """The computation ``ins`` names as ``kind`` (``body``, ``condition``, ``calls``, ``to_apply``)."""
    return dict(_CALLS.findall(ins.text)).get(kind)


def data_dependent_loops(module: HloModule, root: str | None = None) -> list[Instruction]:
    """The ``while`` instructions whose trip count :func:`trip_count` cannot read (a sampler's decode
    loops, one per decode phase), in program order: depth first from ``root`` (default the entry),
    each computation's instructions in order."""
    found: list[Instruction] = []
    seen: set[str] = set()

    def visit(comp: str) -> None:
        if comp in seen:
            return
        seen.add(comp)
        for ins in module.computations[comp]:
            if ins.opcode == "while" and trip_count(module, ins) is None:
                found.append(ins)
            for _, callee in _callees(module, ins):
                visit(callee)

    visit(root or module.entry)
    return found


def multiplicity(module: HloModule, *, root: str | None = None,
                 trips: Sequence[int] | None = None) -> tuple[dict[str, int], int]:
    """(executions of each computation per run of ``root`` (default the entry computation), number of
    while loops whose trip count is unknown and not given: those count as one iteration).

    ``trips``: trip counts to assume for the data-dependent loops (:func:`data_dependent_loops`, in
    program order), e.g. a sampler's decode steps per phase when no row stops early; used only when
    there are exactly as many such loops as counts given."""
    loops = data_dependent_loops(module, root)
    assumed = ({ins.name: int(t) for ins, t in zip(loops, trips)}
               if trips is not None and len(trips) == len(loops) else {})
    edges: dict[str, list[tuple[str, int]]] = {c: [] for c in module.computations}
    unknown = 0
    for comp, ins in module.instructions():
        n = 1
        if ins.opcode == "while":
            t = trip_count(module, ins)
            if t is None:
                t = assumed.get(ins.name)
                unknown += t is None
            n = 1 if t is None else t
        for kind, callee in _callees(module, ins):
            edges[comp].append((callee, n if kind in ("body", "condition") else 1))
    start = root or module.entry
    if root is not None:  # loops counted from a sub-computation: only those it reaches
        unknown = sum(1 for ins in loops if ins.name not in assumed)
    mult: dict[str, int] = {c: 0 for c in module.computations}
    order: list[str] = []
    seen: set[str] = set()

    def visit(c: str) -> None:  # post-order over the call DAG
        stack = [(c, iter(edges[c]))]
        seen.add(c)
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                order.append(node)
                stack.pop()
            elif nxt[0] not in seen:
                seen.add(nxt[0])
                stack.append((nxt[0], iter(edges[nxt[0]])))

    visit(start)
    mult[start] = 1
    for c in reversed(order):  # callers before callees
        for callee, n in edges[c]:
            mult[callee] += mult[c] * n
    return mult, unknown


@dataclasses.dataclass(frozen=True)
class Collective:
    op: str  # one of COLLECTIVES
    result: Array  # the largest array of its result (per device)
    bytes: int  # all arrays of its result, per device
    computation: str
    runs: int  # executions per program run (loop trip counts multiplied in)


def collectives(module: HloModule, mult: dict[str, int] | None = None) -> list[Collective]:
    """Every collective instruction (an async ``-start`` counts, its ``-done`` does not)."""
    mult = mult if mult is not None else multiplicity(module)[0]
    out = []
    for comp, ins in module.instructions():
        op = ins.opcode.removesuffix("-start")
        if op not in COLLECTIVES or not ins.arrays:
            continue
        arrays = ins.arrays
        if ins.opcode == "all-gather-start" and len(arrays) > 1:  # (operands..., results...)
            arrays = arrays[len(arrays) // 2:]
        elif ins.opcode == "collective-permute-start" and len(arrays) > 1:  # (operand, result, context...)
            arrays = arrays[1:2]
        out.append(Collective(op=op, result=max(arrays, key=lambda a: a.bytes), bytes=sum(a.bytes for a in arrays),
                              computation=comp, runs=mult.get(comp, 0)))
    return out


def summarize_collectives(items: list[Collective]) -> dict[str, dict[str, int]]:
    """Per op: ``count`` (instructions in the program), ``runs`` (executions per run), ``bytes`` (per
    device, per run), ``largest`` (bytes of the largest single result)."""
    out = {op: {"count": 0, "runs": 0, "bytes": 0, "largest": 0} for op in COLLECTIVES}
    for c in items:
        s = out[c.op]
        s["count"] += 1
        s["runs"] += c.runs
        s["bytes"] += c.bytes * c.runs
        s["largest"] = max(s["largest"], c.bytes)
    return out


def entry_parameters(module: HloModule) -> list[Array]:
    """The per-device arrays the program takes (its entry computation's parameters)."""
    return [a for ins in module.computations[module.entry] if ins.opcode == "parameter" for a in ins.arrays]


def arrays_with_dim(module: HloModule, size: int) -> list[tuple[Array, str, str]]:
    """(array, computation, instruction) for every array in the module with a dimension of ``size``,
    largest first; fused computations included (an array that never exists outside a fusion is
    listed too: a conservative view)."""
    hits = [(a, comp, ins.name) for comp, ins in module.instructions() for a in ins.arrays if size in a.dims]
    return sorted(hits, key=lambda h: -h[0].elements)


# ------------------------------------------------------------------------------------------------
# FLOPs and bytes accessed (the roofline, docs/tpu.md "Roofline")
# ------------------------------------------------------------------------------------------------
#: Instructions that move no data of their own: aliases, tuples, constants, and control flow whose called
#: computations are counted themselves (an async ``-done`` is counted at its ``-start``).
NO_TRAFFIC = frozenset({"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "call",
                        "conditional", "after-all", "partition-id", "replica-id", "opt-barrier", "add-dependency",
                        "domain", "async-start", "async-update"})
#: Instructions that read only the part of their first operand they return.
SLICING = frozenset({"slice", "dynamic-slice", "gather"})
_OPERAND_NAME = re.compile(r"%([\w.\-]+)")
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


def operand_names(ins: Instruction) -> list[str]:
    """The operands of ``ins`` by name (the top-level parenthesised group after the opcode)."""
    text = ins.text[len(ins.opcode):]
    if not text.startswith("("):
        return []
    depth = 0
    for i, ch in enumerate(text):
        depth += ch in "({"
        depth -= ch in ")}"
        if depth == 0:
            return _OPERAND_NAME.findall(text[1:i])
    return _OPERAND_NAME.findall(text)


class _Symbols:
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
        for kind, callee in _callees(module, ins):
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


def _param_reads(module: HloModule, syms: _Symbols, fused: str, depth: int = 0) -> dict[int, int | None]:
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


def _written(module: HloModule, syms: _Symbols, fused: str, ins: Instruction) -> int:
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


def instruction_bytes(module: HloModule, syms: _Symbols, comp: str, ins: Instruction) -> int:
    """Bytes one execution of an instruction of a control computation reads and writes (HBM traffic, to a
    first approximation): its operands and its result, with three exceptions: slicing reads only what
    it returns, a dynamic-update-slice reads and writes only its update (in place), and a fusion reads
    of each operand only what its fused computation slices of it (:func:`_param_reads`) and writes only
    the update of a root dynamic-update-slice."""
    op = ins.opcode
    if op in NO_TRAFFIC or op.endswith("-done"):
        return 0
    operands = syms.operands(comp, ins)
    if op in SLICING:
        return 2 * ins.bytes + sum(_nbytes(o) for o in operands[1:])
    if op == "dynamic-update-slice":
        return 2 * _nbytes(operands[1] if len(operands) > 1 else None) + sum(_nbytes(o) for o in operands[2:])
    if op == "fusion":
        callee = called(ins, "calls")
        if callee in module.computations:
            reads = _param_reads(module, syms, callee)
            read = sum(_nbytes(o) if reads.get(k) is None else min(reads[k], _nbytes(o))
                       for k, o in enumerate(operands))
            return read + _written(module, syms, callee, ins)
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
    syms = _Symbols(module)
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
