"""Text and JSON views of ``ict-jax compile`` results (:mod:`ict_jax.aot.compile`; docs/tpu.md)."""

from __future__ import annotations

from typing import Any, Sequence

from ict_jax.aot.compile import ProgramReport, Target, fmt_bytes
from ict_jax.aot.hlo import COLLECTIVES


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
           reports: Sequence[ProgramReport]) -> str:
    parts = [header(config_name, target, mesh, model_source), "", memory_table(reports)]
    coll = collectives_table(reports)
    if coll:
        parts += ["", "collectives a device, per run (in program / executions / bytes):", coll]
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
