"""The diagnostics of docs/method.md §5.

:func:`step_metrics` turns a rollout batch, its mask and token statistics into the §5 device scalars
the train step returns (stable names: plots and tables read them), and two measures of how saturated
ICT's cut is (docs/statistics.md): ``stats/u_at_ceiling`` and ``mask/tie_selected_frac``
(:mod:`ict_jax.rl.saturation`), and what the mask reaches (``mask/selected_eos_frac``, ...:
:func:`ict_jax.rl.coverage.reach_shares`). :func:`update_norm` is ``optim/update_norm``, the norm of an
applied update. Their quantiles (the lower median
of H1, ``stats/js_p90``) are :func:`ict_jax.rl.quantile.valid_quantile`, the one quantile over valid
entries, which STAPO's entropy quantile (:func:`ict_jax.rl.selectors.stapo_quantile`) also takes.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from ict_jax.config import SelectorSection
from ict_jax.rl.batch import RolloutBatch
from ict_jax.rl.coverage import reach_shares
from ict_jax.rl.losses import zero_std_groups
from ict_jax.rl.quantile import valid_quantile
from ict_jax.rl.saturation import RANKED_BY, tie_selected_frac, u_at_ceiling
from ict_jax.rl.selectors import canonical_method, resolved_rho, resolved_scope
from ict_jax.rl.token_stats import TokenStats

F32 = jnp.float32


def _masked_mean(x: jax.Array, w: jax.Array) -> jax.Array:
    return jnp.where(w > 0, x, 0.0).sum() / jnp.maximum(w.sum(), 1.0)


def step_metrics(batch: RolloutBatch, valid: Float[Array, "B T"], mask: Float[Array, "B T"], stats: TokenStats,
                 logp_old: Float[Array, "B T"], group_size: int, *, u_form: str | None = None,
                 selector: SelectorSection | None = None, mini_batches: int = 1,
                 micro_batches: int = 1) -> dict[str, jax.Array]:
    """docs/method.md §5 metrics of the rollout batch, masks and statistics (device scalars).

    The train step adds the loss metrics (``loss/*``, ``kl/*``, ``clip/*``), ``grad/norm`` and
    ``optim/update_norm``; what the mask reaches (the four shares of :data:`ict_jax.rl.coverage.REACH_KEYS`)
    is :func:`~ict_jax.rl.coverage.reach_shares` of the selected tokens. The
    statistics a pass did not compute (a ``None`` field of ``stats``) give no metric.
    ``mask/high_low_entropy_ratio`` = #(M and H1 > med) / max(1, #(M and H1 <= med)), med the lower
    median of H1 over valid tokens; ``stats/js_p90`` the linear 0.9 quantile of u over valid tokens.
    With ``u_form`` (the reading u was computed under): ``stats/u_at_ceiling``, the share of valid tokens
    whose u is within 5 % of its ceiling. With ``selector`` a top-k selector whose statistic is in
    ``stats`` (ict: u, entropy: H1): ``mask/tie_selected_frac``, the share of selected tokens its cut took
    by the tie at its cut under the selector's ``ties`` rule, candidate sets as the selector forms them
    (``batch``: one per mini-batch of ``mini_batches``; ``micro_batch``: one per micro-batch of
    ``micro_batches`` in each) (:mod:`ict_jax.rl.saturation`).
    """
    rv = batch.row_valid > 0
    sel = mask * valid
    n_rows = jnp.maximum(rv.sum(), 1)
    m: dict[str, jax.Array] = {
        "reward/mean": jnp.where(rv, batch.rewards, 0.0).sum() / n_rows,
        "reward/accuracy": jnp.where(rv, batch.correct, 0.0).sum() / n_rows,
        "adv/zero_std_group_frac": zero_std_groups(batch.rewards, group_size, batch.row_valid).mean(),
        "response/length_mean": jnp.where(rv, batch.response_valid.sum(-1), 0.0).sum() / n_rows,
        "response/truncated_frac": jnp.where(rv, batch.truncated, 0.0).sum() / n_rows,
        "mask/selected_frac": sel.sum() / jnp.maximum(valid.sum(), 1.0),
        "rollout/logp_abs_diff_mean": _masked_mean(jnp.abs(batch.sampler_logp - logp_old), valid),
    }
    m.update(reach_shares(sel, batch.response_valid, batch.truncated, batch.advantages, group_size, batch.row_valid))
    if stats.logp is not None:
        m["mask/selected_prob_mean"] = _masked_mean(jnp.exp(jax.lax.stop_gradient(stats.logp)), sel)
    if stats.H1 is not None:
        med = valid_quantile(stats.H1, valid, (1, 2), interpolation="lower", empty=jnp.inf)
        hi = ((sel > 0) & (stats.H1 > med)).sum()
        lo = ((sel > 0) & (stats.H1 <= med)).sum()
        m["mask/high_low_entropy_ratio"] = hi / jnp.maximum(lo, 1)
        m["stats/H1_mean"] = _masked_mean(stats.H1, valid)
        m["stats/H1_selected_mean"] = _masked_mean(stats.H1, sel)
    if stats.H2 is not None:
        m["stats/H2_mean"] = _masked_mean(stats.H2, valid)
        m["stats/H2_selected_mean"] = _masked_mean(stats.H2, sel)
    if stats.js is not None:
        m["stats/js_mean"] = _masked_mean(stats.js, valid)
        m["stats/js_p90"] = valid_quantile(stats.js, valid, (9, 10))
        m["stats/js_selected_mean"] = _masked_mean(stats.js, sel)
        if u_form is not None:
            m["stats/u_at_ceiling"] = u_at_ceiling(stats.js, valid, group_size, u_form)
    score = getattr(stats, RANKED_BY.get(canonical_method(selector.method), ""), None) if selector is not None else None
    if score is not None:
        scope = resolved_scope(selector)
        rows = valid.shape[0] // max(mini_batches, 1) // (max(micro_batches, 1) if scope == "micro_batch" else 1)
        m["mask/tie_selected_frac"] = tie_selected_frac(score, mask, valid, scope=scope, group_size=group_size,
                                                        set_rows=rows, ties=selector.ties,
                                                        rho=resolved_rho(selector))
    return m


def update_norm(old: Any, new: Any) -> jax.Array:
    """``optim/update_norm`` (docs/method.md §5): the global L2 norm of the update applied to the
    parameters, sqrt(sum over leaves of sum (new - old)^2), each difference taken in float32 (0 for an
    update that was skipped: new = old)."""
    sq = jax.tree.map(lambda a, b: jnp.sum(jnp.square(jnp.asarray(b, F32) - jnp.asarray(a, F32))), old, new)
    return jnp.sqrt(sum(jax.tree.leaves(sq), jnp.zeros((), F32)))
