"""Reading a compiled program's HLO text: its computations, how often each runs, its collectives and
its arrays (docs/tpu.md "Memory discipline").

``compiled.as_text()`` of a ``jax.stages.Compiled`` is the optimised, partitioned (per-device) HLO
module. :func:`parse_hlo` splits it into computations and instructions; :func:`multiplicity` follows
the call graph from the entry computation and multiplies in the trip count of every ``while`` loop it
can read (a loop whose condition compares its counter with a constant, as ``lax.scan`` compiles, the
counter's start and step read too: XLA's windowed einsum loops step by two; a
data-dependent loop, like the sampler's decode loop, counts once and is reported as unknown), which
``compiled.cost_analysis()`` does not do (it counts a loop body once). :func:`collectives` lists the
all-gather, all-reduce, reduce-scatter, all-to-all and collective-permute instructions with their
per-device result bytes. Counting FLOPs and bytes accessed from these is :mod:`ict_jax.aot.cost`.
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
_GTE_INDEX = re.compile(r"\bindex=(\d+)")
_OPERAND_NAME = re.compile(r"%([\w.\-]+)")


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
    _by_name: dict[str, Instruction] | None = dataclasses.field(default=None, repr=False, compare=False)

    def instructions(self) -> Iterable[tuple[str, Instruction]]:
        for comp, instrs in self.computations.items():
            for ins in instrs:
                yield comp, ins

    def instruction(self, name: str) -> Instruction | None:
        """The instruction named ``name`` (XLA names each instruction of a module once; a hand-written
        module that repeats a name gets its last one), None when there is none."""
        if self._by_name is None:
            self._by_name = {ins.name: ins for _, ins in self.instructions()}
        return self._by_name.get(name)


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


def _int_constant(ins: Instruction | None) -> int | None:
    """The value of a scalar integer ``constant`` instruction (None for anything else)."""
    if ins is None or ins.opcode != "constant" or len(ins.arrays) != 1 or ins.arrays[0].dims != ():
        return None
    v = re.match(r"constant\((-?\d+)\)", ins.text)
    return int(v.group(1)) if v else None


def operand_names(ins: Instruction) -> list[str]:
    """The operands of ``ins`` by name (the top-level parenthesised group after the opcode)."""
    text = ins.text[len(ins.opcode):]
    if not text.startswith("("):
        return []
    depth, end = 0, len(text)
    for i, ch in enumerate(text):
        depth += ch in "({"
        depth -= ch in ")}"
        if depth == 0:
            end = i
            break
    group = text[1:end]
    names = _OPERAND_NAME.findall(group)
    if names or "%" in group:
        return names
    # a lowered (unoptimised) module prints its operands bare: ``dot(reshape.35, reshape.36)``
    return [n for n in (_top_level(group)) if _BARE_NAME.fullmatch(n)]


_BARE_NAME = re.compile(r"[A-Za-z_][\w.\-]*")


def _top_level(group: str) -> list[str]:
    """The comma-separated items of ``group`` at depth 0 (each item's last word: a name after its type)."""
    items, depth, cur = [], 0, ""
    for ch in group:
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            items.append(cur)
            cur = ""
        else:
            cur += ch
    items.append(cur)
    return [item.split()[-1] for item in items if item.strip()]


def _tuple_index(ins: Instruction | None) -> int | None:
    """``k`` of a ``get-tuple-element(...), index=k`` instruction (None for anything else)."""
    m = _GTE_INDEX.search(ins.text) if ins is not None and ins.opcode == "get-tuple-element" else None
    return int(m.group(1)) if m else None


def _counter_step(module: HloModule, ins: Instruction, k: int) -> int:
    """How much the loop body adds to element ``k`` of the loop state: the body's root tuple holds
    ``add(get-tuple-element(state, k), constant)`` there (1 when it reads otherwise). XLA's windowed
    einsum loops (a collective matmul, unrolled by two) count 0, 2, 4, ... against their limit."""
    body = module.computations.get(called(ins, "body") or "", [])
    table = {c.name: c for c in body}
    root = next((c for c in body if c.root), None)
    if root is None or root.opcode != "tuple":
        return 1
    ops = operand_names(root)
    update = table.get(ops[k]) if k < len(ops) else None
    if update is None or update.opcode != "add":
        return 1
    a, b = (operand_names(update) + ["", ""])[:2]
    for counter, step in ((a, b), (b, a)):
        value = _int_constant(table.get(step))
        if value is not None and value > 0 and _tuple_index(table.get(counter)) == k:
            return value
    return 1


def _counter_start(module: HloModule, ins: Instruction, k: int) -> int:
    """Element ``k`` of the loop's initial state when it is a constant (a ``tuple`` of the caller's
    instructions), else 0."""
    ops = operand_names(ins)
    init = module.instruction(ops[0]) if ops else None
    if init is None or init.opcode != "tuple":
        return 0
    names = operand_names(init)
    start = _int_constant(module.instruction(names[k])) if k < len(names) else None
    return 0 if start is None else start


def trip_count(module: HloModule, ins: Instruction) -> int | None:
    """The trip count of a ``while`` instruction: from its backend config, else from a condition of the
    form ``counter < constant`` (how ``lax.scan`` and ``fori_loop`` compile), the counter's start and
    step read from the loop's initial state and body (0 and 1 unless they say otherwise: XLA's windowed
    einsum loops step by 2); None when unknown."""
    m = _TRIP.search(ins.text)
    if m:
        return int(m.group(1))
    cond = module.computations.get(called(ins, "condition") or "", [])
    table = {c.name: c for c in cond}
    for c in cond:
        if c.root and c.opcode == "compare" and "direction=LT" in c.text:
            operands = operand_names(c)
            limit = _int_constant(table.get(operands[1])) if len(operands) == 2 else None
            if limit is not None:
                k = _tuple_index(table.get(operands[0]))
                if k is None:
                    return max(limit, 0)
                start, step = _counter_start(module, ins, k), _counter_step(module, ins, k)
                return max(-(-(limit - start) // step), 0)
    return None


def callees(module: HloModule, ins: Instruction) -> list[tuple[str, str]]:
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
            for _, callee in callees(module, ins):
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
        for kind, callee in callees(module, ins):
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


#: Instructions that only move or relabel their single operand's elements (a dot reading through them
#: reads that operand's values).
_LAYOUT = frozenset({"bitcast", "copy", "reshape", "transpose", "broadcast", "slice", "dynamic-slice"})
_PARAMETER = re.compile(r"^parameter\((\d+)\)")


@dataclasses.dataclass(frozen=True)
class Upcast:
    """A matmul that reads a float32 operand converted from a narrower float: its values were rounded to
    the narrow type and are then moved (and multiplied) at float32 width."""

    computation: str
    matmul: str  # the dot or convolution
    operand: Array  # the float32 operand it reads
    source: Array  # the narrower array the convert read

    def __str__(self) -> str:
        return f"{self.matmul} ({self.computation}): {self.operand} converted from {self.source}"


def upcast_matmuls(module: HloModule, narrow: tuple[str, ...] = ("bf16", "f16")) -> list[Upcast]:
    """Every ``dot`` and ``convolution`` with a float32 operand that is a ``convert`` of a ``narrow``
    value, followed through layout-only instructions (:data:`_LAYOUT`), fusion parameters (to the
    fusion's operand in its caller) and fusions whose root is such a convert; a dot whose operands mix
    float32 and a ``narrow`` type (an unoptimised module: the compiler converts the narrow one) too.
    Empty when every matmul runs on its operands' own types (docs/architecture.md "Precision")."""
    tables = {c: {i.name: i for i in instrs} for c, instrs in module.computations.items()}
    callers: dict[str, list[tuple[str, Instruction]]] = {}
    for comp, ins in module.instructions():
        if ins.opcode == "fusion":
            callee = called(ins, "calls")
            if callee:
                callers.setdefault(callee, []).append((comp, ins))

    def roots(comp: str, name: str, depth: int = 0) -> list[tuple[str, Instruction]]:
        """The producers of ``name`` in ``comp`` past layout instructions and fusion parameters."""
        ins = tables[comp].get(name)
        if ins is None or depth > 32:
            return []
        if ins.opcode in _LAYOUT:
            ops = operand_names(ins)
            return roots(comp, ops[0], depth + 1) if ops else []
        m = _PARAMETER.match(ins.text)
        if m and comp in callers:
            k = int(m.group(1))
            out = []
            for caller, fusion in callers[comp]:
                ops = operand_names(fusion)
                if k < len(ops):
                    out += roots(caller, ops[k], depth + 1)
            return out
        if ins.opcode == "fusion":
            callee = called(ins, "calls")
            root = next((i for i in module.computations.get(callee or "", []) if i.root), None)
            if root is not None and root.opcode != "tuple":
                return roots(callee, root.name, depth + 1) or [(comp, ins)]
        return [(comp, ins)]

    def source(comp: str, ins: Instruction) -> Array | None:
        """The narrow array a float32 convert reads (None when it is not one)."""
        if ins.opcode != "convert" or not ins.arrays or ins.arrays[0].dtype != "f32":
            return None
        ops = operand_names(ins)
        for _, src in (roots(comp, ops[0]) if ops else []):
            if src.arrays and src.arrays[0].dtype in narrow:
                return src.arrays[0]
        return None

    found = []
    for comp, ins in module.instructions():
        if ins.opcode not in ("dot", "convolution"):
            continue
        ops = [tables[comp].get(n) for n in operand_names(ins)[:2]]
        types = {o.arrays[0].dtype for o in ops if o is not None and o.arrays}
        if "f32" in types and types & set(narrow):
            wide = next(o for o in ops if o.arrays[0].dtype == "f32")
            thin = next(o for o in ops if o.arrays and o.arrays[0].dtype in narrow)
            found.append(Upcast(comp, ins.name, wide.arrays[0], thin.arrays[0]))
            continue
        for name in operand_names(ins)[:2]:
            for c, producer in roots(comp, name):
                src = source(c, producer)
                if src is not None:
                    found.append(Upcast(comp, ins.name, producer.arrays[0], src))
                    break
    return found


def entry_parameters(module: HloModule) -> list[Array]:
    """The per-device arrays the program takes (its entry computation's parameters)."""
    return [a for ins in module.computations[module.entry] if ins.opcode == "parameter" for a in ins.arrays]


def arrays_with_dim(module: HloModule, size: int) -> list[tuple[Array, str, str]]:
    """(array, computation, instruction) for every array in the module with a dimension of ``size``,
    largest first; fused computations included (an array that never exists outside a fusion is
    listed too: a conservative view)."""
    hits = [(a, comp, ins.name) for comp, ins in module.instructions() for a in ins.arrays if size in a.dims]
    return sorted(hits, key=lambda h: -h[0].elements)
