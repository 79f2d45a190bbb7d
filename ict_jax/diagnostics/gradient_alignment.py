"""The gradient-alignment check (``ict-jax align``; docs/results.md "Gradient alignment"): does a selector's
gradient point where the dense gradient of *other* batches points?

On batches b = 1..n of a run's own rollouts from its starting policy (the run's data order and sampler keys;
groups whose rewards are all equal are dropped: row_valid 0, they carry no advantage, and the gradients run on
the other groups' rows alone), every selector S gives
its mask M_S and the gradient g_S^b of the one loss of docs/method.md §4 under that mask (its denominators
included: ``rl.train_step.loss_and_aux``, the train step's own loss, with r = 1 as in the fused step). The
reference of batch b is the mean dense gradient of the other batches, g_D^(-b) = (sum_c g_D^c - g_D^b) /
(n - 1): the same batch's dense gradient shares its sampling noise with g_S^b, the other batches' do not.
Per selector and batch:

- cos_S^b = <g_D^(-b), g_S^b> / (|g_D^(-b)| |g_S^b|);
- the sign-step gain gain_S^b = <g_D^(-b), sign(g_S^b)> / <g_D^(-b), sign(g_D^(-b))>: what a first AdamW step
  (lr * sign(g); LoRA's B starts at zero, so step 1 is that in every arm) in S's direction gains on the other
  batches' dense loss, as a share of the best sign step's gain (1 = the reference's own signs).

Each selector's mean, sd and standard error over batches, and paired differences across batches (the same b)
with their s.e., t and p (:func:`ict_jax.experiments.stats.paired_differences`). Two random-10 % draws
(``random_a``, ``random_b``: the random arm's own draw at the batch's step, and a second key) give the null:
their difference is what chance alone gives. The check can rank
selectors against each other; it cannot show one beating dense GRPO, which is the reference. At LoRA's start
the KL term's gradient is zero (the policy is its reference), so the check uses kl_coef 0.

The selectors (:data:`SELECTORS`): ``dense``; ``ict_aligned`` and ``ict_pooled`` (the top rho of each
response's tokens by u under that reading); ``random_a``, ``random_b`` (rho of each response's tokens, two
keys); ``lowest_p`` (the rho of each response's tokens with the lowest p(o_t)). rho = ``rl.selector.rho``
(default 0.1), per response, ties to the lower position (docs/method.md §2).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ict_jax.config import Config
from ict_jax.experiments.stats import mean_sd, paired_differences
from ict_jax.rl.batch import RolloutBatch
from ict_jax.rl.group_stats import GroupStatsRequest, group_stats
from ict_jax.rl.losses import loss_denominators
from ict_jax.rl.selectors import random_key, random_mask, resolved_rho, topk_mask
from ict_jax.rl.state import make_optimizer
from ict_jax.rl.train_step import StepPlan, loss_and_aux

__all__ = ["SELECTORS", "PAIRS", "DRAWS", "AlignmentStopped", "read_draws", "alignment", "selector_masks",
           "selector_gradients", "run_alignment", "drop_equal_reward_groups", "counted_groups", "format_alignment"]

#: The selectors of the check, in report order.
SELECTORS = ("dense", "ict_aligned", "ict_pooled", "random_a", "random_b", "lowest_p")
#: The paired comparisons reported (a - b per batch): each sparse selector against dense and against the
#: first random draw, and the two random draws against each other (the null).
PAIRS = (("ict_aligned", "dense"), ("random_a", "dense"), ("lowest_p", "dense"), ("ict_pooled", "dense"),
         ("ict_aligned", "random_a"), ("ict_pooled", "random_a"), ("lowest_p", "random_a"),
         ("random_b", "random_a"))
MEASURES = ("cos", "gain")


# ------------------------------------------------------------------------------------------------
# The measures (float64 NumPy), from gradient vectors
# ------------------------------------------------------------------------------------------------
def alignment(grads: Mapping[str, Sequence[np.ndarray]]) -> dict[str, Any]:
    """The measures of the module docstring from ``grads[selector][b]`` (flat vectors, one per batch; the
    ``dense`` entry is the reference's source): ``per_batch[selector][measure]`` lists, ``summary[selector]
    [measure]`` mean / sd / n / se, and ``paired`` over :data:`PAIRS` (those whose selectors are present)."""
    dense = [np.asarray(g, np.float64) for g in grads["dense"]]
    n = len(dense)
    if n < 2:
        raise ValueError(f"alignment: {n} batch(es); the leave-one-out reference needs at least 2")
    total = np.sum(dense, axis=0)
    per_batch: dict[str, dict[str, list[float]]] = {s: {m: [] for m in MEASURES} for s in grads}
    for b in range(n):
        ref = (total - dense[b]) / (n - 1)
        ref_norm, best = float(np.linalg.norm(ref)), float(np.abs(ref).sum())
        for s, gs in grads.items():
            g = np.asarray(gs[b], np.float64)
            gn = float(np.linalg.norm(g))
            per_batch[s]["cos"].append(float(ref @ g) / (ref_norm * gn) if ref_norm > 0 and gn > 0 else math.nan)
            per_batch[s]["gain"].append(float(ref @ np.sign(g)) / best if best > 0 else math.nan)
    summary = {}
    for s, ms in per_batch.items():
        summary[s] = {}
        for m, vals in ms.items():
            st = mean_sd([v for v in vals if math.isfinite(v)])
            st["se"] = st["sd"] / math.sqrt(st["n"]) if st["sd"] is not None else None
            summary[s][m] = st
    paired = []
    for a, r in PAIRS:
        if a in per_batch and r in per_batch:
            for m in MEASURES:
                diff = paired_differences(dict(enumerate(per_batch[a][m])), dict(enumerate(per_batch[r][m])))
                paired.append({"selector": a, "reference": r, "measure": m, **diff})
    return {"batches": n, "per_batch": per_batch, "summary": summary, "paired": paired}


def format_alignment(result: Mapping[str, Any]) -> str:
    """The check's Markdown tables: per selector mean ± sd (s.e.) of cos and gain; the paired differences."""
    lines = [f"Batches: {result['batches']}. cos: the cosine with the mean dense gradient of the other batches; "
             "gain: the sign-step gain against it (1 = its own signs).", "",
             "| selector | cos | gain |", "|---|---|---|"]
    for s, ms in result["summary"].items():
        cells = [f"{ms[m]['mean']:.4f} ± {ms[m]['sd']:.4f} (s.e. {ms[m]['se']:.4f})" if ms[m]["sd"] is not None
                 else "n/a" for m in MEASURES]
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    lines += ["", "| difference (paired by batch) | measure | mean | sd | s.e. | t | p |",
              "|---|---|---|---|---|---|---|"]
    for p in result["paired"]:
        def f(x: Any) -> str:
            return "n/a" if x is None else f"{x:.4f}"
        lines.append(f"| {p['selector']} − {p['reference']} | {p['measure']} | {f(p['mean'])} | {f(p['sd'])} | "
                     f"{f(p['se'])} | {f(p['t'])} | {f(p['p'])} |")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------
# Masks and gradients of one batch (JAX)
# ------------------------------------------------------------------------------------------------
def drop_equal_reward_groups(batch: RolloutBatch, group_size: int) -> tuple[RolloutBatch, int]:
    """``batch`` with every group whose rewards are all equal (among its counted rows) out of the loss
    (row_valid 0: no advantage, no share of the denominators); returns it and the groups kept."""
    r = np.asarray(batch.rewards, np.float64).reshape(-1, group_size)
    v = np.asarray(batch.row_valid).reshape(-1, group_size) > 0
    hi = np.where(v, r, -np.inf).max(axis=1)
    lo = np.where(v, r, np.inf).min(axis=1)
    keep = v.any(axis=1) & (hi > lo)
    rows = np.repeat(keep, group_size)
    row_valid = jnp.where(jnp.asarray(rows), batch.row_valid, 0.0).astype(batch.row_valid.dtype)
    return batch.replace(row_valid=row_valid), int(keep.sum())


def counted_groups(batch: RolloutBatch, valid: jax.Array, masks: Mapping[str, jax.Array],
                   group_size: int) -> tuple[RolloutBatch, jax.Array, dict[str, jax.Array]]:
    """``batch``, ``valid`` and ``masks`` cut to the rows of the groups that count (a row with row_valid > 0
    in the group: whole groups, so a group's rows stay together). A dropped group's rows add nothing to the
    loss or its denominators (valid 0), so the gradient is the full batch's; the check pays only for the
    rows that count. The masks are chosen on the full batch first (the random draws are the random arm's
    own at the full batch's shape), then cut."""
    counted = np.asarray(batch.row_valid).reshape(-1, group_size).max(axis=1) > 0
    if counted.all():
        return batch, valid, dict(masks)
    rows = jnp.asarray(np.flatnonzero(np.repeat(counted, group_size)))
    return (jax.tree.map(lambda x: x[rows], batch), valid[rows], {s: m[rows] for s, m in masks.items()})


def selector_masks(stats: Mapping[str, Any], valid: jax.Array, *, rho: float, group_size: int,
                   keys: Sequence[jax.Array]) -> dict[str, jax.Array]:
    """The masks of :data:`SELECTORS` from the statistics by reading (``stats[u_form]``: ``aligned`` and
    ``pooled``; logp from ``aligned``), per response (scope ``sequence``), ``keys`` the two random draws'."""
    common = dict(rho=rho, scope="sequence", group_size=group_size)
    aligned, pooled = stats["aligned"], stats["pooled"]
    masks = {"dense": valid.astype(jnp.float32),
             "ict_aligned": topk_mask(aligned.js, valid, **common),
             "ict_pooled": topk_mask(pooled.js, valid, **common),
             "lowest_p": topk_mask(-aligned.logp, valid, **common)}
    for name, key in zip(("random_a", "random_b"), keys):
        masks[name] = random_mask(key, valid, **common)
    return {s: masks[s].astype(jnp.float32) for s in SELECTORS}


def selector_gradients(plan: StepPlan, params: Any, graphdef: Any, batch: RolloutBatch, valid: jax.Array,
                       masks: Mapping[str, jax.Array], key: jax.Array, step: jax.Array) -> dict[str, Any]:
    """The gradient of the train step's loss (``loss_and_aux``, r = 1: logp_old is this policy's, no KL)
    under each mask of ``masks``, with that mask's denominators (docs/method.md §4)."""
    def loss(p: Any, mask: jax.Array) -> jax.Array:  # logp_old None: this forward's, stop-gradient (r = 1)
        denoms = loss_denominators(valid, mask, plan.loss)
        return loss_and_aux(plan, p, graphdef, batch, valid, None, None, mask, denoms, key, step)[0]

    grad = jax.grad(loss)
    return {s: grad(params, m) for s, m in masks.items()}


def compiled_selector_fns(plan: StepPlan, request: GroupStatsRequest) -> tuple[Callable, Callable]:
    """``(stats_fn, grads_fn)``: the check's two programs, jitted. ``stats_fn(params, model_def, batch, valid)``
    is :func:`group_stats` of the batch; ``grads_fn(params, model_def, batch, valid, masks, key, step)`` is
    :func:`selector_gradients`. The :class:`ModelDef` is an argument, so a LoRA run's frozen base goes in as
    the programs' input instead of being captured into them as constants (2.5 GB for the 0.5B)."""
    stats_fn = jax.jit(lambda p, d, b, v: group_stats(p, d, b.tokens, b.attention_mask, v, request))
    grads_fn = jax.jit(lambda p, d, b, v, ms, k, s: selector_gradients(plan, p, d, b, v, ms, k, s))
    return stats_fn, grads_fn


def flat(tree: Any) -> np.ndarray:
    """A gradient tree as one float32 vector (leaves in tree order)."""
    return np.concatenate([np.asarray(x, np.float32).ravel() for x in jax.tree.leaves(tree)])


# ------------------------------------------------------------------------------------------------
# The check on a run's config
# ------------------------------------------------------------------------------------------------
#: The check's journal under ``out``: one JSON line per rollout batch drawn, written after its gradients.
DRAWS = "draws.jsonl"


class AlignmentStopped(Exception):
    """The time box stopped the check between batches (its journal and gradients kept; ``--resume`` goes on)."""

    def __init__(self, kept: int, batches: int):
        super().__init__(f"{kept}/{batches} batches")
        self.kept, self.batches = kept, batches


def read_draws(out: Path) -> list[dict[str, Any]]:
    """The journal of a check in ``out`` (:data:`DRAWS`), each kept batch's gradients checked on disk; a last
    line cut by a kill is dropped (its batch is drawn again). ValueError (one line) if a kept batch's
    gradient file is missing."""
    path = out / DRAWS
    if not path.is_file():
        return []
    draws: list[dict[str, Any]] = []
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines):
        try:
            draws.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:  # the line a kill cut: that batch is drawn again
                break
            raise ValueError(f"{path}:{i + 1}: not a JSON line") from None
    for d in draws:
        if d["kept"] is not None:
            missing = [s for s in SELECTORS if not (out / "grads" / f"{d['kept']['batch']:02d}_{s}.npy").is_file()]
            if missing:
                raise ValueError(f"{path}: batch {d['kept']['batch']}'s gradients {missing} are missing from "
                                 f"{out / 'grads'}: the check cannot go on; start it again in a new folder")
    return draws


def _append_draw(out: Path, draw: Mapping[str, Any]) -> None:
    with open(out / DRAWS, "a") as f:
        f.write(json.dumps(draw, default=float) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _batch_gradients(state: Any, batch: RolloutBatch, step: int, fns: tuple[Callable, Callable], rho: float,
                     group_size: int, prefix: Path) -> dict[str, Any]:
    """Every selector's gradient on one batch, saved as ``<prefix>_<selector>.npy``; returns the batch's
    valid tokens, selected counts and mean reward. ``fns``: the compiled statistics and gradients."""
    stats_fn, grads_fn = fns
    valid = ((batch.response_valid > 0) & (batch.row_valid[:, None] > 0)).astype(jnp.float32)
    model_def = state.model_def()
    stats = stats_fn(state.params, model_def, batch, valid)
    keys = [random_key(state.rng, step, d) for d in (0, 1)]  # draw 0: the random arm's own at this step
    masks = selector_masks(stats, valid, rho=rho, group_size=group_size, keys=keys)
    sub, sub_valid, sub_masks = counted_groups(batch, valid, masks, group_size)  # the dropped groups' rows go
    grads = grads_fn(state.params, model_def, sub, sub_valid, sub_masks, state.rng, jnp.int32(step))
    for s, g in grads.items():
        np.save(f"{prefix}_{s}.npy", flat(g))
    return {"valid_tokens": int(np.asarray(valid).sum()),
            "selected": {s: int(np.asarray(m).sum()) for s, m in masks.items()},
            "reward_mean": float(np.mean(np.asarray(batch.rewards)))}


def run_alignment(config: Config, *, batches: int, out: Path, say: Callable[[str], None] = print,
                  max_draws: int | None = None, tell: Callable[[str], None] = lambda text: None,
                  resume: bool = False, max_hours: float | None = None) -> dict[str, Any]:
    """Sample the run's rollout batches from its starting policy (its steps 0, 1, ... in the run's data order
    and sampler keys) until ``batches`` of them keep a group with unequal rewards (at most ``max_draws``,
    default 4x), take every selector's gradient on each, and write ``alignment.json`` and ``alignment.md``
    under ``out`` (the gradients under ``out/grads``, one ``.npy`` per batch and selector; the run directory
    of the sampler's trainer under ``out/run``; one line per batch drawn in ``out/draws.jsonl``, the journal).
    Returns the result (:func:`alignment`, with the batches' descriptions). ``tell(text)``: what runs now, as
    each part starts (the build of the run, each batch's sampling and gradients, the report), for a heartbeat
    (``ict-jax align``'s).

    ``max_hours``: a time box; no batch starts that would end past it at the pace measured (the slowest batch
    so far; the first always starts): :class:`AlignmentStopped`. ``resume``: go on with the check in ``out``
    from its journal (the run's config must not change: the resume rules of ``out/run``); every batch is a
    function of the starting policy and its step alone (the prompt iterator's position is in the journal), so
    a check done in chunks equals one done at once, bit for bit."""
    from ict_jax.train.rollout import collect_rollout
    from ict_jax.train.trainer import Trainer

    t_start = time.perf_counter()
    cfg = config.replace(**{"rl.loss.kl_coef": 0.0, "run_dir": str(out / "run"), "train.eval_every": 0})
    rho = resolved_rho(dataclasses.replace(cfg.rl.selector, method="ict"))  # rl.selector.rho, else ICT's default
    gdir = out / "grads"
    draws = read_draws(out) if resume else []
    kept: list[dict[str, Any]] = [d["kept"] for d in draws if d["kept"] is not None]
    first = draws[-1]["step"] + 1 if draws else 0
    if resume:
        say(f"resuming the check in {out}: {len(kept)}/{batches} batches kept in {first} draws")
    gdir.mkdir(parents=True, exist_ok=True)
    pace = 0.0
    with Trainer(cfg, resume=resume and (out / "run").is_dir(), progress=False, preflight=False,
                 tell=tell) as trainer:
        parts, state = trainer.parts, trainer.state
        parts.logger.close()  # the check trains nothing: no "rl 0/N steps" heartbeat of the run beside its own
        if draws:
            parts.iterator.load_state_dict(draws[-1]["iterator"])
        G = cfg.rollout.num_samples
        plan = StepPlan.from_config(cfg, make_optimizer(cfg))
        request = GroupStatsRequest(G, plan.temperature, plan.chunk, ("logp", "js"), ("aligned", "pooled"))
        stats_fn, grads_fn = compiled_selector_fns(plan, request)
        limit = max_draws or 4 * batches
        for step in range(first, limit):
            if len(kept) == batches:
                break
            if max_hours is not None and pace and time.perf_counter() - t_start + pace > max_hours * 3600:
                raise AlignmentStopped(len(kept), batches)
            t0 = time.perf_counter()
            tell(f"batch {len(kept) + 1}/{batches}: sampling the rollouts of step {step}")
            batch, _ = collect_rollout(parts, state, step)
            batch, groups = drop_equal_reward_groups(batch, G)
            draw: dict[str, Any] = {"step": step, "kept": None}
            if groups == 0:
                say(f"step {step}: every group's rewards are equal: skipped")
            else:
                tell(f"batch {len(kept) + 1}/{batches} (step {step}): the statistics, masks and every selector's "
                     "gradient")
                b = len(kept)
                kept.append({"batch": b, "step": step, "groups": groups,
                             **_batch_gradients(state, batch, step, (stats_fn, grads_fn), rho, G, gdir / f"{b:02d}"),
                             "seconds": time.perf_counter() - t0})
                draw["kept"] = kept[-1]
                say(f"batch {b + 1}/{batches} (step {step}): {groups} of {cfg.train.prompts_per_step} groups kept, "
                    f"{kept[-1]['valid_tokens']} tokens, {kept[-1]['seconds']:.0f} s")
            draw["iterator"] = parts.iterator.state_dict()
            _append_draw(out, draw)
            pace = max(pace, time.perf_counter() - t0)
    if len(kept) < 2:
        raise ValueError(f"align: {len(kept)} batch(es) with unequal rewards in {limit} draws: the check needs 2")
    tell("the alignment of the gradients and the report")
    result = alignment({s: [np.load(gdir / f"{b:02d}_{s}.npy") for b in range(len(kept))] for s in SELECTORS})
    result.update(batches_info=kept, rho=rho, config=cfg.to_dict(), selectors=list(SELECTORS))
    (out / "alignment.json").write_text(json.dumps(result, indent=2, default=float))
    (out / "alignment.md").write_text(format_alignment(result))
    return result
