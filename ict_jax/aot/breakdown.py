"""A compiled program's bytes (and matmul FLOPs) by what they serve: attention, the layers' matmul I/O,
dtype converts, norms and elementwise work, the vocabulary head and statistics, the optimizer, other
(``ict-jax compile --breakdown``, docs/tpu.md "Where the bytes go").

Every instruction of a control computation is counted as :func:`ict_jax.aot.cost.cost` counts it
(:func:`~ict_jax.aot.cost.instruction_bytes`, loop trip counts multiplied in), so the categories sum to
the roofline's HLO bytes. Its category comes from the Python source that emitted it: JAX records a
stack frame id with every instruction (``metadata={... stack_frame_id=N}``) and the module text ends
with the tables that resolve it (``FileNames``, ``FunctionNames``, ``FileLocations``, ``StackFrames``).
The innermost frame in ``ict_jax`` or ``optax`` decides, first match in :data:`CATEGORIES`' order:

- ``optimizer``: optax, ``rl/state.py``, ``rl.train_step.apply_update``;
- ``vocabulary head + statistics``: ``rl/token_stats.py``, ``Qwen2.logits_from_hidden``/``unembedding``;
- ``attention``: ``model/attention.py`` and ``model/fused_attention.py`` (the fused kernels' calls);
- ``converts``: any other instruction that only changes a dtype (a ``convert``, or a fusion of a convert
  and layout moves): the float32 copies of bfloat16 values that matmuls returning float32 cause;
- ``matmul I/O``: any other dot or convolution, or a fusion holding one (its operands and result);
- ``norms/elementwise``: the rest of ``ict_jax/model``: RMSNorm, RoPE, residual adds, SwiGLU;
- ``other``: everything else (the loss, the selectors, the metrics, loop state without a source).
"""

from __future__ import annotations

import dataclasses
import re

from ict_jax.aot.cost import Cost, Symbols, computation_roles, dot_flops, instruction_bytes
from ict_jax.aot.hlo import HloModule, Instruction, called, multiplicity

#: The categories, in the order they are matched and printed.
CATEGORIES = ("attention", "matmul I/O", "converts", "norms/elementwise", "vocabulary head + statistics",
              "optimizer", "other")
_TABLES = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")
_FRAME_ID = re.compile(r"\bstack_frame_id=(\d+)")
_SOURCE_FILE = re.compile(r'\bsource_file="([^"]*)"')
_FIELDS = re.compile(r"(\w+)=(\d+)")
_MATMULS = frozenset({"dot", "convolution"})
#: What a fusion may hold and still only change its operand's dtype.
_MOVES = frozenset({"parameter", "convert", "bitcast", "copy", "reshape", "transpose", "broadcast",
                    "reduce-precision", "slice", "tuple"})


@dataclasses.dataclass(frozen=True)
class Frame:
    file: str  # as recorded (an absolute path)
    function: str
    line: int


def source_frames(text: str) -> dict[int, tuple[Frame, ...]]:
    """Stack frame id -> its frames, innermost first, from the tables at the end of an HLO module's text
    (empty when the text has none). A frame's ``parent_frame_id`` is one more than the id its parent is
    printed under (0: no parent), as jax 0.10's HLO text writes them."""
    tables: dict[str, dict[int, str]] = {t: {} for t in _TABLES}
    section = None
    for line in text.splitlines():
        if line in _TABLES:
            section = line
            continue
        if section is None:
            continue
        head, _, rest = line.partition(" ")
        if not head.isdigit():
            section = None
            continue
        tables[section][int(head)] = rest.strip()
    files = {k: v.strip('"') for k, v in tables["FileNames"].items()}
    functions = {k: v.strip('"') for k, v in tables["FunctionNames"].items()}
    locations = {k: {f: int(n) for f, n in _FIELDS.findall(v)} for k, v in tables["FileLocations"].items()}
    frames = {k: {f: int(n) for f, n in _FIELDS.findall(v)} for k, v in tables["StackFrames"].items()}

    def frame(k: int) -> Frame | None:
        loc = locations.get(frames[k].get("file_location_id", 0))
        if loc is None:
            return None
        return Frame(files.get(loc.get("file_name_id", 0), "?"), functions.get(loc.get("function_name_id", 0), "?"),
                     loc.get("line", 0))

    out: dict[int, tuple[Frame, ...]] = {}
    for k in frames:
        chain, seen, j = [], set(), k
        while j in frames and j not in seen:
            seen.add(j)
            f = frame(j)
            if f is not None:
                chain.append(f)
            j = frames[j].get("parent_frame_id", 0) - 1
        out[k] = tuple(chain)
    return out


def _package_path(path: str) -> str | None:
    """``ict_jax/...`` or ``optax/...`` of a recorded file path (None for any other file)."""
    for pkg in ("ict_jax/", "optax/"):
        i = path.rfind("/" + pkg)
        if i >= 0:
            return path[i + 1:]
        if path.startswith(pkg):
            return path
    return None


def _place(frames: tuple[Frame, ...], source_file: str | None) -> tuple[str, str] | None:
    """(package path, function) of the innermost frame in ict_jax or optax."""
    for f in frames:
        p = _package_path(f.file)
        if p is not None:
            return p, f.function
    if source_file is not None:  # an HLO text with source files in its metadata and no frame tables
        p = _package_path(source_file)
        if p is not None:
            return p, ""
    return None


def _fused(module: HloModule, ins: Instruction) -> list[Instruction]:
    callee = called(ins, "calls") if ins.opcode in ("fusion", "fusion-start") else None
    return module.computations.get(callee or "", [])


def _is_convert(module: HloModule, ins: Instruction) -> bool:
    if ins.opcode == "convert":
        return True
    body = _fused(module, ins)
    return bool(body) and any(i.opcode == "convert" for i in body) and all(i.opcode in _MOVES for i in body)


def _has_matmul(module: HloModule, ins: Instruction) -> bool:
    if ins.opcode in _MATMULS or (ins.opcode == "custom-call" and ("gemm" in ins.text or "matmul" in ins.text)):
        return True
    return any(_has_matmul(module, i) for i in _fused(module, ins))


def category(module: HloModule, ins: Instruction, frames: dict[int, tuple[Frame, ...]]) -> str:
    """The category (:data:`CATEGORIES`) of one instruction of a control computation (module docstring)."""
    m = _FRAME_ID.search(ins.text)
    s = _SOURCE_FILE.search(ins.text)
    place = _place(frames.get(int(m.group(1)), ()) if m else (), s.group(1) if s else None)
    path, function = place if place is not None else ("", "")
    if path.startswith("optax/") or path == "ict_jax/rl/state.py" or function.startswith("apply_update"):
        return "optimizer"
    if path == "ict_jax/rl/token_stats.py" or function in ("Qwen2.logits_from_hidden", "Qwen2.unembedding"):
        return "vocabulary head + statistics"
    if path in ("ict_jax/model/attention.py", "ict_jax/model/fused_attention.py"):  # dense / blocked; fused kernels
        return "attention"
    if _is_convert(module, ins):
        return "converts"
    if _has_matmul(module, ins):
        return "matmul I/O"
    if path.startswith("ict_jax/model/"):
        return "norms/elementwise"
    return "other"


def breakdown(module: HloModule, text: str, mult: dict[str, int] | None = None) -> dict[str, Cost]:
    """Per category (:data:`CATEGORIES`, every one present): the bytes its instructions read and write
    and its matmul FLOPs, per device per run, loop trip counts multiplied in (``mult``, default
    :func:`~ict_jax.aot.hlo.multiplicity`). ``text``: the module's HLO text (its frame tables). The
    bytes and FLOPs sum to :func:`ict_jax.aot.cost.cost`'s."""
    mult = mult if mult is not None else multiplicity(module)[0]
    frames = source_frames(text)
    control, fused = computation_roles(module)
    syms = Symbols(module)
    out = {c: Cost() for c in CATEGORIES}
    for comp, instrs in module.computations.items():
        n = mult.get(comp, 0)
        if not n or comp not in control:
            continue
        for ins in instrs:
            nbytes = instruction_bytes(module, syms, comp, ins)
            flops = _flops(module, syms, comp, ins)
            if nbytes or flops:
                c = category(module, ins, frames)
                out[c] = out[c] + Cost(flops, nbytes) * n
    return out


def _flops(module: HloModule, syms: Symbols, comp: str, ins: Instruction) -> float:
    """Matmul FLOPs of one instruction, those of the matmuls inside it (a fusion) included."""
    total = dot_flops(ins, syms.operands(comp, ins)) if ins.opcode in ("dot", "convolution", "custom-call") else 0.0
    callee = called(ins, "calls") if ins.opcode in ("fusion", "fusion-start") else None
    if callee in module.computations:
        for i in module.computations[callee]:
            total += _flops(module, syms, callee, i)
    return total
