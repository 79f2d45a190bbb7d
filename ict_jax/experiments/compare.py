"""The method comparison (``ict-jax compare``): every selector method x seed from one shared warm start,
then a table and plots. A front end of the experiment runner (:mod:`ict_jax.experiments.runner`): it runs
the warm start, writes a plan of the RL runs and runs it with :func:`~ict_jax.experiments.runner.run_experiment`.

Layout under ``out`` (``--out``)::

    compare_config.json   the config of the comparison: a later invocation must use the same one
    warmstart/            the SFT warm start (``train.sft_steps`` of the config), run once and reused
      sft_model/          its HF checkpoint: ``model.path`` of every RL run
      warmstart.json      SFT metrics, the warm start's pass@k on ``data.eval``, wall time
    rl_config.yaml        the config every RL run starts from: the comparison's, with ``model.path`` = the
                          warm start's ``sft_model`` (or the config's own) and ``train.sft_steps: 0``
    plan.yaml             the generated plan: one arm per group (``group`` = the method, or ``ict_rho<r>``
                          for the sparsity ablation), the seeds, ``train.steps``; not a pre-registration
    experiment/           the runner's folder (``out`` and ``record`` of the plan, docs/experiments.md):
      runs/<group>_s<seed>/  one RL run
      plan.json invocations.jsonl chunks.jsonl experiment.json report.md ...   the runner's record
    results.json          per group: final P@k, steps to the target reward, the selected fraction after the
                          warm-up, final H1 / H2, wall time
    results.md            the same as a Markdown table
    reward.png H1.png H2.png   per group: mean curve over seeds vs step, min-max band

Every run differs from the others only in ``rl.selector.method`` (and ``rl.selector.rho``, or a variant's
overrides) and ``seed``: the same data, warm start and hyperparameters. The comparison resumes as the
runner does: a finished or diverged run is skipped, any other run continues from its last checkpoint;
the table is always rebuilt from what is on disk.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import jax

from ict_jax.config import Config, ConfigError
from ict_jax.config_load import load_config
from ict_jax.experiments.compare_report import (
    DENSE_METHODS,
    INCONCLUSIVE,
    LAST_STEPS,
    MA_WINDOW,
    RunSpec,
    collect,
    dense_steps,
    format_markdown,
    is_finite,
    plot_groups,
)
from ict_jax.experiments.record import PLAN_FILE, RECORD_FILE, run_status
from ict_jax.experiments.runner import run_experiment
from ict_jax.outputs import check_output_dir, has_entries
from ict_jax.rl.selectors import ALIASES, registered_selectors
from ict_jax.train.plugins import import_plugins
from ict_jax.train.trainer import Trainer

#: Named variants accepted in ``methods`` beside the selector methods: a method with config overrides.
#: ``ict_norm_valid``: ICT's tokens with GRPO's denominators (``normalize_over: valid``), without the 1/rho
#: up-weighting of ``normalize_over: selected``: under AdamW close to a constant rescaling of the gradient,
#: which Adam cancels, so it changes how responses weigh against each other, not the step size
#: (docs/method.md §4).
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "ict_norm_valid": ("ict", {"rl.loss.normalize_over": "valid"}),
}


def known_methods() -> tuple[str, ...]:
    """Methods accepted in ``methods``: the registered selectors (``rl.selectors``, plugins' included) and
    their aliases (``grpo`` = ``dense``), then the variants."""
    return (*registered_selectors(), *ALIASES, *VARIANTS)


#: The default methods: every method once (``grpo`` standing for ``dense``), ICT first.
DEFAULT_METHODS: tuple[str, ...] = ("ict", "grpo", "entropy", "stapo", "random")
#: The default seeds: 0, 1, 2.
DEFAULT_SEEDS: tuple[int, ...] = (0, 1, 2)
#: curve name -> (metrics key, png file)
PLOTS = {"reward": ("reward/mean", "reward.png"), "H1": ("stats/H1_mean", "H1.png"),
         "H2": ("stats/H2_mean", "H2.png")}
#: The runner's folder in ``out`` (the plan's ``out`` and ``record``), the plan and the RL runs' base config.
EXPERIMENT, PLAN, RL_CONFIG = "experiment", "plan.yaml", "rl_config.yaml"


# --------------------------------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------------------------------


def group_name(method: str, rho: float | None) -> str:
    return method if rho is None else f"{method}_rho{rho:g}"


def check_methods(methods: Sequence[str]) -> list[str]:
    """The methods as a list: each a registered selector, an alias or a variant (:func:`known_methods`), each once."""
    if isinstance(methods, str):
        raise ConfigError(f"methods: {methods!r}: expected a sequence of method names, like ['ict', 'grpo']")
    methods, known = list(methods), known_methods()
    if not methods:
        raise ConfigError("methods: empty; name at least one of " + ", ".join(known))
    for m in methods:
        if m not in known:
            raise ConfigError(f"methods: {m!r} is not a selector method; allowed: {', '.join(known)}")
    if len(set(methods)) != len(methods):
        raise ConfigError(f"methods: {methods} names a method twice")
    return methods


def check_seeds(seeds: Sequence[int]) -> list[int]:
    """The seeds as a list of distinct non-negative integers (at least one)."""
    if isinstance(seeds, (str, int)):
        raise ConfigError(f"seeds: {seeds!r}: expected a sequence of integers, like [0, 1, 2]")
    seeds = list(seeds)
    if not seeds or any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in seeds) \
            or len(set(seeds)) != len(seeds):
        raise ConfigError(f"seeds: {seeds}: expected distinct non-negative integers, at least one")
    return seeds


def check_rhos(rhos: Sequence[float] | None) -> list[float] | None:
    """The sparsity ablation's fractions as a list of distinct floats, or None (no ablation). Their range
    is checked as ``rl.selector.rho`` when each run's config is built."""
    if rhos is None:
        return None
    if isinstance(rhos, str):
        raise ConfigError(f"rhos: {rhos!r}: expected a sequence of fractions, like [0.05, 0.1]")
    rhos = [float(r) for r in rhos]
    if not rhos or len(set(rhos)) != len(rhos):
        raise ConfigError(f"rhos: {rhos}: expected distinct fractions like [0.05, 0.1, 0.2]")
    return rhos


def plan_runs(methods: Sequence[str], seeds: Sequence[int], out: Path,
              rhos: Sequence[float] | None = None) -> list[RunSpec]:
    """Run groups in the order of ``methods``; with ``rhos`` the ``ict`` group becomes one group per rho
    (the paper's sparsity ablation: ICT only). Seeds vary fastest within a group; run directories
    ``<out>/experiment/runs/<group>_s<seed>``. A comparison has at least two groups (the runner's plans
    compare arms)."""
    if rhos and "ict" not in methods:
        raise ConfigError("rhos: the sparsity ablation is for ICT only (ict is not among the methods)")
    specs = []
    for m in methods:
        method, over = VARIANTS.get(m, (m, {}))
        for rho in (rhos if (rhos and m == "ict") else [None]):
            g = group_name(m, rho)
            specs += [RunSpec(g, method, rho, s, out / EXPERIMENT / "runs" / f"{g}_s{s}",
                              tuple(sorted(over.items()))) for s in seeds]
    if len({s.group for s in specs}) < 2:
        raise ConfigError(f"methods: {list(methods)}: a comparison needs at least two run groups (two methods, "
                          "or ict with two rhos)")
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


def has_results(out: Path) -> bool:
    """Whether the comparison in ``out`` has produced anything a later invocation would reuse: the warm
    start's ``sft_model``, or a run that logged at least one step (its ``metrics.jsonl``)."""
    if (out / "warmstart" / "sft_model").is_dir():
        return True
    return any(p.is_file() and p.stat().st_size > 0 for p in out.glob("**/metrics.jsonl"))


def check_same_config(cfg: Config, out: Path) -> None:
    """An existing comparison in ``out`` must have been made with the same config (``run_dir`` aside):
    its finished runs are reused, so mixing configs would mix results silently. A record left by an
    invocation that failed before any run produced anything (:func:`has_results`) guards nothing: it is
    replaced (the corrected rerun of a comparison that failed at start-up is not refused)."""
    path = out / "compare_config.json"
    if not path.is_file() or not has_results(out):
        return
    old = _flatten(json.loads(path.read_text()))
    new = _flatten(json.loads(json.dumps(cfg.to_dict())))
    diff = sorted(k for k in set(old) | set(new) if k != "run_dir" and old.get(k) != new.get(k))
    if diff:
        raise ConfigError(f"out: {str(out)!r} holds a comparison made with another config (differs in "
                          f"{', '.join(diff[:6])}{', ...' if len(diff) > 6 else ''}): use another folder")


def run_config(cfg: Config, spec: RunSpec, model_path: str, tokenizer: str) -> Config:
    """The config of run ``spec``: ``cfg`` from the shared start, RL only, the run's method, rho, variant
    overrides, seed and run directory; what the plan of :func:`write_plan` gives the run (tested)."""
    return cfg.replace(**{**_rl_start(model_path, tokenizer), "seed": spec.seed, "rl.selector.method": spec.method,
                          "run_dir": str(spec.run_dir), **_arm_overrides(spec)})


def _rl_start(model_path: str, tokenizer: str) -> dict[str, Any]:
    """The overrides that make the config every run starts from: RL only, from the shared start's model."""
    return {"model.path": model_path, "model.tokenizer": tokenizer, "train.sft_steps": 0}


def _arm_overrides(spec: RunSpec) -> dict[str, Any]:
    """What the run's group sets beyond its method: its rho (a rho ablation's group) and variant overrides."""
    return {**({"rl.selector.rho": spec.rho} if spec.rho is not None else {}), **dict(spec.overrides)}


# --------------------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------------------
def _primary() -> bool:
    return jax.process_index() == 0


def _say(text: str) -> None:
    if not _primary():
        return
    print(f"[compare] {text}", file=sys.stderr, flush=True)


def warm_start(cfg: Config, out: Path, *, progress: bool = True, say: Callable[[str], None] = _say) -> dict[str, Any]:
    """SFT once into ``<out>/warmstart`` (reused when its ``sft_model`` exists); returns warmstart.json."""
    ws_dir = out / "warmstart"
    info_path = ws_dir / "warmstart.json"
    if (ws_dir / "sft_model" / "config.json").is_file():
        say(f"warm start: reusing {ws_dir / 'sft_model'}")
        return json.loads(info_path.read_text()) if info_path.is_file() else {"run_dir": str(ws_dir)}
    say(f"warm start: {cfg.train.sft_steps} SFT steps -> {ws_dir / 'sft_model'}")
    t0 = time.perf_counter()
    # resume=True only lets a warm start that stopped before writing sft_model start again in place
    with Trainer(cfg.replace(run_dir=str(ws_dir)), resume=has_entries(ws_dir), progress=progress) as trainer:
        sft = trainer.sft()
        evals = trainer.evaluate(0) if cfg.data.eval else {}
    info = {"run_dir": str(ws_dir), "sft": sft, "eval": evals, "wall_s": time.perf_counter() - t0}
    if _primary():
        info_path.write_text(json.dumps(info, indent=2))
    if evals:
        say("warm start: " + ", ".join(f"{k}={v:.3f}" for k, v in evals.items()))
    return info


def write_plan(cfg: Config, specs: Sequence[RunSpec], out: Path, model_path: str, tokenizer: str) -> Path:
    """Write the plan of the comparison's RL runs, ``<out>/plan.yaml``, and the config it names,
    ``<out>/rl_config.yaml`` (module docstring); returns the plan's path. Each run's config is then
    :func:`run_config`'s. The plan is generated, not pre-registered: when it changed (other methods, seeds or
    rhos under the same config, :func:`check_same_config`), the runner's record of the former plan is removed
    with it (``plan.json``, ``experiment.json``: rebuilt from the run directories), so that the runs already
    done are kept and only the new ones train."""
    import yaml  # only where text is written

    arms: dict[str, dict[str, Any]] = {}
    for s in specs:
        over = _arm_overrides(s)
        arms.setdefault(s.group, {"method": s.method, **({"overrides": over} if over else {})})
    steps, exp = cfg.train.steps, str(out.absolute() / EXPERIMENT)
    plan = {"name": "compare", "description": "Generated by ict-jax compare (not a pre-registration): every group "
            f"from one warm start ({model_path}).", "config": RL_CONFIG, "arms": arms,
            "seeds": list(dict.fromkeys(s.seed for s in specs)), "steps": steps,
            "reference_arms": [next((a for a in arms if a in DENSE_METHODS), next(iter(arms)))],
            "primary_outcome": {"metric": "reward/mean", "steps": [1, steps]},
            "stopping_rule": "every run trains all its steps; no early stopping", "out": exp, "record": exp}
    text, path = yaml.safe_dump(plan, sort_keys=False), out / PLAN
    if path.is_file() and path.read_text() != text:
        for name in (PLAN_FILE, RECORD_FILE):
            (out / EXPERIMENT / name).unlink(missing_ok=True)
    base = cfg.replace(**_rl_start(model_path, tokenizer))
    out.mkdir(parents=True, exist_ok=True)
    for name, body in ((RL_CONFIG, yaml.safe_dump(base.to_dict(), sort_keys=False)), (PLAN, text)):
        if not (out / name).is_file() or (out / name).read_text() != body:  # every process: out may be its own
            (out / name).write_text(body)
    return path


def _what(before: str, after: str) -> str:
    """What this invocation did to a run, from its status before (:func:`~ict_jax.experiments.record.run_status`)
    and after: skipped / started / resumed / diverged."""
    if before in ("finished", "diverged"):
        return "skipped"
    return "diverged" if after == "diverged" else "started" if before == "pending" else "resumed"


def run_comparison(config: str | Path | Config, *, methods: Sequence[str] | None = None,
                   seeds: Sequence[int] = DEFAULT_SEEDS, rhos: Sequence[float] | None = None,
                   out: str | Path | None = None, target_reward: float = 0.5, overrides: Sequence[str] = (),
                   progress: bool = True, say: Callable[[str], None] = _say) -> dict[str, Any]:
    """Run (or resume) the comparison and write ``results.json``, ``results.md`` and the plots to
    ``out``; returns the results. ``config``: a YAML path (with ``overrides``) or a :class:`Config`;
    ``methods``: selector methods or :data:`VARIANTS` (None: :data:`DEFAULT_METHODS`); ``seeds``: one run
    per method and seed; ``rhos``: ICT's sparsity ablation, one ICT group per rho (None: none).
    Bad values raise :class:`~ict_jax.config.ConfigError` naming the parameter or the config key."""
    cfg = config if isinstance(config, Config) else load_config(config, overrides)
    import_plugins(cfg.plugins)  # the selectors they register are methods too
    methods = check_methods(DEFAULT_METHODS if methods is None else methods)
    seeds, rhos = check_seeds(seeds), check_rhos(rhos)
    if not is_finite(target_reward):
        raise ConfigError(f"target_reward: {target_reward!r}: expected a number")
    if out is None:
        out = "runs/compare_" + ("config" if isinstance(config, Config) else Path(config).stem)
    out = check_output_dir(out, "out")  # every run writes under it: checked before any work
    specs = plan_runs(methods, seeds, out.absolute(), rhos)
    model_path, tokenizer = start_model(cfg, out)
    run_cfgs = [run_config(cfg, s, model_path, tokenizer) for s in specs]  # validates every run up front
    check_same_config(cfg, out)
    say(f"{len(specs)} runs ({len(methods)} method(s), seeds {seeds}"
        + (f", ict rho {', '.join(f'{r:g}' for r in rhos)}" if rhos else "") + f") -> {out}")
    t0 = time.perf_counter()
    if jax.process_index() == 0 and not has_results(out):  # this invocation's config is the one on record
        out.mkdir(parents=True, exist_ok=True)
        (out / "compare_config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
    ws = warm_start(cfg, out, progress=progress, say=say) if cfg.train.sft_steps > 0 else {}
    plan = write_plan(cfg, specs, out, model_path, tokenizer)
    before = {s.name: run_status(s.run_dir, cfg.train.steps) for s in specs}
    record = run_experiment(plan, allow_uncommitted=True, progress=progress, say=say)  # prints the warnings too
    done = {s.name: _what(before[s.name], record["runs"][s.name]["status"]) for s in specs}
    groups, curves = collect(specs, target_reward, {s.name: dense_steps(s.method, rc.rl.selector.warmup_steps)
                                                    for s, rc in zip(specs, run_cfgs)})
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
