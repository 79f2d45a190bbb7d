"""Text and JSON views of ``ict-jax compile`` results (:mod:`ict_jax.aot.compile`; docs/tpu.md)."""

from __future__ import annotations

from typing import Any, Sequence

from ict_jax.aot.compile import ProgramReport, Target
from ict_jax.aot.hlo import COLLECTIVES
from ict_jax.memory import fmt_bytes


def header(config_name: str, target: Target, mesh: dict[str, int], model_source: str) -> str:
    hbm = f", {fmt_bytes(target.hbm_bytes)} HBM each" if target.hbm_bytes and target.budget is None else ""
    line = (f"{config_name} on {target.name} ({target.chips} x {target.device_kind}{hbm}); mesh "
            + " ".join(f"{k}={v}" for k, v in mesh.items()) + f"; model: {model_source}")
    if target.budget is not None:  # the local machine: the memory pre-flight's budget (docs/memory.md)
        line += f"\nbudget: {target.budget.describe()}"
    return line


def memory_table(reports: Sequence[ProgramReport]) -> str:
    """One row per program: per-device bytes, fit, compile seconds."""
    cols = ("program", "arguments", "temporaries", "outputs", "aliased", "code", "resident", "live", "HBM",
            "fits", "compile")
    rows = [cols]
    for r in reports:
        rows.append((r.program, fmt_bytes(r.arguments), fmt_bytes(r.temporaries), fmt_bytes(r.outputs),
                     fmt_bytes(r.aliased), fmt_bytes(r.code), fmt_bytes(r.resident), fmt_bytes(r.live),
                     fmt_bytes(r.hbm), "yes" if r.fits else "NO", f"{r.compile_s:.0f} s"))
    return _table(rows)


def collectives_table(reports: Sequence[ProgramReport]) -> str:
    """Per program and collective: instructions in the program / executions per run / bytes a device
    moves per run (loop trip counts multiplied in)."""
    rows = [("program",) + COLLECTIVES]
    for r in reports:
        if not r.collectives:
            continue
        cells = []
        for op in COLLECTIVES:
            c = r.collectives[op]
            cells.append("-" if not c["count"] else f"{c['count']} / {c['runs']:,} / {fmt_bytes(c['bytes'])}")
        rows.append((r.program,) + tuple(cells))
    return _table(rows) if len(rows) > 1 else ""


def _si(x: float | None, unit: str) -> str:
    if x is None:
        return "-"
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {prefix}{unit}"
    return f"{x:.0f} {unit}"


def _seconds(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.1f} ms" if x < 1 else f"{x:.2f} s"


def roofline_table(reports: Sequence[ProgramReport]) -> str:
    """Per program, per device and run (samplers: every row to max_new_tokens): the matmul FLOPs and the
    bytes accessed counted from the compiled HLO (loop trip counts multiplied in), the times they take at
    the chip's peak FLOP/s and HBM bandwidth, the larger as the bound; the model's FLOPs (6 N tokens, 2 N
    tokens for samplers); the MFU ceiling of a training step or the tokens/s ceiling of a sampler; a
    decode step's bytes over the weights + KV cache it must read (docs/tpu.md "Roofline")."""
    rows = [("program", "HLO flops", "HLO bytes", "compute", "memory", "bound", "model flops", "ceiling",
             "decode step / (weights + KV)")]
    for r in reports:
        f = r.roofline
        if f is None:
            continue
        if f.mfu_ceiling is not None:
            ceiling = f"MFU {f.mfu_ceiling:.0%}"
        elif f.tokens_per_s is not None and f.decode_steps is not None:
            ceiling = f"{f.tokens_per_s:,.0f} tok/s"
        else:
            ceiling = "-"
        decode = "-" if f.decode_ratio is None else (f"{_si(f.decode_step_bytes, 'B')} / "
                                                     f"{_si(f.decode_min_bytes, 'B')} = {f.decode_ratio:.2f}x")
        rows.append((r.program, _si(f.flops, "FLOP"), _si(f.bytes, "B"), _seconds(f.compute_s),
                     _seconds(f.memory_s), "-" if f.bound is None else f"{_seconds(f.bound_s)} ({f.bound})",
                     _si(f.model_flops, "FLOP"), ceiling, decode))
    return _table(rows) if len(rows) > 1 else ""


def roofline_note(reports: Sequence[ProgramReport]) -> str:
    """Which chip's figures the times use (or that the target has none), and loops left uncounted."""
    chips = {r.roofline.chip for r in reports if r.roofline is not None}
    if not chips:
        return ""
    if chips == {None}:
        note = "no peak FLOP/s or HBM bandwidth for this device in aot.chips: counts only"
    else:
        from ict_jax.aot.chips import CHIPS

        c = CHIPS[next(iter(chips - {None}))]
        note = (f"{c.name}: {c.peak_flops / 1e12:,.0f} TFLOP/s bf16, {c.hbm_bw / 1e9:,.0f} GB/s HBM a chip "
                f"({c.source})")
    left = [r.program for r in reports if r.roofline is not None and r.roofline.unknown_loops]
    if left:
        note += f"; {', '.join(left)}: a data-dependent loop counted once (its trip count unknown)"
    return note


def breakdown_table(reports: Sequence[ProgramReport]) -> str:
    """Per program and category (:mod:`ict_jax.aot.breakdown`): the bytes a device reads and writes per
    run, their share of the program's, and the category's matmul FLOPs."""
    rows = [("program", "category", "HLO bytes", "share", "HLO flops")]
    for r in reports:
        if not r.breakdown:
            continue
        total = sum(c["bytes"] for c in r.breakdown.values()) or 1.0
        for name, c in r.breakdown.items():
            rows.append((r.program, name, _si(c["bytes"], "B"), f"{c['bytes'] / total:.1%}", _si(c["flops"], "FLOP")))
        rows.append((r.program, "total", _si(total, "B"), "100%",
                     _si(sum(c["flops"] for c in r.breakdown.values()), "FLOP")))
    return _table(rows) if len(rows) > 1 else ""


def checks_lines(reports: Sequence[ProgramReport]) -> list[str]:
    out = []
    for r in reports:
        for c in r.checks:
            out.append(f"{r.program:<9} {'ok  ' if c.ok else 'FAIL'} {c.name}: {c.detail}")
        if r.unknown_loops:
            out.append(f"{r.program:<9}      {r.unknown_loops} loop(s) with a data-dependent trip count (the decode "
                       "loop) count once in the collectives' executions: multiply by the decode steps")
    return out


def not_fitting_line(r: ProgramReport) -> str:
    """The one line of exit code 3: the program, its bytes and the HBM."""
    if r.compiled:
        memory = "HBM" if r.target != "local" else "available a device (the budget line above)"
        return (f"{r.program} does not fit {r.target}: {fmt_bytes(r.live)} live a device "
                f"({fmt_bytes(r.temporaries)} temporaries) > {fmt_bytes(r.hbm)} {memory}")
    temps = f"{fmt_bytes(r.temporaries)} of temporaries" if r.temporaries else "out of memory"
    return f"{r.program} does not fit {r.target}: {temps} > {fmt_bytes(r.hbm)} HBM (compiler: {r.error})"


def render(config_name: str, target: Target, mesh: dict[str, int], model_source: str,
           reports: Sequence[ProgramReport], *, with_breakdown: bool = False) -> str:
    """The report of ``ict-jax compile``; ``with_breakdown``: also the bytes by category (``--breakdown``)."""
    parts = [header(config_name, target, mesh, model_source), "", memory_table(reports)]
    coll = collectives_table(reports)
    if coll:
        parts += ["", "collectives a device, per run (in program / executions / bytes):", coll]
    roof = roofline_table(reports)
    if roof:
        parts += ["", "roofline a device, per run, counted from the compiled HLO (" + roofline_note(reports) + "):",
                  roof]
    table = breakdown_table(reports) if with_breakdown else ""
    if table:
        parts += ["", "the HLO bytes by category, a device per run (loop trip counts multiplied in):", table]
    notes = [f"{r.program}: {r.note}" for r in reports if r.note]
    if notes:
        parts += [""] + notes
    lines = checks_lines(reports)
    if lines:
        parts += ["", "memory discipline:"] + lines
    return "\n".join(parts)


def to_json(config_name: str, target: Target, mesh: dict[str, int], model_source: str,
            reports: Sequence[ProgramReport], fit: Any = None) -> dict[str, Any]:
    out = {"config": config_name, "target": target.name, "device_kind": target.device_kind, "chips": target.chips,
           "hbm_bytes": target.hbm_bytes, "mesh": mesh, "model": model_source,
           "programs": [r.to_dict() for r in reports]}
    if fit is not None:
        out["fit"] = fit
    return out


def _table(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in
                               enumerate(zip(row, widths))).rstrip() for row in rows)
