# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 03 · Reading an experiment record
#
# A pre-registered experiment (`ict-jax compare --plan PLAN.yaml`, docs/experiments.md) keeps everything it
# measured in one JSON file, `experiment.json`: the plan, the machine, every run's per-step metrics and final
# evaluation, per arm mean ± sd and the paired differences against each reference arm. Its report is rebuilt
# from that file alone. This notebook reads a record with nothing but `json`, then:
#
# * recomputes the primary outcome of every run from its per-step rows, and the paired differences with
#   `ict_jax.experiments.stats`, and checks them against the values the record holds;
# * plots any logged metric against the RL step, one colour per arm, each seed a thin line;
# * shows where a step's time went (sampling, rewards, the update);
# * plans a next design: the minimum detectable effect against the number of seeds.
#
# Point `ICT_NB_RECORD` at a record (`docs/experiments/<name>/experiment.json`) and `ICT_NB_METRIC` at the
# metric to plot (default: the primary outcome's). Without them the notebook reads the committed record of
# the pilot (docs/results.md): ICT, random-10 % and dense GRPO on the real Qwen2.5-Coder-0.5B-Instruct with
# LoRA, 2 seeds x 40 RL steps each, paired by seed.

# %%
import ict_jax  # noqa: F401  (first: on a machine without a TPU it selects the CPU before JAX starts)

import json
import math
import os
import sys
import tempfile
from pathlib import Path

import matplotlib

if "ipykernel" not in sys.modules:
    matplotlib.use("Agg")  # run as a script: no display, write PNGs only
import matplotlib.pyplot as plt
import numpy as np

from ict_jax.experiments.stats import mean_sd, minimum_detectable_effect, paired_differences


def legends_clear(fig) -> None:
    """Every legend of ``fig`` lies outside the plotting area of every axes (it covers no curve)."""
    fig.canvas.draw()
    for leg in [a.get_legend() for a in fig.axes if a.get_legend() is not None] + list(fig.legends):
        box = leg.get_window_extent()
        assert not any(box.overlaps(a.get_window_extent()) for a in fig.axes), "a legend covers a plot"


def find_record() -> Path:
    """The pilot's committed record, found from the repository (the notebook's folder or the cwd)."""
    rel = Path("docs/experiments/pilot_0p5b_lora/experiment.json")
    for root in (Path(globals().get("__file__", "")).resolve().parent.parent, Path.cwd(), Path.cwd().parent):
        if (root / rel).is_file():
            return root / rel
    raise FileNotFoundError(f"{rel} not found: run from the repository, or set ICT_NB_RECORD")


# ---- parameters ----
RECORD = Path(os.environ.get("ICT_NB_RECORD") or find_record())
OUT_DIR = os.environ.get("ICT_NB_OUT") or tempfile.mkdtemp(prefix="ict_nb03_")
os.makedirs(OUT_DIR, exist_ok=True)
print("record  ->", RECORD)
print("figures ->", OUT_DIR)

# %% [markdown]
# ## The plan and where the experiment stands

# %%
record = json.loads(RECORD.read_text())
plan = record["plan"]
arms, seeds, steps = list(plan["arms"]), [str(s) for s in plan["seeds"]], plan["steps"]
status, design = record["status"], record["design"]
print(f"{record['name']}: {len(arms)} arms x {len(seeds)} seed{'s' if len(seeds) != 1 else ''}, {steps} RL steps a run; "
      f"{status['steps_done']}/{status['steps_planned']} steps, {status['runs_finished']}/{status['runs']} runs "
      f"finished{' (complete)' if status['complete'] else ''}")
for arm, spec in plan["arms"].items():
    print(f"  {arm:>10}: {spec['method']:<6} {spec.get('overrides') or ''}")
print("reference arms:", ", ".join(plan["reference_arms"]))
print("primary outcome:", plan["primary_outcome"]["name"], f"({plan['primary_outcome']['metric']})")
print("design:", f"MDE {design['mde']:.3f} at sd {design['assumed_sd']} over {design['n_seeds']} seeds"
      if design.get("mde") is not None else design.get("note", "no test"))
print("stopping rule:", plan["stopping_rule"])

# %% [markdown]
# ## The primary outcome, recomputed from the per-step rows
#
# A run's value of a training outcome is the mean of its metric over RL steps *first..last* (1-based; the
# rows' `step` is 0-based), and nothing until every one of those steps is logged. The paired difference of
# an arm and a reference arm is taken seed by seed: arms of one seed share their prompts, sampler keys and
# initial weights. Both are computed here from the rows and checked against the record.


# %%
def rows_of(name: str) -> dict[int, dict]:
    return {int(r["step"]): r for r in record["runs"][name]["metrics"]}


def finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def run_value(name: str, metric: str, first: int, last: int) -> float | None:
    rows = rows_of(name)
    if any(s not in rows for s in range(first - 1, last)):
        return None  # not measured yet
    vals = [float(rows[s][metric]) for s in range(first - 1, last) if finite(rows[s].get(metric))]
    return math.fsum(vals) / len(vals) if vals else None


def run_name(arm: str, seed: str) -> str:
    return f"{arm}_s{seed}"


primary = plan["primary_outcome"]
first, last = primary["steps"]
values = {arm: {s: run_value(run_name(arm, s), primary["metric"], first, last) for s in seeds} for arm in arms}
held = next(o for o in record["outcomes"] if o["primary"])
for arm in arms:
    for s in seeds:
        mine, theirs = values[arm][s], held["per_arm"][arm]["values"][s]
        assert (mine is None and theirs is None) or math.isclose(mine, theirs, rel_tol=1e-12), (arm, s)
print(f"{primary['name']}: per run (recomputed = recorded)")
print(f"{'arm':>10} " + " ".join(f"{'seed ' + s:>9}" for s in seeds) + f" {'mean':>8} {'sd':>8}")
for arm in arms:
    ms = mean_sd(values[arm].values())
    cells = " ".join(f"{v:>9.4f}" if v is not None else f"{'n/a':>9}" for v in values[arm].values())
    print(f"{arm:>10} {cells} {ms['mean'] if ms['mean'] is not None else float('nan'):>8.4f} "
          + (f"{ms['sd']:>8.4f}" if ms["sd"] is not None else f"{'n/a':>8}"))

print("\npaired by seed: arm - reference")
for ref in plan["reference_arms"]:
    for arm in arms:
        if arm == ref:
            continue
        d = paired_differences(values[arm], values[ref])
        rec = next(p for p in held["paired"] if p["arm"] == arm and p["reference"] == ref)
        assert d["n"] == rec["n"] and (d["mean"] is None or math.isclose(d["mean"], rec["mean"], rel_tol=1e-12))
        if d["n"] == 0:
            print(f"{arm:>10} - {ref}: no seed with both values yet")
            continue
        more = (f" ± {d['sd']:.4f} (sd of the differences), t {d['t']:.2f}, df {d['df']}, p {d['p']:.3f}"
                if d["t"] is not None else " (one pair or no spread: no test)")
        print(f"{arm:>10} - {ref}: {d['mean']:+.4f}{more} over {d['n']} seed{'s' if d['n'] != 1 else ''}")

# %% [markdown]
# ## A metric against the RL step
#
# One colour per arm; each seed a thin line and, with two or more seeds, their mean a thick one. The shaded
# band marks the primary outcome's steps.

# %%
METRIC = os.environ.get("ICT_NB_METRIC") or primary["metric"]
colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
fig, ax = plt.subplots(figsize=(7.5, 4))
for i, arm in enumerate(arms):
    curves = []
    for s in seeds:
        rows = rows_of(run_name(arm, s)) if run_name(arm, s) in record["runs"] else {}
        pts = sorted((k + 1, float(r[METRIC])) for k, r in rows.items() if finite(r.get(METRIC)))
        if pts:
            x, y = zip(*pts)
            ax.plot(x, y, color=colours[i % len(colours)], lw=0.8, alpha=0.6,
                    label=arm if len(seeds) == 1 else None)
            curves.append(dict(pts))
    if len(curves) > 1:
        common = sorted(set.intersection(*(set(c) for c in curves)))
        ax.plot(common, [np.mean([c[k] for c in curves]) for k in common], color=colours[i % len(colours)], lw=2.2,
                label=f"{arm} (mean of {len(curves)} seeds)")
ax.axvspan(first - 0.5, last + 0.5, color="0.9", zorder=0)
ax.set_xlabel("RL step")
ax.set_ylabel(METRIC)
ax.set_title(f"{record['name']}: {METRIC}", fontsize=9)
fig.legend(*ax.get_legend_handles_labels(), fontsize=8, loc="lower center", ncol=min(4, len(arms)), frameon=False)
fig.tight_layout(rect=(0, 0.08, 1, 1))  # the legend below the plot, never over a curve
legends_clear(fig)
fig.savefig(os.path.join(OUT_DIR, "metric_by_arm.png"), dpi=110)

# %% [markdown]
# ## Where a step's time went
#
# Each RL step logs the seconds it spent sampling the responses (`time/sample_s`), scoring them
# (`time/rewards_s`) and updating the policy (`time/update_s`). The mean over each run's steps:

# %%
PARTS = (("time/sample_s", "sampling"), ("time/rewards_s", "rewards"), ("time/update_s", "update"))
names = [n for n in record["runs"] if record["runs"][n]["metrics"]]
means = {n: [float(np.mean([r[k] for r in record["runs"][n]["metrics"] if finite(r.get(k))] or [0.0]))
             for k, _ in PARTS] for n in names}
print(f"{'run':>16} " + " ".join(f"{label:>9}" for _, label in PARTS) + f" {'step':>9}")
for n in names:
    print(f"{n:>16} " + " ".join(f"{v:>8.1f}s" for v in means[n]) + f" {sum(means[n]):>8.1f}s")
fig, ax = plt.subplots(figsize=(7.5, 0.5 * len(names) + 1.6))
left = np.zeros(len(names))
for j, (_, label) in enumerate(PARTS):
    widths = np.array([means[n][j] for n in names])
    ax.barh(names, widths, left=left, label=label)
    left += widths
ax.set_xlabel("seconds per RL step (mean over the run's steps)")
fig.legend(*ax.get_legend_handles_labels(), fontsize=8, loc="lower center", ncol=3, frameon=False)
fig.tight_layout(rect=(0, 0.12, 1, 1))
legends_clear(fig)
fig.savefig(os.path.join(OUT_DIR, "step_time.png"), dpi=110)

# %% [markdown]
# ## Planning a next design
#
# The minimum detectable effect of a paired design (two-sided paired t test, level 0.05, power 0.8) against
# its number of seeds, for a few sds of the paired differences: the design's assumed sd, and the sd
# observed between this experiment's pairs where it has one. An sd observed over a handful of seeds is itself
# uncertain (the report's "Planning a next experiment" gives its interval).

# %%
sds = {}
if design.get("assumed_sd"):
    sds[f"assumed sd {design['assumed_sd']}"] = float(design["assumed_sd"])
for p in held["paired"]:
    if p["sd"] is not None:
        sds.setdefault(f"observed sd {p['sd']:.3f} ({p['arm']} - {p['reference']})", float(p["sd"]))
for sd in (0.02, 0.05):
    if sd not in sds.values():
        sds[f"sd {sd}"] = sd
ns = list(range(2, 31))
fig, ax = plt.subplots(figsize=(7.5, 4))
for label, sd in sds.items():
    ax.plot(ns, [minimum_detectable_effect(sd, n) for n in ns], lw=1.2, label=label)
    print(f"{label:>44}: MDE {minimum_detectable_effect(sd, 2):.3f} at 2 seeds, "
          f"{minimum_detectable_effect(sd, 10):.3f} at 10, {minimum_detectable_effect(sd, 30):.3f} at 30")
ax.set_yscale("log")
ax.set_xlabel("seeds (pairs)")
ax.set_ylabel("minimum detectable effect")
ax.set_title(f"{primary['name']} ({primary['metric']}), paired t, level 0.05, power 0.8", fontsize=9)
fig.legend(*ax.get_legend_handles_labels(), fontsize=8, loc="lower center", ncol=2, frameon=False)
fig.tight_layout(rect=(0, 0.16, 1, 1))
legends_clear(fig)
fig.savefig(os.path.join(OUT_DIR, "mde_by_seeds.png"), dpi=110)
if matplotlib.get_backend().lower() == "agg":
    plt.close("all")
print(sorted(f for f in os.listdir(OUT_DIR) if f.endswith(".png")))
