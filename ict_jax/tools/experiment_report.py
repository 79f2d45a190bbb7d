"""The report of a pre-registered experiment: ``report.md`` and its figures, built from ``experiment.json``
alone (:func:`write_report`), so the report never says what the record does not hold and
``ict-jax compare --plan P --report`` rebuilds it byte for byte."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

from ict_jax.heartbeat import duration
from ict_jax.tools.compare_report import all_selected_mark, pass_at_k, selected_everything, selection_warning
from ict_jax.tools.experiment_stats import mean_sd, minimum_detectable_effect, sd_interval

__all__ = ["FIGURES", "REPORT_FILE", "format_report", "write_report", "plot_metric", "selection_warnings"]

REPORT_FILE = "report.md"
#: figure file -> (metrics key, title): every arm's curve per seed against the RL step
FIGURES = {
    "reward.png": ("reward/mean", "training reward (mean over the step's responses)"),
    "selected_frac.png": ("mask/selected_frac", "selected fraction of the valid tokens"),
    "H1.png": ("stats/H1_mean", "Shannon entropy H1 (mean over valid tokens)"),
    "u_at_ceiling.png": ("stats/u_at_ceiling", "u at its ceiling (share of valid tokens)"),
}
#: seeds of a next paired design whose minimum detectable effect the report gives from the observed sd
PLANNING_SEEDS = (5, 10, 20)


def _num(v: Any, digits: int = 3) -> str:
    return "n/a" if v is None else f"{v:.{digits}f}"


def _p(v: Any) -> str:
    return "n/a" if v is None else f"{v:.3g}"


def _mean_sd(stat: Mapping[str, Any], digits: int = 3) -> str:
    if stat.get("mean") is None:
        return "n/a"
    s = f"{stat['mean']:.{digits}f}"
    if stat.get("sd") is not None:
        s += f" ± {stat['sd']:.{digits}f}"
    return s + f" (n {stat['n']})"


def _table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in rows]


def _value(v: Any) -> str:
    return "`" + str(v).replace("|", "\\|") + "`"


def _outcome_section(o: Mapping[str, Any], arms: Sequence[str], seeds: Sequence[int]) -> list[str]:
    lines = [f"### {'Primary' if o['primary'] else 'Secondary'}: {o['name']}", ""]
    head = ["arm"] + [f"seed {s}" for s in seeds] + ["mean ± sd (n)"]
    rows = [[a] + [_num(o["per_arm"][a]["values"].get(str(s))) for s in seeds] + [_mean_sd(o["per_arm"][a])]
            for a in arms]
    lines += _table(head, rows) + [""]
    if o["paired"]:
        head = ["arm − reference", "differences by seed", "mean ± sd", "t", "df", "p (two-sided)"]
        rows = []
        for d in o["paired"]:
            by_seed = ", ".join(f"s{s}: {x:+.3f}" for s, x in zip(d["seeds"], d["diffs"])) or "none yet"
            ms = "n/a" if d["mean"] is None else f"{d['mean']:+.3f}" + (f" ± {d['sd']:.3f}" if d["sd"] is not None
                                                                        else "")
            rows.append([f"{d['arm']} − {d['reference']}", by_seed, ms, _num(d["t"], 2),
                         "n/a" if d["df"] is None else str(d["df"]), _p(d["p"])])
        lines += _table(head, rows) + [""]
    return lines


def _arm_selections(record: Mapping[str, Any], arm: str) -> dict[int, Mapping[str, Any] | None]:
    """seed -> the arm's run's selection (None in a record written before it was recorded)."""
    return {r["seed"]: r.get("selection") for r in record["runs"].values() if r["arm"] == arm}


def selection_warnings(record: Mapping[str, Any]) -> list[str]:
    """One warning line per arm of a sparse method (every method but dense GRPO) with a run that selected
    every valid token on every RL step after its warm-up, or never got past the warm-up
    (:func:`~ict_jax.tools.compare_report.selection_warning`): the report and the command print them."""
    lines = [selection_warning(arm, spec["method"], _arm_selections(record, arm))
             for arm, spec in record["plan"]["arms"].items()]
    return [line for line in lines if line]


def _selected_cell(sel: Mapping[str, Any] | None, method: str) -> str:
    """One run's selected fraction after its warm-up and the steps it is over, for the runs table."""
    if not sel or not sel.get("steps"):
        return "n/a"
    if not sel["sparse_steps"]:
        return f"n/a (all {sel['steps']} in warm-up)"
    cell = f"{sel['selected_frac']:.3f} ({sel['sparse_steps']})"
    return cell + (" (all)" if selected_everything(method, sel) else "")


def format_report(record: Mapping[str, Any], figures: Sequence[str] = tuple(FIGURES)) -> str:
    """The Markdown report of ``record`` (``experiment.json``), naming ``figures`` (files beside it)."""
    plan, status, design = record["plan"], record["status"], record["design"]
    arms, seeds = list(plan["arms"]), plan["seeds"]
    git = record.get("plan_git") or {}
    lines = [f"# Experiment `{record['name']}`", ""]
    if plan.get("description"):
        lines += [plan["description"].strip(), ""]
    state = "complete" if status["complete"] else "in progress"
    lines += [
        f"- **Status: {state}.** {status['runs_finished']} of {status['runs']} runs finished; "
        f"{status['steps_done']} of {status['steps_planned']} RL steps done.",
        f"- Plan: `{record['plan_file']}`, sha256 `{record['plan_sha256'][:16]}...`, "
        + _plan_git(git) + ".",
        f"- Base config: `{plan['config']}`; {len(arms)} arms x {len(seeds)} seeds ({', '.join(map(str, seeds))}), "
        f"{plan['steps']} RL steps each, in chunks of {plan['chunk_steps']}; arms of one seed share the data order, "
        "the sampler keys and the initial weights, so differences are paired by seed.",
        f"- Stopping rule: {plan['stopping_rule'].strip()}",
    ]
    lines += [f"- **{w}**" for w in selection_warnings(record)]
    lines += [
        "",
        "## Arms",
        "",
    ]
    lines += _table(["arm", "method", "overrides", "description"],
                    [[a, s["method"], ", ".join(f"{k}={_value(v)}" for k, v in s["overrides"].items()) or "none",
                      s.get("description") or ""] for a, s in plan["arms"].items()])
    common = plan.get("overrides") or {}
    lines += ["", "Every arm: " + (", ".join(f"{k}={_value(v)}" for k, v in common.items()) or "the base config")
              + ". Config keys that differ between the arms: "
              + (", ".join(f"`{k}`" for k in record.get("arm_differences", {})) or "none") + ".", ""]
    lines += _branch_lines(record)
    lines += ["## Design", ""]
    n = design["n_seeds"]
    if design["mde"] is not None:
        lines += [f"Paired by seed, n = {n} (df {design['df']}). With an assumed sd of the paired differences of "
                  f"{design['assumed_sd']:g} in the primary outcome, a two-sided paired t test at level "
                  f"{design['alpha']:g} detects a true mean difference of **{design['mde']:.3f}** with power "
                  f"{design['power']:g} (the minimum detectable effect, fixed in the plan before any result); "
                  "smaller differences cannot be told apart from noise by this design."]
    else:
        lines += [f"Paired by seed, n = {n}" + (f" (df {design['df']})." if design["df"] else
                                                 ": one seed gives no test of the differences.")
                  + " The plan states no assumed sd, so no minimum detectable effect."]
    if design.get("note"):
        lines += ["", design["note"].strip()]
    lines += ["", "## Outcomes", ""]
    lines += [f"Reference arms: {', '.join(plan['reference_arms'])}. Each outcome per run, mean ± sample sd over "
              "seeds per arm, and each arm minus each reference arm paired by seed: the mean and sd of the "
              "differences, the paired t statistic, its degrees of freedom and two-sided p. n/a: not measured "
              "yet (the run has not reached the outcome's steps), or undefined (one pair, or no spread).", ""]
    for o in record["outcomes"]:
        lines += _outcome_section(o, arms, seeds)
    lines += _evaluation_lines(record, arms)
    lines += _planning_lines(record)
    lines += ["", "## Curves", "", "Every run's per-step value: one thin line per seed, the arm's mean over its seeds "
              "thick (where every seed has the step).", ""]
    for f in figures:
        key, title = FIGURES[f]
        lines += [f"![{title} ({key})]({f})", ""]
    lines += _runs_lines(record) + _attempt_lines(record) + _environment_lines(record)
    if plan.get("calibration") is not None:
        lines += ["", "## Calibration (before the plan was fixed)", "", "```", _yaml_text(plan["calibration"]),
                  "```"]
    return "\n".join(lines).rstrip() + "\n"


def _evaluation_lines(record: Mapping[str, Any], arms: Sequence[str]) -> list[str]:
    """The held-out evaluation table: the base model and every arm's final P@k (mean ± sd over seeds)."""
    lines: list[str] = []
    lines += ["## Held-out evaluation", ""]
    ks = sorted({k for r in record["runs"].values() for k in pass_at_k(r.get("eval_final"))}
                | set(pass_at_k((record.get("base") or {}).get("eval_final"))))
    if ks:
        rows = []
        base = record.get("base")
        if base is not None:
            p = pass_at_k(base.get("eval_final"))
            rows.append([f"base (seed {base['seed']})"] + [_num(p.get(k)) for k in ks] + [""])
        for a in arms:
            vals = [pass_at_k(r.get("eval_final")) for r in record["runs"].values() if r["arm"] == a]
            cells = []
            for k in ks:
                xs = [v[k] for v in vals if k in v]
                cells.append(_mean_sd(mean_sd(xs)))
            sels = _arm_selections(record, a)
            cell = _mean_sd(mean_sd((sel or {}).get("selected_frac") for sel in sels.values()))
            rows.append([a] + cells + [cell + all_selected_mark(record["plan"]["arms"][a]["method"], sels)])
        lines += _table(["model"] + [f"P@{k}" for k in ks] + ["selected (after warm-up)"], rows)
        lines += ["", "P@k averaged over the evaluation's benchmarks: " + ", ".join(
            f"`{b}`" for b in _benchmarks(record)) + "; mean ± sd over seeds. Selected: each run's "
            "mask/selected_frac (selected / valid tokens) averaged over its RL steps after the selector's warm-up "
            "(the runs table below), mean ± sd over seeds; (all: seed s): the run of a sparse method at seed s "
            "selected every valid token on every such step (or had none), i.e. trained as dense GRPO."]
    else:
        lines += ["No final evaluation recorded yet."]
    return lines


def _planning_lines(record: Mapping[str, Any]) -> list[str]:
    """What the primary outcome's observed spread says about a next design: per paired comparison the sd of
    the differences, its 95 % interval, and the minimum detectable effect at :data:`PLANNING_SEEDS` seeds."""
    design = record["design"]
    alpha, power = design["alpha"], design["power"]
    primary = next(o for o in record["outcomes"] if o["primary"])
    lines = ["", "## Planning a next experiment", ""]
    if design["df"] is None:
        return lines + ["One seed: no paired differences, so no spread to plan a next design from."]
    lo, hi = sd_interval(1.0, design["df"])
    lines += [f"From the primary outcome ({primary['name']}): each comparison's sample sd of the paired differences "
              "(df = pairs - 1), its two-sided 95 % confidence interval (normal differences), and the minimum "
              f"detectable effect of a paired design with n seeds at level {alpha:g} and power {power:g}, computed "
              f"with the observed sd and with the interval's upper end. With this design's {design['n_seeds']} "
              f"seeds (df {design['df']}) the interval's ends are a factor of {hi / lo:.1f} apart: the fewer the "
              "pairs, the weaker a guide the observed sd.", ""]
    head = (["arm − reference", "sd of the differences (df)", "95 % interval of the sd"]
            + [f"MDE, {n} seeds" for n in PLANNING_SEEDS] + [f"MDE, {PLANNING_SEEDS[-1]} seeds, upper sd"])
    rows = []
    for d in primary["paired"]:
        if d["sd"] is None:
            rows.append([f"{d['arm']} − {d['reference']}", "n/a"] + ["n/a"] * (len(head) - 2))
            continue
        lo, hi = sd_interval(d["sd"], d["df"])
        rows.append([f"{d['arm']} − {d['reference']}", f"{d['sd']:.3f} ({d['df']})", f"{lo:.3f} – {hi:.3f}"]
                    + [f"{minimum_detectable_effect(d['sd'], n, alpha, power):.3f}" for n in PLANNING_SEEDS]
                    + [f"{minimum_detectable_effect(hi, PLANNING_SEEDS[-1], alpha, power):.3f}"])
    lines += _table(head, rows)
    lines += ["", "n/a: fewer than two pairs with the outcome yet, or no spread."]
    return lines


def _branch_lines(record: Mapping[str, Any]) -> list[str]:
    """The branched arms (none: no line): which parent each starts from, and each run's starting checkpoint."""
    arms = {a: s["branch"] for a, s in record["plan"]["arms"].items() if s.get("branch")}
    if not arms:
        return []
    lines = ["Branched arms share their parent's first steps exactly (docs/experiments.md \"Branching\"): "
             + "; ".join(f"`{a}` starts from `{b['from']}`'s checkpoint at step {b['step']} (same seed) and trains "
                         f"steps {b['step'] + 1}-{record['plan']['steps']}" for a, b in arms.items()) + ".", ""]
    for name, r in record["runs"].items():
        b = r.get("branch")
        if b is not None:
            lines.append(f"- `{name}`: " + (f"from `{b['checkpoint']}` (sha256 `{b['checkpoint_sha256'][:16]}...`), "
                                            f"branched {b['forked']}" if b.get("forked") else "not branched yet")
                         + _rederived_text(b.get("rederived")))
    return lines + [""]


def _rederived_text(rederived: Mapping[str, Any] | None, against: str = "the parent's record") -> str:
    """A run whose branch point was trained again (its snapshot lost with a working folder)."""
    if not rederived:
        return ""
    c = rederived["comparison"]
    where = rederived.get("recorded")
    return (f"; the branch point was lost with its working folder and trained again (`{rederived['run_dir']}`): "
            f"{c['steps_equal']} of {c['steps_compared']} steps equal to {against} bitwise, "
            f"{c['steps_same_samples']} with the same samples"
            + (f" (the rows of its {where})" if where and where != "run" else ""))


def _runs_lines(record: Mapping[str, Any]) -> list[str]:
    """Every run: status, steps, chunks, wall time, final evaluation."""
    plan = record["plan"]
    lines: list[str] = []
    lines += ["## Runs", ""]
    rows = []
    for name, r in record["runs"].items():
        p = pass_at_k(r.get("eval_final"))
        wall = sum(float(c.get("wall_s") or 0.0) for c in r["chunks"]) if r["chunks"] else None
        rows.append([name, r["status"], f"{r['steps_done']}/{plan['steps']}", str(len(r["chunks"])),
                     _selected_cell(r.get("selection"), plan["arms"][r["arm"]]["method"]),
                     "n/a" if wall is None else duration(wall),
                     ", ".join(f"P@{k} {v:.3f}" for k, v in p.items()) or "n/a"])
    lines += _table(["run", "status", "steps", "chunks", "selected (sparse steps)", "wall time (chunks)",
                     "final evaluation"], rows)
    lines += ["", "Selected: the mean of mask/selected_frac (selected / valid tokens) over the run's RL steps after "
              "the selector's warm-up (rl.selector.warmup_steps, for ict, random, frequent, selectable), with the "
              "number of those steps; (all): a sparse method selected every valid token on every one of them.",
              "",
              "Wall time: the sum of the run's chunks, each with its model load, compilation and, in the last, "
              "the final evaluation."]
    return lines


def _machine(m: Mapping[str, Any]) -> str:
    """A machine in words from an environment (or any mapping with its cpu, cores and backend)."""
    return f"{m.get('cpu')} ({m.get('cores')} cores, {m.get('backend')})"


def _attempt_lines(record: Mapping[str, Any]) -> list[str]:
    """Runs written back from the record after a lost machine, and every earlier attempt of a run that
    started again from step 0, with how the attempts compare on their common steps."""
    lines: list[str] = []
    for name, r in record["runs"].items():
        if r.get("restored"):
            x = r["restored"]
            lines.append(f"- `{name}`: written back from the record on {x.get('time')} ({x.get('status')}, "
                         f"{x.get('steps_done')} steps; no checkpoint, not run again).")
        for a in r.get("attempts") or []:
            c = a.get("comparison") or {}
            first = c.get("first_difference")
            if not c.get("steps_compared"):
                versus = "no step in common with the run now yet"
            elif first is None:
                versus = f"the run now equals it bitwise on all {c['steps_compared']} common steps"
            else:
                keys = sorted(first["metrics"])
                versus = (f"the run now equals it bitwise on {c['steps_equal']} of {c['steps_compared']} common "
                          f"steps; first difference at step {first['step'] + 1} ({len(keys)} metrics: "
                          + ", ".join(f"`{k}`" for k in keys[:5]) + (", ..." if len(keys) > 5 else "") + ")")
                if "steps_same_samples" in c:
                    parted = c.get("first_sample_difference")
                    versus += (f"; the same samples (reward, length, truncation) on the first {c['steps_same_samples']}"
                               + (f", parting at step {parted + 1}" if parted is not None else ", all of them"))
            lines.append(f"- `{name}`, attempt {a.get('attempt')}: {a.get('steps_done')} steps on "
                         + (", ".join(_machine(m) for m in a.get("machines") or []) or "an unrecorded machine")
                         + ", code " + (", ".join(f"`{c[:12]}`" for c in a.get("commits") or []) or "unrecorded")
                         + f"; lost: {a.get('lost')}; {versus}.")
        if r.get("resumed"):
            x = r["resumed"]
            lines.append(f"- `{name}`: resumed at its branch point, step {x['step']}, from `{x['checkpoint']}` "
                         f"(sha256 `{x['checkpoint_sha256'][:16]}...`) on {x.get('resumed')}"
                         + _rederived_text(x.get("rederived"), "its lost attempt's record")
                         + f"; its evaluations up to step {x['step']} are the attempt's, not run again.")
    if not lines:
        return []
    return ["", "## Earlier attempts", "",
            "Runs whose working folder (checkpoints) was lost with its machine: a finished run is written back "
            "from the record; an unfinished one starts again from step 0 and what it had logged is kept here "
            "(per-step metrics in experiment.json, `runs.<run>.attempts`). Only the run now counts in the "
            "outcomes. Equal bitwise: every logged metric but the timings.", ""] + lines


def _machines_line(record: Mapping[str, Any]) -> list[str]:
    """One line naming every machine the invocations ran on and which invocations (1-based) each ran, when
    there was more than one; none otherwise."""
    by_machine: dict[str, list[int]] = {}
    for i, inv in enumerate(record.get("invocations", []), 1):
        by_machine.setdefault(_machine(inv.get("environment") or {}), []).append(i)
    if len(by_machine) < 2:
        return []
    return ["- Machines: " + "; ".join(f"{m}: invocation{'s' if len(ns) > 1 else ''} {_ranges(ns)}"
                                       for m, ns in by_machine.items()) + "."]


def _ranges(ns: list[int]) -> str:
    """1, 2, 3, 5 -> "1-3, 5"."""
    out: list[str] = []
    for n in ns:
        if out and out[-1].split("-")[-1] == str(n - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{n}"
        else:
            out.append(str(n))
    return ", ".join(out)


def _environment_lines(record: Mapping[str, Any]) -> list[str]:
    """The machine and versions of the first invocation, the machines of all when more than one, and every
    invocation's code commit (and its machine where it is not the first's)."""
    lines: list[str] = []
    lines += ["", "## Environment", ""]
    env = record.get("environment") or {}
    if env:
        v = env.get("versions", {})
        lines += [f"- Machine of the first invocation: {env.get('cpu')}, {env.get('cores')} cores, "
                  f"{env.get('memory_gib')} GiB; {env.get('os')}; Python {env.get('python')}; {env.get('backend')} "
                  f"({env.get('devices')}).",
                  "- Versions: " + ", ".join(f"{k} {x}" for k, x in v.items() if x) + "."]
    lines += _machines_line(record)
    first = _machine(env)
    for inv in record.get("invocations", []):
        c = inv.get("commit")
        here = _machine(inv.get("environment") or {})
        versions = (inv.get("environment") or {}).get("versions") or {}
        changed = [f"{k} {x}" for k, x in versions.items() if x and x != (env.get("versions") or {}).get(k)]
        lines.append(f"- Invocation {inv.get('start')} to {inv.get('end', '?')}: code at "
                     + (f"`{c[:12]}`" + (" with local changes" if inv.get("dirty") else "") if c else "no git commit")
                     + (f", on {here}" if here != first else "")
                     + (f", with {', '.join(changed)}" if changed else "")
                     + (f", order {inv['order']}" if inv.get("order", "chunks") != "chunks" else "")
                     + (f", evaluation batch {inv['eval_batch']} prompts a sampler call" if inv.get("eval_batch")
                        else "")
                     + (", working folder rebuilt from the record" if inv.get("recovered") else "")
                     + f", {inv.get('chunks_done', 0)} chunk(s), stopped: {inv.get('stopped')}.")
    return lines


def _plan_git(git: Mapping[str, Any]) -> str:
    if not git.get("in_git"):
        return "not in a git checkout (nothing proves it preceded the results)"
    if not git.get("commit"):
        return "not committed (run with --uncommitted)"
    return f"committed at `{git['commit'][:12]}`" + ("" if git.get("clean") else
                                                     " but run with uncommitted changes (--uncommitted)")


def _benchmarks(record: Mapping[str, Any]) -> list[str]:
    names: set[str] = set()
    for r in list(record["runs"].values()) + ([record["base"]] if record.get("base") else []):
        for key in (r.get("eval_final") or {}):
            if key.startswith("eval/"):
                names.add(key[len("eval/"):].rpartition("/")[0])
    return sorted(names)


def _yaml_text(obj: Any) -> str:
    import yaml  # only where text is written

    return yaml.safe_dump(obj, sort_keys=False, allow_unicode=True, width=110).rstrip()


def plot_metric(record: Mapping[str, Any], key: str, title: str, out_png: Path) -> Path:
    """Every arm's ``key`` against the RL step (1-based): a thin line per seed, the mean over seeds thick."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    arms = list(record["plan"]["arms"])
    n_seeds = len(record["plan"]["seeds"])
    for i, arm in enumerate(arms):
        color = f"C{i % 10}"
        by_step: dict[int, list[float]] = {}
        for r in record["runs"].values():
            if r["arm"] != arm:
                continue
            pts = [(int(row["step"]) + 1, float(row[key])) for row in r["metrics"]
                   if isinstance(row.get(key), (int, float)) and not isinstance(row.get(key), bool)]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], color=color, lw=0.7, alpha=0.55)
            for s, v in pts:
                by_step.setdefault(s, []).append(v)
        full = sorted(s for s, v in by_step.items() if len(v) == n_seeds)
        if full:
            ax.plot(full, [sum(by_step[s]) / n_seeds for s in full], color=color, lw=2.0, label=arm)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("RL step")
    ax.set_ylabel(key)
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_png, dpi=100, metadata={"Software": None})
    plt.close(fig)
    return out_png


def write_report(record: Mapping[str, Any], folder: str | Path) -> Path:
    """``report.md`` and :data:`FIGURES` in ``folder`` from ``record`` alone; returns the report's path."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for png, (key, title) in FIGURES.items():
        plot_metric(record, key, title, folder / png)
    path = folder / REPORT_FILE
    path.write_text(format_report(record), encoding="utf-8")
    return path
