"""The numbers, table and plots of a method comparison (:mod:`ict_jax.experiments.compare`): pure functions of
a run's metrics rows and summary, the Markdown table, and reading finished runs from disk."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from ict_jax.rl.selectors import selector_warmup, selectors_where
from ict_jax.train.logs import read_metrics
from ict_jax.train.record import read_summary, run_finished


@dataclass(frozen=True)
class RunSpec:
    group: str  # "ict", "grpo", ..., "ict_rho0.05", or a variant's name ("ict_norm_valid")
    method: str
    rho: float | None  # None = the method's default (docs/method.md §2)
    seed: int
    run_dir: Path
    overrides: tuple[tuple[str, Any], ...] = ()  # a variant's config overrides (dotted key, value)

    @property
    def name(self) -> str:
        return f"{self.group}_s{self.seed}"


#: Moving-average window of ``reward/mean`` for "steps to target", and the number of final RL steps
#: that H1 / H2 are averaged over.
MA_WINDOW = 5
LAST_STEPS = 5
INCONCLUSIVE = ("Differences between methods within one standard deviation (over seeds) are inconclusive.")


# --------------------------------------------------------------------------------------------------
# Per-run numbers and their aggregation (pure functions of metrics rows / summaries)
# --------------------------------------------------------------------------------------------------
def is_finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def steps_to_target(rows: Sequence[Mapping[str, Any]], target: float, window: int = MA_WINDOW,
                    key: str = "reward/mean") -> int | None:
    """The number of RL steps until the trailing moving average of ``key`` (over ``window`` steps; over
    all steps so far while fewer than ``window`` exist) first reaches ``target``: the 1-based position
    of that step. None if it never does."""
    vals: list[float] = []
    for r in sorted(rows, key=lambda r: r["step"]):
        v = r.get(key)
        if not is_finite(v):
            continue
        vals.append(float(v))
        tail = vals[-window:]
        if sum(tail) / len(tail) >= target:
            return int(r["step"]) + 1
    return None


def tail_mean(rows: Sequence[Mapping[str, Any]], key: str, n: int = LAST_STEPS) -> float | None:
    """Mean of ``key`` over the last ``n`` RL steps that logged it (None if none did)."""
    vals = [float(r[key]) for r in sorted(rows, key=lambda r: r["step"]) if is_finite(r.get(key))]
    return sum(vals[-n:]) / len(vals[-n:]) if vals else None


def pass_by_benchmark(evals: Mapping[str, Any] | None) -> dict[str, dict[int, float]]:
    """``{"eval/<bench>/pass@k": v}`` -> ``{bench: {k: v}}``."""
    out: dict[str, dict[int, float]] = {}
    for key, v in (evals or {}).items():
        if not key.startswith("eval/") or not is_finite(v):
            continue
        bench, _, metric = key[len("eval/"):].rpartition("/")
        if metric.startswith("pass@") and metric[5:].isdigit():
            out.setdefault(bench, {})[int(metric[5:])] = float(v)
    return out


def pass_at_k(evals: Mapping[str, Any] | None) -> dict[int, float]:
    """``{"eval/<bench>/pass@k": v}`` -> ``{k: mean of v over benchmarks}``."""
    per_k: dict[int, list[float]] = {}
    for vals in pass_by_benchmark(evals).values():
        for k, v in vals.items():
            per_k.setdefault(k, []).append(v)
    return {k: sum(v) / len(v) for k, v in sorted(per_k.items())}


def mean_sd(values: Iterable[float | None]) -> dict[str, Any]:
    """``{"mean", "sd", "n"}`` over the non-None values; sd is the sample sd (ddof 1), None when n < 2."""
    vals = [float(v) for v in values if v is not None]
    n = len(vals)
    if n == 0:
        return {"mean": None, "sd": None, "n": 0}
    mean = sum(vals) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in vals) / (n - 1)) if n > 1 else None
    return {"mean": mean, "sd": sd, "n": n}


# --------------------------------------------------------------------------------------------------
# The selected fraction: did a sparse method select anything less than every token?
# --------------------------------------------------------------------------------------------------
#: The methods that train on every valid token by design (dense GRPO): selecting everything is their method.
DENSE_METHODS = ("dense", "grpo")
#: A step's ``mask/selected_frac`` at or above this counts as every valid token (sum M / sum valid in float32).
ALL_SELECTED = 1.0 - 1e-6


def dense_steps(method: str, warmup_steps: int) -> int:
    """The RL steps at the start of a run of ``method`` that train on every valid token by design: the
    warm-up's ``warmup_steps`` (``rl.selector.warmup_steps``) for a selector the warm-up applies to
    (:func:`ict_jax.rl.selectors.selector_warmup`: registered with ``warmup=True``), else 0."""
    return int(warmup_steps) if selector_warmup(method) else 0


def selection(rows: Sequence[Mapping[str, Any]], dense: int = 0) -> dict[str, Any]:
    """What a run selected: ``selected_frac``, the mean of ``mask/selected_frac`` over its sparse steps (the
    RL steps from 0-based step ``dense`` on, after the warm-up; None when there is none), ``sparse_steps``
    (how many logged it), ``dense_steps`` (``dense``), ``steps`` (the RL steps that logged it at all) and
    ``all_selected``: True when every sparse step selected every valid token (:data:`ALL_SELECTED`) or
    every step logged lies inside the warm-up, so that the run trained as dense GRPO; None when no step
    logged the metric."""
    vals = [(int(r["step"]), float(r["mask/selected_frac"])) for r in rows if is_finite(r.get("mask/selected_frac"))]
    sparse = [v for s, v in vals if s >= dense]
    return {"selected_frac": math.fsum(sparse) / len(sparse) if sparse else None, "sparse_steps": len(sparse),
            "dense_steps": int(dense), "steps": len(vals),
            "all_selected": all(v >= ALL_SELECTED for v in sparse) if vals else None}


def selected_everything(method: str, sel: Mapping[str, Any] | None) -> bool:
    """Whether a run of a sparse ``method`` (every method but dense GRPO) selected every valid token on
    every sparse step (:func:`selection`'s ``all_selected``): it trained as dense GRPO did."""
    return method not in DENSE_METHODS and bool((sel or {}).get("all_selected"))


def selection_warning(name: str, method: str, sels: Mapping[Any, Mapping[str, Any] | None]) -> str | None:
    """The warning line for ``name`` (a method, group or arm) of selector ``method`` whose runs (seed ->
    :func:`selection`) include one that selected everything (:func:`selected_everything`); None if none did."""
    seeds = [s for s, sel in sels.items() if selected_everything(method, sel)]
    if not seeds:
        return None
    which = [sels[s] for s in seeds]
    in_warmup = [s for s, sel in zip(seeds, which) if not sel["sparse_steps"]]
    how = []
    if len(in_warmup) < len(seeds):
        n = sum(sel["sparse_steps"] for sel in which if sel["sparse_steps"])
        how.append(f"selected fraction 1.000 on every one of its {n} sparse step(s)")
    if in_warmup:
        how.append("every RL step inside the dense warm-up (rl.selector.warmup_steps "
                   + ", ".join(sorted({str(sels[s]["dense_steps"]) for s in in_warmup})) + ")")
    return (f"WARNING: {name} ({method}) selected every valid token in {len(seeds)} of {len(sels)} run(s) (seed "
            f"{', '.join(map(str, seeds))}: {'; '.join(how)}): it trained as dense GRPO, so its numbers repeat "
            "GRPO's and its curves hide GRPO's; it is no evidence about the method.")


def run_result(rl_rows: Sequence[Mapping[str, Any]], final_evals: Mapping[str, Any] | None,
               target: float, wall_s: float | None = None, *, dense: int = 0) -> dict[str, Any]:
    """One run's numbers: final P@k (averaged over benchmarks, and per benchmark), steps to target, final
    H1 / H2, and what it selected (:func:`selection` after ``dense`` warm-up steps)."""
    return {"pass": {f"pass@{k}": v for k, v in pass_at_k(final_evals).items()},
            "pass_by_bench": {b: {f"pass@{k}": v for k, v in vals.items()}
                              for b, vals in pass_by_benchmark(final_evals).items()},
            "steps_to_target": steps_to_target(rl_rows, target),
            "H1": tail_mean(rl_rows, "stats/H1_mean"), "H2": tail_mean(rl_rows, "stats/H2_mean"),
            "reward": tail_mean(rl_rows, "reward/mean"), "selection": selection(rl_rows, dense),
            "steps": len(rl_rows), "wall_s": wall_s}


def aggregate_group(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Mean +- sd over a group's seeds. ``steps_to_target`` averages the seeds that reached the target
    (``n`` of them out of ``n_runs``); its mean is None ("never") when none did."""
    names = sorted({k for r in runs for k in r["pass"]}, key=lambda k: int(k[5:]))
    benches = sorted({b for r in runs for b in r.get("pass_by_bench", {})})
    by_bench = {b: {k: mean_sd(r.get("pass_by_bench", {}).get(b, {}).get(k) for r in runs) for k in names}
                for b in benches}
    return {"pass": {k: mean_sd(r["pass"].get(k) for r in runs) for k in names}, "pass_by_bench": by_bench,
            "steps_to_target": {**mean_sd(r["steps_to_target"] for r in runs), "n_runs": len(runs)},
            "H1": mean_sd(r["H1"] for r in runs), "H2": mean_sd(r["H2"] for r in runs),
            "reward": mean_sd(r["reward"] for r in runs),
            "selected_frac": mean_sd((r.get("selection") or {}).get("selected_frac") for r in runs),
            "wall_s": mean_sd(r["wall_s"] for r in runs)}


def _fmt(stat: Mapping[str, Any], digits: int = 3) -> str:
    if stat.get("mean") is None:
        return "n/a"
    s = f"{stat['mean']:.{digits}f}"
    return s + (f" ± {stat['sd']:.{digits}f}" if stat.get("sd") is not None else "")


def _fmt_steps(stat: Mapping[str, Any]) -> str:
    if not stat.get("n_runs"):
        return "n/a"
    if stat.get("mean") is None:
        return "never"
    s = _fmt(stat, 1)
    return s if stat["n"] == stat["n_runs"] else f"{s} ({stat['n']}/{stat['n_runs']} reached)"


def _group_selections(g: Mapping[str, Any]) -> dict[str, Mapping[str, Any] | None]:
    """seed -> the run's :func:`selection` (None in a results.json written before it was recorded)."""
    return {seed: r.get("selection") for seed, r in (g.get("runs") or {}).items()}


def _fmt_selected(g: Mapping[str, Any]) -> str:
    """The table cell of a group's selected fraction: mean ± sd over seeds, marked when a sparse method's
    run selected every token, or 'warm-up only' when no run got past its warm-up."""
    sels = _group_selections(g)
    cell = _fmt(g.get("selected_frac") or {})
    if cell == "n/a" and any(sel and sel["steps"] for sel in sels.values()):
        return "n/a (warm-up only)"
    return cell + all_selected_mark(g.get("method", ""), sels)


def all_selected_mark(method: str, sels: Mapping[Any, Mapping[str, Any] | None]) -> str:
    """`` (all: seed 0, 2)``: the seeds (of seed -> :func:`selection`) whose run of a sparse ``method``
    selected every valid token (:func:`selected_everything`); empty when none did."""
    seeds = [str(s) for s, sel in sels.items() if selected_everything(method, sel)]
    return f" (all: seed {', '.join(seeds)})" if seeds else ""


def selection_warnings(groups: Sequence[Mapping[str, Any]]) -> list[str]:
    """One warning line per group of a sparse method in which a run selected every valid token
    (:func:`selection_warning`): the comparison's table and output print them."""
    lines = [selection_warning(g["group"], g.get("method", ""), _group_selections(g)) for g in groups]
    return [line for line in lines if line]


def format_markdown(results: Mapping[str, Any]) -> str:
    """The results table (one row per group, plus the warm start's P@k) and the caveat under it. With
    several eval benchmarks the table has a P@k column per benchmark (b1, b2, ... named under it) after
    the average over benchmarks."""
    groups = results["groups"]
    ws = results.get("warmstart") or {}
    ws_by_bench = pass_by_benchmark(ws.get("eval"))
    ks = sorted({int(k[5:]) for g in groups for k in g["pass"]} | set(pass_at_k(ws.get("eval"))))
    benches = list(results.get("eval", []))
    if len(benches) < 2:
        benches = []
    target = results["target_reward"]
    head = (["method", "rho", "seeds"] + [f"P@{k}" for k in ks]
            + [f"P@{k} b{i + 1}" for i in range(len(benches)) for k in ks]
            + [f"steps to reward ≥ {target:g} (MA{results.get('window', MA_WINDOW)})",
               "selected (after warm-up)", f"H1 (last {LAST_STEPS})", f"H2 (last {LAST_STEPS})", "wall s / run"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    if ws.get("eval"):
        p = pass_at_k(ws["eval"])
        cells = ["warm start (SFT)", "", ""] + [f"{p[k]:.3f}" if k in p else "n/a" for k in ks]
        cells += [f"{ws_by_bench[b][k]:.3f}" if k in ws_by_bench.get(b, {}) else "n/a" for b in benches for k in ks]
        lines.append("| " + " | ".join(cells + ["", "", "", "", f"{ws['wall_s']:.0f}" if ws.get("wall_s") else ""])
                     + " |")
    for g in groups:
        rho = "" if g["rho"] is None else f"{g['rho']:g}"
        cells = [g["group"], rho, str(len(g["seeds"]))]
        cells += [_fmt(g["pass"].get(f"pass@{k}", {})) for k in ks]
        cells += [_fmt(g.get("pass_by_bench", {}).get(b, {}).get(f"pass@{k}", {})) for b in benches for k in ks]
        cells += [_fmt_steps(g["steps_to_target"]), _fmt_selected(g), _fmt(g["H1"]), _fmt(g["H2"]),
                  _fmt(g["wall_s"], 0)]
        lines.append("| " + " | ".join(cells) + " |")
    n = max((len(g["seeds"]) for g in groups), default=0)
    warnings = selection_warnings(groups)
    warmed = ", ".join(selectors_where([g.get("method", "") for g in groups], warmup=True))
    notes = ([""] + [f"**{w}**" for w in warnings] if warnings else []) + [
        "",
        f"Mean ± sample sd over {n} seed(s) (no sd with one seed). P@k: final evaluation on data.eval "
        f"({', '.join(results.get('eval', [])) or 'none'}), averaged over benchmarks"
        + ("; " + "; ".join(f"b{i + 1} = {b}" for i, b in enumerate(benches)) if benches else "") + ". Steps to "
        f"target: the first RL step whose trailing {results.get('window', MA_WINDOW)}-step moving average of "
        f"reward/mean reaches {target:g}, averaged over the seeds that reached it. Selected: mask/selected_frac "
        "(selected / valid tokens) averaged over each run's RL steps after the selector's warm-up "
        f"(rl.selector.warmup_steps, for {warmed}); (all: seed s): the run of a "
        "sparse "
        "method at seed s selected every valid token on every such step (or had none), i.e. trained as dense "
        "GRPO. H1 / H2: stats/H1_mean, "
        f"stats/H2_mean averaged over the last {LAST_STEPS} RL steps.",
        "",
        f"**{INCONCLUSIVE}**",
    ]
    return "\n".join(lines + notes) + "\n"


# --------------------------------------------------------------------------------------------------
# Reading runs from disk
# --------------------------------------------------------------------------------------------------
def has_checkpoint(run_dir: Path) -> bool:
    ck = run_dir / "checkpoints"
    return ck.is_dir() and any(d.is_dir() and d.name.isdigit() for d in ck.iterdir())


def read_run(run_dir: Path, target: float, dense: int = 0) -> dict[str, Any] | None:
    """A finished run's numbers (None until its ``summary.json`` says it finished); ``dense``: its warm-up
    steps (:func:`dense_steps`)."""
    if not run_finished(run_dir):
        return None
    summary = read_summary(run_dir)
    metrics = run_dir / "metrics.jsonl"
    rl_rows = read_metrics(metrics, "rl") if metrics.is_file() else []
    evals = summary.get("eval_final")
    if not evals and metrics.is_file():  # fall back on the last logged evaluation
        ev_rows = read_metrics(metrics, "eval")
        evals = ev_rows[-1] if ev_rows else None
    return run_result(rl_rows, evals, target, summary.get("wall_s"), dense=dense)


def collect(specs: Sequence[RunSpec], target: float, dense: Mapping[str, int] | None = None,
            ) -> tuple[list[dict[str, Any]], dict[str, dict[int, list]]]:
    """(groups for results.json, {group: {seed: RL metrics rows}} for the plots) from the finished runs.
    ``dense``: run name -> its warm-up steps (:func:`dense_steps`; missing: 0)."""
    groups: dict[str, dict[str, Any]] = {}
    curves: dict[str, dict[int, list]] = {}
    for spec in specs:
        g = groups.setdefault(spec.group, {"group": spec.group, "method": spec.method, "rho": spec.rho,
                                           "overrides": dict(spec.overrides), "seeds": [], "runs": {}})
        res = read_run(spec.run_dir, target, (dense or {}).get(spec.name, 0))
        if res is None:
            continue
        g["seeds"].append(spec.seed)
        g["runs"][str(spec.seed)] = {"run_dir": str(spec.run_dir), **res}
        curves.setdefault(spec.group, {})[spec.seed] = read_metrics(spec.run_dir / "metrics.jsonl", "rl") \
            if (spec.run_dir / "metrics.jsonl").is_file() else []
    return [{**g, **aggregate_group(list(g["runs"].values()))} for g in groups.values()], curves


def plot_groups(curves: Mapping[str, Mapping[int, Sequence[Mapping[str, Any]]]], key: str, out_png: Path, *,
                title: str, target: float | None = None) -> Path:
    """Per group: the mean over seeds of ``key`` vs step, with the min-max band over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(6.0, 3.8))
    for i, (group, seeds) in enumerate(curves.items()):
        by_step: dict[int, list[float]] = {}
        for rows in seeds.values():
            for r in rows:
                if is_finite(r.get(key)):
                    by_step.setdefault(int(r["step"]), []).append(float(r[key]))
        if not by_step:
            continue
        steps = sorted(by_step)
        mean = [sum(by_step[s]) / len(by_step[s]) for s in steps]
        color = f"C{i % 10}"
        ax.plot(steps, mean, lw=1.4, color=color, label=f"{group} (n={len(seeds)})")
        if len(seeds) > 1:
            ax.fill_between(steps, [min(by_step[s]) for s in steps], [max(by_step[s]) for s in steps],
                            color=color, alpha=0.18, lw=0)
    if target is not None:
        ax.axhline(target, color="0.4", ls="--", lw=0.8, label=f"target {target:g}")
    ax.set_title(f"{title}: mean over seeds, band = min-max", fontsize=10)
    ax.set_xlabel("RL step")
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_ylabel(key)
    ax.grid(alpha=0.3)
    if ax.has_data():
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png
