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
# # 02 · Training dynamics: H1 vs H2 vs the selected fraction
#
# Every RL step of `ict-jax train` appends one JSON row of docs/method.md §5 metrics to
# `<run_dir>/metrics.jsonl`; `ict_jax.train.logs.read_metrics` reads them back (the last row of a step wins,
# so a resumed run is read correctly). This notebook plots, step by step:
#
# * the policy's mean Shannon entropy `stats/H1_mean` and Rényi-2 entropy `stats/H2_mean` (the ICT paper
#   tracks both: H2 is the log of the inverse collision probability, "purity");
# * the fraction of response tokens that received gradient, `mask/selected_frac` (1 during ICT's warm-up,
#   then about rho = 0.1);
# * reward and accuracy.
#
# Point `ICT_NB_RUN_DIR` at a run directory (e.g. `runs/demo` after `ict-jax train --config
# configs/demo.yaml`). Without it the notebook trains a very short demo itself (the demo config shrunk to a
# tiny model and a few steps, well under a minute on a laptop) in a temporary directory: the curves of so
# short a run only show the mechanics (warm-up, then the ICT selection), not learning.

# %%
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import matplotlib

if "ipykernel" not in sys.modules:
    matplotlib.use("Agg")  # run as a script: no display, write PNGs only
import matplotlib.pyplot as plt
import numpy as np

from ict_jax.train.logs import read_metrics



def legends_clear(fig) -> None:
    """Every legend of ``fig`` lies outside the plotting area of every axes (it covers no curve)."""
    fig.canvas.draw()
    for leg in [a.get_legend() for a in fig.axes if a.get_legend() is not None] + list(fig.legends):
        box = leg.get_window_extent()
        assert not any(box.overlaps(a.get_window_extent()) for a in fig.axes), "a legend covers a plot"


# ---- parameters ----
RUN_DIR = os.environ.get("ICT_NB_RUN_DIR", "")  # "" = train a short demo run here
DEMO_STEPS = int(os.environ.get("ICT_NB_DEMO_STEPS", "6"))
OUT_DIR = os.environ.get("ICT_NB_OUT") or tempfile.mkdtemp(prefix="ict_nb02_")
os.makedirs(OUT_DIR, exist_ok=True)
print("figures ->", OUT_DIR)


# %% [markdown]
# ## A run's metrics (or a short demo run)

# %%
def find_demo_config() -> Path:
    here = [Path(globals().get("__file__", "")).resolve().parent.parent, Path.cwd(), Path.cwd().parent]
    for root in here:
        p = root / "configs" / "demo.yaml"
        if p.is_file():
            return p
    raise FileNotFoundError("configs/demo.yaml not found: run from the repository, or set ICT_NB_RUN_DIR")


if not RUN_DIR:
    # `ict-jax train` in a child process, as a user would run it (the reward workers it starts need a
    # main module they can import, which a notebook cell is not)
    RUN_DIR = os.path.join(OUT_DIR, "demo_run")
    overrides = [
        f"run_dir={RUN_DIR}", f"train.steps={DEMO_STEPS}", "train.save_every=0", "model.preset=tiny",
        "rollout.num_samples=4", "train.prompts_per_step=8", "rollout.max_new_tokens=6", "rollout.max_prompt_len=16",
        "train.sft_steps=0", "rl.selector.warmup_steps=2",  # no SFT warm start: mechanics only
        'data.train=["arith?digits=1&size=64"]', "data.eval=[]", "stats.chunk=8", "rl.reward.workers=1",
    ]
    cmd = [sys.executable, "-m", "ict_jax.cli", "train", "--config", str(find_demo_config()), "--no-progress",
           *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"demo training failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    print("demo run:", RUN_DIR)

metrics_path = Path(RUN_DIR) / "metrics.jsonl"
rows = read_metrics(metrics_path)  # RL steps (phase "rl")
sft_rows = read_metrics(metrics_path, phase="sft")
print(f"{len(rows)} RL steps, {len(sft_rows)} SFT steps; keys: {len(rows[0]) if rows else 0}")
if not rows:
    raise SystemExit(f"{metrics_path}: no RL steps logged yet")


def series(key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of one metric over the RL rows that have a finite number for it."""
    pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float)) and np.isfinite(r[key])]
    return np.asarray([p[0] for p in pts]), np.asarray([p[1] for p in pts], float)


MARK = dict(marker="o", ms=3) if len(rows) <= 50 else {}  # a marker per step only on short runs


for key in ("stats/H1_mean", "stats/H2_mean", "mask/selected_frac", "reward/mean"):
    s, x = series(key)
    print(f"{key:>22}: first {x[0]:.4f}  last {x[-1]:.4f}  ({len(x)} steps)" if len(x) else f"{key}: not logged")

# %% [markdown]
# ## H1 vs H2 vs the selected fraction
# H2 <= H1 always (Rényi entropies decrease with the order); both falling means the policy sharpens. The
# selected fraction is on the right axis.

# %%
fig, ax = plt.subplots(figsize=(7.5, 4))
for key, colour, label in (("stats/H1_mean", "#e66100", "H1 (Shannon)"), ("stats/H2_mean", "#5d3a9b", "H2 (Rényi-2)")):
    s, x = series(key)
    ax.plot(s, x, color=colour, lw=1, label=label, **MARK)
ax.set_xlabel("RL step")
ax.set_ylabel("mean entropy of the response tokens (nats)")
ax2 = ax.twinx()
s, x = series("mask/selected_frac")
ax2.plot(s, x, color="#1a5fb4", ls="--", label="selected fraction", **MARK)
ax2.set_ylabel("selected fraction of valid tokens")
ax2.set_ylim(0, 1.05)
lines = ax.get_legend_handles_labels()
lines2 = ax2.get_legend_handles_labels()
fig.legend(lines[0] + lines2[0], lines[1] + lines2[1], fontsize=8, loc="lower center", ncol=3, frameon=False)
ax.set_title(f"{RUN_DIR}", fontsize=8)
fig.tight_layout(rect=(0, 0.07, 1, 1))  # the legend below the plot, never over a curve
legends_clear(fig)
fig.savefig(os.path.join(OUT_DIR, "h1_h2_selected.png"), dpi=110)

# %% [markdown]
# ## Entropy of the selected tokens, reward and accuracy

# %%
panels = [("stats/H1_mean", "stats/H1_selected_mean", "H1: all vs selected tokens"),
          ("stats/js_mean", "stats/js_selected_mean", "JS: all vs selected tokens"),
          ("reward/mean", "reward/accuracy", "reward and accuracy")]
fig, axes = plt.subplots(1, 3, figsize=(13, 3.3))
for ax, (a, b, title) in zip(axes, panels):
    for key in (a, b):
        s, x = series(key)
        if len(x):
            ax.plot(s, x, lw=1, label=key, **MARK)
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("RL step")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, frameon=False)
fig.tight_layout()
legends_clear(fig)
fig.savefig(os.path.join(OUT_DIR, "selected_vs_all.png"), dpi=110)
if matplotlib.get_backend().lower() == "agg":
    plt.close("all")
print(sorted(f for f in os.listdir(OUT_DIR) if f.endswith(".png")))
