"""``ict-jax compare``: every selector method x seed from one shared warm start, then a table and plots.

Layout under ``--out``::

    compare_config.json   the config of the comparison: a later invocation must use the same one
    warmstart/            the SFT warm start (``train.sft_steps`` of the config), run once and reused
      sft_model/          its HF checkpoint: ``model.path`` of every RL run
      warmstart.json      SFT metrics, the warm start's pass@k on ``data.eval``, wall time
    runs/<group>_s<seed>/ one RL run (``group`` = the method, or ``ict_rho<r>`` for the sparsity ablation)
    results.json          per group: final P@k, steps to the target reward, final H1 / H2, wall time
    results.md            the same as a Markdown table
    reward.png H1.png H2.png   per group: mean curve over seeds vs step, min-max band

Every run differs from the others only in ``rl.selector.method`` (and ``rl.selector.rho``) and ``seed``:
the same data, warm start and hyperparameters. The comparison is resumable run by run: a run with a
``summary.json`` is skipped, a run with a finished checkpoint is resumed from it, any other run is
(re)started; the table is always rebuilt from what is on disk.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from ict_jax.config import Config, ConfigError, Method, load_config

#: Methods accepted by ``--methods`` (``grpo`` = ``dense``).
METHODS: tuple[str, ...] = typing.get_args(Method)
DEFAULT_METHODS = "ict,grpo,entropy,stapo,random"
#: Moving-average window of ``reward/mean`` for "steps to target", and the number of final RL steps
#: that H1 / H2 are averaged over.
MA_WINDOW = 5
LAST_STEPS = 5
#: curve name -> (metrics key, png file)
PLOTS = {"reward": ("reward/mean", "reward.png"), "H1": ("stats/H1_mean", "H1.png"),
         "H2": ("stats/H2_mean", "H2.png")}
INCONCLUSIVE = ("Differences between methods within one standard deviation (over seeds) are inconclusive.")


# --------------------------------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RunSpec:
    group: str  # "ict", "grpo", ..., or "ict_rho0.05"
    method: str
    rho: float | None  # None = the method's default (METHOD §2)
    seed: int
    run_dir: Path

    @property
    def name(self) -> str:
        return f"{self.group}_s{self.seed}"


def group_name(method: str, rho: float | None) -> str:
    return method if rho is None else f"{method}_rho{rho:g}"


def parse_methods(text: str) -> list[str]:
    methods = [m.strip() for m in text.split(",") if m.strip()]
    if not methods:
        raise ConfigError("--methods: empty; name at least one of " + ", ".join(METHODS))
    for m in methods:
        if m not in METHODS:
            raise ConfigError(f"--methods: {m!r} is not a selector method; allowed: {', '.join(METHODS)}")
    if len(set(methods)) != len(methods):
        raise ConfigError(f"--methods: {text!r} names a method twice")
    return methods


def parse_seeds(text: str | int) -> list[int]:
    """``3`` -> seeds 0, 1, 2; ``0,5,7`` -> those seeds."""
    s = str(text).strip()
    try:
        if "," in s:
            seeds = [int(x) for x in s.split(",") if x.strip()]
        else:
            n = int(s)
            if n < 1:
                raise ValueError
            seeds = list(range(n))
    except ValueError:
        raise ConfigError(f"--seeds {text!r}: expected a count N >= 1 (seeds 0..N-1) or a list like 0,1,2") from None
    if not seeds or len(set(seeds)) != len(seeds) or min(seeds) < 0:
        raise ConfigError(f"--seeds {text!r}: expected distinct non-negative seeds")
    return seeds


def parse_rhos(text: str | None) -> list[float] | None:
    if text is None or not str(text).strip():
        return None
    try:
        rhos = [float(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"--rho {text!r}: expected fractions like 0.05,0.1,0.2") from None
    if not rhos or len(set(rhos)) != len(rhos):
        raise ConfigError(f"--rho {text!r}: expected distinct fractions like 0.05,0.1,0.2")
    return rhos


def plan_runs(methods: Sequence[str], seeds: Sequence[int], out: Path,
              rhos: Sequence[float] | None = None) -> list[RunSpec]:
    """Run groups in the order of ``methods``; with ``rhos`` the ``ict`` group becomes one group per rho
    (the paper's sparsity ablation: ICT only). Seeds vary fastest within a group."""
    if rhos and "ict" not in methods:
        raise ConfigError("--rho: the sparsity ablation is for ICT only; add ict to --methods")
    specs = []
    for m in methods:
        for rho in (rhos if (rhos and m == "ict") else [None]):
            g = group_name(m, rho)
            specs += [RunSpec(g, m, rho, s, out / "runs" / f"{g}_s{s}") for s in seeds]
    return specs


def start_model(cfg: Config, out: Path) -> tuple[str, str]:
    """(model.path, model.tokenizer) every RL run starts from: the shared warm start's ``sft_model``
    (its tokenizer: the config's ``model.tokenizer``, else its ``model.path``, else ``char``), or the
    config's own ``model.path`` when ``train.sft_steps`` is 0."""
    tok = cfg.model.tokenizer or cfg.model.path or "char"
    if cfg.train.sft_steps > 0:
        return str((out / "warmstart" / "sft_model").absolute()), tok
    if cfg.model.path:
        return cfg.model.path, tok
    raise ConfigError("train.sft_steps: 0 and no model.path: compare needs a shared starting point "
                      "(an SFT warm start, train.sft_steps > 0, or a model.path)")


def _flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, Mapping):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def check_same_config(cfg: Config, out: Path) -> None:
    """An existing comparison in ``out`` must have been made with the same config (``run_dir`` aside):
    its finished runs are reused, so mixing configs would mix results silently."""
    path = out / "compare_config.json"
    if not path.is_file():
        return
    old = _flatten(json.loads(path.read_text()))
    new = _flatten(json.loads(json.dumps(cfg.to_dict())))
    diff = sorted(k for k in set(old) | set(new) if k != "run_dir" and old.get(k) != new.get(k))
    if diff:
        raise ConfigError(f"--out {str(out)!r} holds a comparison made with another config (differs in "
                          f"{', '.join(diff[:6])}{', ...' if len(diff) > 6 else ''}): use another --out")


def run_config(cfg: Config, spec: RunSpec, model_path: str, tokenizer: str) -> Config:
    over: dict[str, Any] = {"model.path": model_path, "model.tokenizer": tokenizer, "train.sft_steps": 0,
                            "seed": spec.seed, "rl.selector.method": spec.method, "run_dir": str(spec.run_dir)}
    if spec.rho is not None:
        over["rl.selector.rho"] = spec.rho
    return cfg.replace(**over)


# --------------------------------------------------------------------------------------------------
# Per-run numbers and their aggregation (pure functions of metrics rows / summaries)
# --------------------------------------------------------------------------------------------------
def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def steps_to_target(rows: Sequence[Mapping[str, Any]], target: float, window: int = MA_WINDOW,
                    key: str = "reward/mean") -> int | None:
    """The number of RL steps until the trailing moving average of ``key`` (over ``window`` steps; over
    all steps so far while fewer than ``window`` exist) first reaches ``target``: the 1-based position
    of that step. None if it never does."""
    vals: list[float] = []
    for r in sorted(rows, key=lambda r: r["step"]):
        v = r.get(key)
        if not _finite(v):
            continue
        vals.append(float(v))
        tail = vals[-window:]
        if sum(tail) / len(tail) >= target:
            return int(r["step"]) + 1
    return None


def tail_mean(rows: Sequence[Mapping[str, Any]], key: str, n: int = LAST_STEPS) -> float | None:
    """Mean of ``key`` over the last ``n`` RL steps that logged it (None if none did)."""
    vals = [float(r[key]) for r in sorted(rows, key=lambda r: r["step"]) if _finite(r.get(key))]
    return sum(vals[-n:]) / len(vals[-n:]) if vals else None


def pass_at_k(evals: Mapping[str, Any] | None) -> dict[int, float]:
    """``{"eval/<bench>/pass@k": v}`` -> ``{k: mean of v over benchmarks}``."""
    per_k: dict[int, list[float]] = {}
    for key, v in (evals or {}).items():
        if not key.startswith("eval/") or not _finite(v):
            continue
        _bench, _, metric = key[len("eval/"):].rpartition("/")
        if metric.startswith("pass@") and metric[5:].isdigit():
            per_k.setdefault(int(metric[5:]), []).append(float(v))
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


def run_result(rl_rows: Sequence[Mapping[str, Any]], final_evals: Mapping[str, Any] | None,
               target: float, wall_s: float | None = None) -> dict[str, Any]:
    """One run's numbers: final P@k (averaged over benchmarks), steps to target, final H1 / H2."""
    return {"pass": {f"pass@{k}": v for k, v in pass_at_k(final_evals).items()},
            "steps_to_target": steps_to_target(rl_rows, target),
            "H1": tail_mean(rl_rows, "stats/H1_mean"), "H2": tail_mean(rl_rows, "stats/H2_mean"),
            "reward": tail_mean(rl_rows, "reward/mean"), "steps": len(rl_rows), "wall_s": wall_s}


def aggregate_group(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Mean +- sd over a group's seeds. ``steps_to_target`` averages the seeds that reached the target
    (``n`` of them out of ``n_runs``); its mean is None ("never") when none did."""
    names = sorted({k for r in runs for k in r["pass"]}, key=lambda k: int(k[5:]))
    return {"pass": {k: mean_sd(r["pass"].get(k) for r in runs) for k in names},
            "steps_to_target": {**mean_sd(r["steps_to_target"] for r in runs), "n_runs": len(runs)},
            "H1": mean_sd(r["H1"] for r in runs), "H2": mean_sd(r["H2"] for r in runs),
            "reward": mean_sd(r["reward"] for r in runs), "wall_s": mean_sd(r["wall_s"] for r in runs)}


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


def format_markdown(results: Mapping[str, Any]) -> str:
    """The results table (one row per group, plus the warm start's P@k) and the caveat under it."""
    groups = results["groups"]
    ks = sorted({int(k[5:]) for g in groups for k in g["pass"]}
                | set(pass_at_k(results.get("warmstart", {}).get("eval"))))
    target = results["target_reward"]
    head = (["method", "rho", "seeds"] + [f"P@{k}" for k in ks]
            + [f"steps to reward ≥ {target:g} (MA{results.get('window', MA_WINDOW)})",
               f"H1 (last {LAST_STEPS})", f"H2 (last {LAST_STEPS})", "wall s / run"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    ws = results.get("warmstart") or {}
    if ws.get("eval"):
        p = pass_at_k(ws["eval"])
        lines.append("| " + " | ".join(["warm start (SFT)", "", ""] + [f"{p[k]:.3f}" if k in p else "n/a" for k in ks]
                                       + ["", "", "", f"{ws['wall_s']:.0f}" if ws.get("wall_s") else ""]) + " |")
    for g in groups:
        rho = "" if g["rho"] is None else f"{g['rho']:g}"
        cells = [g["group"], rho, str(len(g["seeds"]))]
        cells += [_fmt(g["pass"].get(f"pass@{k}", {})) for k in ks]
        cells += [_fmt_steps(g["steps_to_target"]), _fmt(g["H1"]), _fmt(g["H2"]), _fmt(g["wall_s"], 0)]
        lines.append("| " + " | ".join(cells) + " |")
    n = max((len(g["seeds"]) for g in groups), default=0)
    notes = [
        "",
        f"Mean ± sample sd over {n} seed(s) (no sd with one seed). P@k: final evaluation on data.eval "
        f"({', '.join(results.get('eval', [])) or 'none'}), averaged over benchmarks. Steps to target: the "
        f"first RL step whose trailing {results.get('window', MA_WINDOW)}-step moving average of reward/mean "
        f"reaches {target:g}, averaged over the seeds that reached it. H1 / H2: stats/H1_mean, stats/H2_mean "
        f"averaged over the last {LAST_STEPS} RL steps.",
        "",
        f"**{INCONCLUSIVE}**",
    ]
    return "\n".join(lines + notes) + "\n"


# --------------------------------------------------------------------------------------------------
# Reading runs from disk
# --------------------------------------------------------------------------------------------------
def _has_checkpoint(run_dir: Path) -> bool:
    ck = run_dir / "checkpoints"
    return ck.is_dir() and any(d.is_dir() and d.name.isdigit() for d in ck.iterdir())


def read_run(run_dir: Path, target: float) -> dict[str, Any] | None:
    """A finished run's numbers (None while it has no ``summary.json``)."""
    from ict_jax.run_log import read_metrics

    summary_path = run_dir / "summary.json"
    if not summary_path.is_file():
        return None
    summary = json.loads(summary_path.read_text())
    metrics = run_dir / "metrics.jsonl"
    rl_rows = read_metrics(metrics, "rl") if metrics.is_file() else []
    evals = summary.get("eval_final")
    if not evals and metrics.is_file():  # fall back on the last logged evaluation
        ev_rows = read_metrics(metrics, "eval")
        evals = ev_rows[-1] if ev_rows else None
    return run_result(rl_rows, evals, target, summary.get("wall_s"))


def collect(specs: Sequence[RunSpec], target: float) -> tuple[list[dict[str, Any]], dict[str, dict[int, list]]]:
    """(groups for results.json, {group: {seed: RL metrics rows}} for the plots) from the finished runs."""
    from ict_jax.run_log import read_metrics

    groups: dict[str, dict[str, Any]] = {}
    curves: dict[str, dict[int, list]] = {}
    for spec in specs:
        g = groups.setdefault(spec.group, {"group": spec.group, "method": spec.method, "rho": spec.rho,
                                           "seeds": [], "runs": {}})
        res = read_run(spec.run_dir, target)
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
                if _finite(r.get(key)):
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


# --------------------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------------------
def _primary() -> bool:
    import jax

    return jax.process_index() == 0


def _say(text: str) -> None:
    if not _primary():
        return
    print(f"[compare] {text}", file=sys.stderr, flush=True)


def warm_start(cfg: Config, out: Path, *, progress: bool = True, say: Callable[[str], None] = _say) -> dict[str, Any]:
    """SFT once into ``<out>/warmstart`` (reused when its ``sft_model`` exists); returns warmstart.json."""
    from ict_jax.trainer import Trainer

    ws_dir = out / "warmstart"
    info_path = ws_dir / "warmstart.json"
    if (ws_dir / "sft_model" / "config.json").is_file():
        say(f"warm start: reusing {ws_dir / 'sft_model'}")
        return json.loads(info_path.read_text()) if info_path.is_file() else {"run_dir": str(ws_dir)}
    say(f"warm start: {cfg.train.sft_steps} SFT steps -> {ws_dir / 'sft_model'}")
    t0 = time.perf_counter()
    # resume=True only lets a warm start that stopped before writing sft_model start again in place
    with Trainer(cfg.replace(run_dir=str(ws_dir)), resume=ws_dir.exists(), progress=progress) as trainer:
        sft = trainer.sft()
        evals = trainer.evaluate(0) if cfg.data.eval else {}
    info = {"run_dir": str(ws_dir), "sft": sft, "eval": evals, "wall_s": time.perf_counter() - t0}
    if _primary():
        info_path.write_text(json.dumps(info, indent=2))
    if evals:
        say("warm start: " + ", ".join(f"{k}={v:.3f}" for k, v in evals.items()))
    return info


def run_one(cfg: Config, spec: RunSpec, *, progress: bool = True, say: Callable[[str], None] = _say) -> str:
    """Train one run unless it is finished; returns what was done: skipped / resumed / started / diverged."""
    from ict_jax.trainer import Trainer, TrainingDiverged

    d = spec.run_dir
    status_path = d / "compare_status.json"
    if (d / "summary.json").is_file():
        say(f"{spec.name}: skipped (finished: {d / 'summary.json'})")
        return "skipped"
    if status_path.is_file():
        say(f"{spec.name}: skipped ({json.loads(status_path.read_text()).get('status')}: {status_path})")
        return "skipped"
    if _has_checkpoint(d):
        what = "resumed"
        say(f"{spec.name}: resuming from its last checkpoint in {d / 'checkpoints'}")
    elif d.exists() and any(d.iterdir()):
        what = "restarted"
        say(f"{spec.name}: restarting (an earlier attempt stopped before its first checkpoint)")
    else:
        what = "started"
        say(f"{spec.name}: method={spec.method}" + (f" rho={spec.rho:g}" if spec.rho is not None else "")
            + f" seed={spec.seed} -> {d}")
    try:
        with Trainer(cfg, resume=what != "started", progress=progress) as trainer:
            summary = trainer.train()
    except TrainingDiverged as e:
        if _primary():
            d.mkdir(parents=True, exist_ok=True)
            status_path.write_text(json.dumps({"status": "diverged", "error": str(e)}, indent=2))
        say(f"{spec.name}: diverged ({e}); left out of the table")
        return "diverged"
    p = pass_at_k(summary.get("eval_final"))
    say(f"{spec.name}: done in {summary.get('wall_s', 0):.0f} s"
        + ("".join(f", P@{k}={v:.3f}" for k, v in p.items())))
    return what


def run_comparison(config: str | Path | Config, *, methods: Sequence[str] | str = DEFAULT_METHODS,
                   seeds: Sequence[int] | int | str = 3, rhos: Sequence[float] | str | None = None,
                   out: str | Path | None = None, target_reward: float = 0.5, overrides: Sequence[str] = (),
                   progress: bool = True, say: Callable[[str], None] = _say) -> dict[str, Any]:
    """Run (or resume) the comparison and write ``results.json``, ``results.md`` and the plots to
    ``out``; returns the results. ``config``: a YAML path (with ``overrides``) or a :class:`Config`."""
    import jax

    cfg = config if isinstance(config, Config) else load_config(config, overrides)
    methods = parse_methods(methods) if isinstance(methods, str) else parse_methods(",".join(methods))
    seeds = parse_seeds(seeds) if isinstance(seeds, (str, int)) else parse_seeds(",".join(map(str, seeds)))
    rhos = parse_rhos(rhos) if (rhos is None or isinstance(rhos, str)) else parse_rhos(",".join(map(str, rhos)))
    if not _finite(target_reward):
        raise ConfigError(f"--target-reward {target_reward!r}: expected a number")
    if out is None:
        out = "runs/compare_" + ("config" if isinstance(config, Config) else Path(config).stem)
    out = Path(out)
    specs = plan_runs(methods, seeds, out, rhos)
    model_path, tokenizer = start_model(cfg, out)
    run_cfgs = [run_config(cfg, s, model_path, tokenizer) for s in specs]  # validates every run up front
    check_same_config(cfg, out)
    say(f"{len(specs)} runs ({len(methods)} method(s), seeds {seeds}"
        + (f", ict rho {', '.join(f'{r:g}' for r in rhos)}" if rhos else "") + f") -> {out}")
    t0 = time.perf_counter()
    if jax.process_index() == 0 and not (out / "compare_config.json").is_file():
        out.mkdir(parents=True, exist_ok=True)
        (out / "compare_config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
    ws = warm_start(cfg, out, progress=progress, say=say) if cfg.train.sft_steps > 0 else {}
    done: dict[str, str] = {}
    for spec, rc in zip(specs, run_cfgs):
        done[spec.name] = run_one(rc, spec, progress=progress, say=say)
    groups, curves = collect(specs, target_reward)
    results = {
        "config": str(config) if not isinstance(config, Config) else None, "overrides": list(overrides),
        "out": str(out), "methods": methods, "seeds": seeds, "rhos": rhos, "target_reward": target_reward,
        "window": MA_WINDOW, "last_steps": LAST_STEPS, "eval": list(cfg.data.eval),
        "rl_steps": cfg.train.steps, "warmstart": ws, "runs": done, "groups": groups,
        "wall_s_this_invocation": time.perf_counter() - t0, "note": INCONCLUSIVE,
    }
    if jax.process_index() == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(results, indent=2))
        (out / "results.md").write_text(format_markdown(results))
        for title, (key, png) in PLOTS.items():
            plot_groups(curves, key, out / png, title=title, target=target_reward if title == "reward" else None)
    return results


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------
def add_compare_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="YAML config: the warm start and every run's settings")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. train.steps=10")
    p.add_argument("--methods", default=DEFAULT_METHODS, help=f"comma-separated selectors (default {DEFAULT_METHODS})")
    p.add_argument("--seeds", default="3", help="N = seeds 0..N-1, or a list like 0,1,2 (default 3)")
    p.add_argument("--rho", default=None, metavar="R1,R2,...",
                   help="sparsity ablation: one ICT run group per rho (e.g. 0.05,0.1,0.2,0.3)")
    p.add_argument("--out", default=None, help="output folder (default runs/compare_<config name>)")
    p.add_argument("--target-reward", type=float, default=0.5,
                   help=f"steps to reach this {MA_WINDOW}-step moving average of reward/mean (default 0.5)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def compare_main(args: argparse.Namespace) -> int:
    results = run_comparison(args.config, methods=args.methods, seeds=args.seeds, rhos=args.rho, out=args.out,
                             target_reward=args.target_reward, overrides=args.overrides,
                             progress=not args.no_progress)
    import jax

    if jax.process_index() == 0:
        out = Path(results["out"])
        print((out / "results.md").read_text(), end="")
        print(f"\nwrote {out / 'results.md'}, {out / 'results.json'}, "
              + ", ".join(str(out / png) for _, png in PLOTS.values()))
    return 0
