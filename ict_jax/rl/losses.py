"""GRPO advantages and the one policy loss every method shares (docs/method.md §3, §4, §5).

Pure float32 functions, no model and no state, so the train step, a notebook or a test can call them
alone. The method (dense, ict, entropy, stapo, random) only changes the token mask ``M``; this module
never looks at which method made it.

Shapes: ``B`` rows (responses, prompt-major: row = p*G + j), ``T`` response positions
(``max_new_tokens``, or the length bucket a step cut the batch to), ``P`` prompts, ``G`` rollouts per prompt.

Micro-batching. Every denominator the loss divides by (the number of real responses ``R`` and the
mini-batch token counts) is gathered in a :class:`LossDenominators` pytree of float32 scalars. Computed
once over the whole mini-batch with :func:`loss_denominators` and passed to :func:`policy_loss` for each
micro-batch, the micro-batch losses, gradients and metrics are partial sums: summed over the
micro-batches they equal the values of the whole mini-batch. Rows (responses) are never split, so the
per-row denominators of ``seq-mean-token-mean`` are always computed locally. ``rl.loss.normalize_scope:
micro_batch`` (20-Entropy's official code, verl's gradient accumulation) instead divides each micro-batch's
loss by its own counts and averages the micro-batch losses (:func:`micro_batch_loss`, :func:`mini_batch_loss`).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from ict_jax.config import ConfigError, LossSection

__all__ = [
    "LossDenominators",
    "clipped_surrogate",
    "group_advantages",
    "k3_kl",
    "loss_denominators",
    "micro_batch_loss",
    "mini_batch_loss",
    "policy_loss",
    "zero_std_groups",
]

F32 = jnp.float32
LOG_RATIO_CLAMP = 20.0  # docs/method.md §4: log r and the k3 log difference are clamped to [-20, 20]
K3_CLAMP = 10.0  # docs/method.md §4: k3 is clamped to [-10, 10]

# Bool or 0/1 float arrays are both accepted for masks.
Mask = Bool[Array, "B T"] | Float[Array, "B T"]


# --------------------------------------------------------------------------------------------------
# Advantages (docs/method.md §3)
# --------------------------------------------------------------------------------------------------
def _grouped(rewards: Array, group_size: int, row_valid: Array | None) -> tuple[Array, Array, Array]:
    if group_size < 1 or rewards.ndim != 1 or rewards.shape[0] % group_size:
        raise ValueError(f"rewards of shape {rewards.shape} cannot be split into groups of {group_size}")
    r_PG = rewards.astype(F32).reshape(-1, group_size)
    if row_valid is None:
        v_PG = jnp.ones(r_PG.shape, bool)
    else:
        v_PG = (jnp.asarray(row_valid) > 0).reshape(r_PG.shape)
    n_P = v_PG.sum(-1).astype(F32)
    return r_PG, v_PG, n_P


def _all_equal(r_PG: Array, v_PG: Array) -> Array:
    """max == min over a group's real rows, tested directly (never through a small std)."""
    hi = jnp.where(v_PG, r_PG, -jnp.inf).max(-1)
    lo = jnp.where(v_PG, r_PG, jnp.inf).min(-1)
    return hi == lo


def zero_std_groups(
    rewards: Float[Array, " B"], group_size: int, row_valid: Bool[Array, " B"] | None = None
) -> Bool[Array, " P"]:
    """True for groups with at least two real rows whose rewards are all equal (max == min).

    Their advantages are exactly 0 (docs/method.md §3). ``mean`` of this is docs/method.md §5's
    ``adv/zero_std_group_frac``; DAPO's ``drop_zero_std_groups`` drops these groups.
    """
    r_PG, v_PG, n_P = _grouped(rewards, group_size, row_valid)
    return (n_P >= 2) & _all_equal(r_PG, v_PG)


def group_advantages(
    rewards: Float[Array, " B"],
    group_size: int,
    scale_rewards: str = "group",
    eps: float = 1e-6,
    row_valid: Bool[Array, " B"] | None = None,
) -> Float[Array, " B"]:
    """Outcome advantages A_i, one per response, float32 (docs/method.md §3).

    Rows are prompt-major: ``rewards.reshape(P, group_size)``. With ``n_g`` real rows in group g::

        group (default): A_i = (R_i - mean_g R) / (std_g R + eps)
        batch:           A_i = (R_i - mean_g R) / (std_batch R + eps)
        none (Dr.GRPO):  A_i =  R_i - mean_g R

    Standard deviations are unbiased (ddof 1); ``std_batch`` is over every real reward of the batch (1
    when there are fewer than two). Special groups:

    - all rewards equal (``max == min`` over its real rows, tested directly; n_g >= 2): A = 0 exactly,
      in every mode;
    - a group of one real row (``group_size == 1``, or one real row left by ``row_valid``): verl's
      convention mean 0 and std 1 in every mode, so A = R / (1 + eps) (``none``: A = R);
    - no real row: A = 0.

    ``row_valid`` (optional, bool[B]) marks real rows; padding rows of a bucketed batch (False) are
    left out of every mean, std and max/min, and get A = 0. ``None`` means all rows are real.
    """
    if scale_rewards not in ("group", "batch", "none"):
        raise ValueError(f"scale_rewards: {scale_rewards!r} is not one of 'group', 'batch', 'none'")
    r_PG, v_PG, n_P = _grouped(rewards, group_size, row_valid)
    n_P1 = n_P[:, None]
    mean_P1 = jnp.where(v_PG, r_PG, 0.0).sum(-1, keepdims=True) / jnp.maximum(n_P1, 1.0)
    if scale_rewards == "group":
        sq = jnp.where(v_PG, jnp.square(r_PG - mean_P1), 0.0).sum(-1, keepdims=True)
        std_P1 = jnp.sqrt(sq / jnp.maximum(n_P1 - 1.0, 1.0))
    elif scale_rewards == "batch":
        n = v_PG.sum().astype(F32)
        mu = jnp.where(v_PG, r_PG, 0.0).sum() / jnp.maximum(n, 1.0)
        sq = jnp.where(v_PG, jnp.square(r_PG - mu), 0.0).sum()
        std_P1 = jnp.where(n >= 2, jnp.sqrt(sq / jnp.maximum(n - 1.0, 1.0)), 1.0) * jnp.ones_like(mean_P1)
    else:
        std_P1 = jnp.ones_like(mean_P1)
    one = n_P1 == 1  # a group of one: mean 0, std 1 (verl)
    mean_P1 = jnp.where(one, 0.0, mean_P1)
    centered = r_PG - mean_P1
    if scale_rewards == "none":
        adv_PG = centered
    else:
        adv_PG = centered / (jnp.where(one, 1.0, std_P1) + eps)
    zero = (~v_PG) | (n_P1 == 0) | ((n_P1 >= 2) & _all_equal(r_PG, v_PG)[:, None])
    return jnp.where(zero, 0.0, adv_PG).reshape(-1).astype(F32)


# --------------------------------------------------------------------------------------------------
# Per-token terms (docs/method.md §4)
# --------------------------------------------------------------------------------------------------
def k3_kl(logp: Float[Array, "*S"], logp_ref: Float[Array, "*S"]) -> Float[Array, "*S"]:
    """Schulman's k3 estimator of KL(pi_theta || pi_ref), per token (docs/method.md §4)::

        d  = clamp(logp_ref - logp, -20, 20)
        k3 = clamp(exp(d) - d - 1, -10, 10)

    Unbiased for the KL under samples from pi_theta, always >= 0, and differentiable wrt ``logp``.
    """
    d = jnp.clip(logp_ref.astype(F32) - logp.astype(F32), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return jnp.clip(jnp.exp(d) - d - 1.0, -K3_CLAMP, K3_CLAMP)


def clipped_surrogate(
    logp: Float[Array, "B T"],
    logp_old: Float[Array, "B T"],
    adv: Float[Array, " B"] | Float[Array, "B T"],
    *,
    eps_low: float,
    eps_high: float,
    dual_clip_c: float | None,
) -> tuple[Float[Array, "B T"], Float[Array, "B T"]]:
    """The PPO/GRPO clipped objective per token (to be maximised) and the ratio (docs/method.md §4)::

        r    = exp(clamp(logp - logp_old, -20, 20))
        surr = min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)           (clip-higher: eps_high > eps_low)
        surr = max(surr, dual_clip_c A)   where A < 0, if dual_clip_c is not None   (dual clip)

    ``adv`` is per response ``[B]`` (broadcast over T) or per token ``[B, T]``.
    Returns ``(surr, r)``, both float32 ``[B, T]``.
    """
    logp, logp_old = logp.astype(F32), logp_old.astype(F32)
    adv = adv.astype(F32)
    if adv.ndim == logp.ndim - 1:
        adv = adv[..., None]
    ratio = jnp.exp(jnp.clip(logp - logp_old, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    surr = jnp.minimum(ratio * adv, jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv)
    if dual_clip_c is not None:
        surr = jnp.where(adv < 0, jnp.maximum(surr, dual_clip_c * adv), surr)
    return surr, jnp.broadcast_to(ratio, surr.shape)


# --------------------------------------------------------------------------------------------------
# Aggregation (docs/method.md §4) and the loss
# --------------------------------------------------------------------------------------------------
class LossDenominators(NamedTuple):
    """Mini-batch-wide denominators of :func:`policy_loss` (float32 scalars; a pytree).

    Compute them once over the whole mini-batch (:func:`loss_denominators`) and pass them to
    :func:`policy_loss` for every micro-batch: the loss, its gradient and every metric then become
    partial sums over the micro-batches.
    """

    num_responses: Float[Array, ""]  # rows with at least one valid token
    pg_tokens: Float[Array, ""]  # sum of d_pg (token-mean denominator of the policy term)
    kl_tokens: Float[Array, ""]  # sum of d_kl (token-mean denominator of the KL term)
    valid_tokens: Float[Array, ""]  # sum of valid
    selected_tokens: Float[Array, ""]  # sum of M (M <= valid)
    pg_rows: Float[Array, ""]  # R of the policy term: rows with sum_t d_pg > 0
    kl_rows: Float[Array, ""]  # R of the KL term: rows with sum_t d_kl > 0


def _weights(valid: Mask, mask: Mask, config: LossSection) -> tuple[Array, Array, Array, Array, Array]:
    """(valid, selected, w_kl, d_pg, d_kl) as bool [B, T]; M is intersected with valid (M <= valid)."""
    valid_b = jnp.asarray(valid) > 0
    sel_b = (jnp.asarray(mask) > 0) & valid_b
    wkl_b = sel_b if config.kl_masked else valid_b
    selected = config.normalize_over == "selected"
    dpg_b = sel_b if selected else valid_b
    dkl_b = wkl_b if selected else valid_b
    return valid_b, sel_b, wkl_b, dpg_b, dkl_b


def loss_denominators(valid: Mask, mask: Mask, config: LossSection) -> LossDenominators:
    """The :class:`LossDenominators` of a (mini-)batch, docs/method.md §4::

        num_responses = #{i : sum_t valid[i,t] > 0},  pg_tokens = sum d_pg,  kl_tokens = sum d_kl
        pg_rows = #{i : sum_t d_pg[i,t] > 0},  kl_rows = #{i : sum_t d_kl[i,t] > 0}
        d_pg = M if normalize_over == 'selected' else valid
        d_kl = w_kl if normalize_over == 'selected' else valid,   w_kl = M if kl_masked else valid

    ``pg_rows`` / ``kl_rows`` are the R of ``seq-mean-token-mean``: a response with valid tokens but no
    selected one (possible under the ``group`` and ``batch`` scopes, STAPO, ``frequent``) has no
    per-response mean under ``normalize_over: selected`` and leaves R instead of diluting the others.
    """
    valid_b, sel_b, _, dpg_b, dkl_b = _weights(valid, mask, config)
    return LossDenominators(
        num_responses=valid_b.any(-1).sum().astype(F32),
        pg_tokens=dpg_b.sum().astype(F32),
        kl_tokens=dkl_b.sum().astype(F32),
        valid_tokens=valid_b.sum().astype(F32),
        selected_tokens=sel_b.sum().astype(F32),
        pg_rows=dpg_b.any(-1).sum().astype(F32),
        kl_rows=dkl_b.any(-1).sum().astype(F32),
    )


class AggInputs(NamedTuple):
    """What a loss aggregation reads (docs/method.md §4): ``xw`` = the per-token term where w > 0, else 0
    (``jnp.where``, never w * x); ``d_b`` the denominator tokens (bool); the mini-batch-wide ``tokens`` =
    sum d, ``rows`` = the rows with sum_t d > 0 (R of seq-mean-token-mean), ``num_responses`` (R of
    seq-mean-token-sum-norm) and ``max_new_tokens`` (its T, static). The counts come from
    :class:`LossDenominators`, so they are those of the whole mini-batch under micro-batching."""

    xw: Float[Array, "B T"]
    d_b: Bool[Array, "B T"]
    tokens: Float[Array, ""]
    num_responses: Float[Array, ""]
    rows: Float[Array, ""]
    max_new_tokens: int


#: a loss aggregation: :class:`AggInputs` -> the scalar AGG(x, w, d)
LossAggFn = Callable[[AggInputs], Array]
_AGGREGATIONS: dict[str, LossAggFn] = {}


def register_loss_agg(name: str, fn: LossAggFn, *, overwrite: bool = False) -> None:
    """Register the loss aggregation ``fn(inputs: AggInputs) -> scalar`` under ``name``
    (``rl.loss.loss_agg: <name>``): the one place an aggregation's name is written. A plugin module
    (``plugins: [module]``, docs/plugins.md) registers more."""
    if name in _AGGREGATIONS and not overwrite:
        raise ValueError(f"loss aggregation {name!r} is already registered (pass overwrite=True to replace it)")
    _AGGREGATIONS[name] = fn


def registered_loss_aggs() -> tuple[str, ...]:
    """The registered loss aggregations, in registration order (the built-ins first)."""
    return tuple(_AGGREGATIONS)


def check_loss_agg(config: LossSection) -> None:
    """``rl.loss.loss_agg`` names a registered aggregation, checked when the run is built; ConfigError (one
    line naming the key and the registered names)."""
    if config.loss_agg not in _AGGREGATIONS:
        raise ConfigError(f"rl.loss.loss_agg: {config.loss_agg!r} is not a registered loss aggregation; registered: "
                          f"{', '.join(_AGGREGATIONS)} (a plugin module registers more: plugins: [module])")


def _seq_mean_token_mean(a: AggInputs) -> Array:  # ICT Eq. 11, the default
    per_row = a.xw.sum(-1) / jnp.maximum(a.d_b.sum(-1).astype(F32), 1.0)
    return per_row.sum() / jnp.maximum(a.rows, 1.0)


def _token_mean(a: AggInputs) -> Array:  # DAPO, 20-Entropy's official code, STAPO
    return a.xw.sum() / jnp.maximum(a.tokens, 1.0)


def _seq_mean_token_sum_norm(a: AggInputs) -> Array:  # Dr.GRPO
    return a.xw.sum() / (jnp.maximum(a.num_responses, 1.0) * a.max_new_tokens)


register_loss_agg("seq-mean-token-mean", _seq_mean_token_mean)
register_loss_agg("token-mean", _token_mean)
register_loss_agg("seq-mean-token-sum-norm", _seq_mean_token_sum_norm)


def _aggregate(x: Array, w_b: Array, d_b: Array, tokens: Array, num_responses: Array, rows: Array,
               loss_agg: str, max_new_tokens: int) -> Array:
    """AGG(x, w, d) of docs/method.md §4 by the registered aggregation ``loss_agg`` (:class:`AggInputs`)."""
    fn = _AGGREGATIONS.get(loss_agg)
    if fn is None:
        raise ValueError(f"loss_agg: {loss_agg!r} is not a known aggregation; registered: {list(_AGGREGATIONS)}")
    xw = jnp.where(w_b, x, 0.0)  # never w * x: an inf or NaN times 0 would poison the gradient
    return fn(AggInputs(xw, d_b, tokens, num_responses, rows, max_new_tokens))


def _kl_term(logp: Array, logp_ref: Array | None, valid_b: Array, wkl_b: Array, dkl_b: Array,
             denoms: LossDenominators, agg: str, max_new_tokens: int) -> tuple[Array, Array]:
    """``(AGG(k3, w_kl, d_kl), sum of k3 over valid tokens)``, both 0 without ``logp_ref``. The k3 inputs
    of tokens outside ``w_kl`` are zeroed first (their gradient is exactly 0); the valid-token sum is
    stop-gradient in ``logp`` (a diagnostic)."""
    if logp_ref is None:
        return jnp.zeros((), F32), jnp.zeros((), F32)
    logp_ref = logp_ref.astype(F32)
    k3 = k3_kl(jnp.where(wkl_b, logp, 0.0), jnp.where(wkl_b, logp_ref, 0.0))
    kl = _aggregate(k3, wkl_b, dkl_b, denoms.kl_tokens, denoms.num_responses, denoms.kl_rows, agg, max_new_tokens)
    k3_valid = k3_kl(jnp.where(valid_b, jax.lax.stop_gradient(logp), 0.0), jnp.where(valid_b, logp_ref, 0.0))
    return kl, jnp.where(valid_b, k3_valid, 0.0).sum()


def _clipped(logp: Array, logp_old: Array, adv_BT: Array, valid_b: Array, config: LossSection) -> Array:
    """The valid tokens whose ratio is clipped (stop-gradient): (A > 0 and r > 1 + eps_high) or (A < 0 and
    r < 1 - eps_low)."""
    lp_v = jax.lax.stop_gradient(jnp.where(valid_b, logp, 0.0))
    _, ratio = clipped_surrogate(lp_v, jnp.where(valid_b, logp_old, 0.0), adv_BT, eps_low=config.eps_low,
                                 eps_high=config.eps_high, dual_clip_c=config.dual_clip_c)
    return valid_b & (((adv_BT > 0) & (ratio > 1.0 + config.eps_high))
                      | ((adv_BT < 0) & (ratio < 1.0 - config.eps_low)))


def policy_loss(
    logp: Float[Array, "B T"],
    logp_old: Float[Array, "B T"],
    logp_ref: Float[Array, "B T"] | None,
    adv: Float[Array, " B"],
    valid: Mask,
    mask: Mask,
    *,
    config: LossSection,
    denoms: LossDenominators | None = None,
    max_new_tokens: int | None = None,
) -> tuple[Float[Array, ""], dict[str, Float[Array, ""]]]:
    """The loss of docs/method.md §4, one for every method (the method only changes ``mask`` = M)::

        loss = -AGG(surr, w_pg, d_pg) + kl_coef * AGG(k3, w_kl, d_kl)
        w_pg = M;  w_kl = M if kl_masked else valid
        d_pg = M if normalize_over == 'selected' else valid;  d_kl = w_kl if 'selected' else valid

    with ``surr`` from :func:`clipped_surrogate` (``adv`` broadcast over T) and ``k3`` from
    :func:`k3_kl`. AGG over the mini-batch, ``i`` over its R real responses (rows with a valid token):

        seq-mean-token-mean       (1/R) sum_i [ sum_t w x / max(1, sum_t d) ]     (default, ICT Eq. 11)
        token-mean                sum w x / max(1, sum d)                          (DAPO, STAPO)
        seq-mean-token-sum-norm   sum w x / (R * T)        T = max_new_tokens (Dr.GRPO)

    (1/R reads 1/max(1, R).) Weights are applied as ``where(w > 0, x, 0)`` and the inputs of every
    masked-out token are replaced by 0 before use, so NaN or inf log-probs at padding never reach the
    value or the gradient: tokens with M = 0 get exactly zero policy gradient, and exactly zero total
    gradient when ``kl_masked`` or ``kl_coef == 0``.

    ``logp_ref`` may be None when ``config.kl_coef == 0`` (the KL metrics are then 0). ``denoms``: the
    mini-batch :class:`LossDenominators` when this call sees one micro-batch of it; None computes them
    from the given arrays. With denoms supplied the loss and every metric are additive over
    micro-batches. ``max_new_tokens``: Dr.GRPO's T; None = ``logp.shape[-1]`` (a step on a batch cut to a
    response bucket passes the uncut width, so cutting trailing padding changes nothing).

    Returns ``(loss, metrics)``; metrics (float32 device scalars, docs/method.md §5 names, stop-gradient):
    ``loss/policy`` (= -AGG(surr, ...)), ``loss/kl`` (= AGG(k3, ...), without kl_coef),
    ``kl/valid_mean`` (mean k3 over valid tokens, comparable across methods), ``clip/frac_selected``,
    ``clip/frac_unselected`` (clipped = (A > 0 and r > 1 + eps_high) or (A < 0 and r < 1 - eps_low),
    over selected / valid-but-unselected tokens) and ``mask/selected_frac`` (sum M / sum valid).
    """
    if logp_ref is None and config.kl_coef != 0:
        raise ValueError("policy_loss: logp_ref is required when kl_coef != 0")
    if denoms is None:
        denoms = loss_denominators(valid, mask, config)
    valid_b, sel_b, wkl_b, dpg_b, dkl_b = _weights(valid, mask, config)
    logp, logp_old = logp.astype(F32), logp_old.astype(F32)
    adv_BT = jnp.broadcast_to(adv.astype(F32)[:, None], logp.shape)
    clip_kw = dict(eps_low=config.eps_low, eps_high=config.eps_high, dual_clip_c=config.dual_clip_c)
    agg = config.loss_agg
    T = logp.shape[-1] if max_new_tokens is None else max_new_tokens

    # Policy term: every input of an unselected token is zeroed first (double where), so its
    # gradient is exactly 0 whatever logp holds there.
    surr, _ = clipped_surrogate(jnp.where(sel_b, logp, 0.0), jnp.where(sel_b, logp_old, 0.0),
                                jnp.where(sel_b, adv_BT, 0.0), **clip_kw)
    pg = -_aggregate(surr, sel_b, dpg_b, denoms.pg_tokens, denoms.num_responses, denoms.pg_rows, agg, T)
    loss = pg

    kl, kl_valid_sum = _kl_term(logp, logp_ref, valid_b, wkl_b, dkl_b, denoms, agg, T)
    if logp_ref is not None and config.kl_coef != 0:
        loss = loss + config.kl_coef * kl

    # Diagnostics over every valid token (stop-gradient).
    clipped = _clipped(logp, logp_old, adv_BT, valid_b, config)
    unselected = denoms.valid_tokens - denoms.selected_tokens

    def frac(num: Array, den: Array) -> Array:
        return num.astype(F32) / jnp.maximum(den, 1.0)

    metrics = {
        "loss/policy": pg,
        "loss/kl": kl,
        "kl/valid_mean": frac(kl_valid_sum, denoms.valid_tokens),
        "clip/frac_selected": frac((clipped & sel_b).sum(), denoms.selected_tokens),
        "clip/frac_unselected": frac((clipped & ~sel_b).sum(), unselected),
        "mask/selected_frac": frac(sel_b.sum(), denoms.valid_tokens),
    }
    return loss, jax.lax.stop_gradient(metrics)


def micro_batch_loss(
    logp: Float[Array, "B T"],
    logp_old: Float[Array, "B T"],
    logp_ref: Float[Array, "B T"] | None,
    adv: Float[Array, " B"],
    valid: Mask,
    mask: Mask,
    *,
    config: LossSection,
    denoms: LossDenominators | None,
    micro_batches: int = 1,
    max_new_tokens: int | None = None,
) -> tuple[Float[Array, ""], dict[str, Float[Array, ""]]]:
    """The loss of one of a mini-batch's ``micro_batches`` micro-batches, by ``config.normalize_scope``
    (docs/loss.md "Micro-batches"); summed over the micro-batches it is the mini-batch's loss.

    - ``mini_batch`` (default): :func:`policy_loss` with the mini-batch's ``denoms`` (a partial sum).
    - ``micro_batch`` (20-Entropy's official code: verl divides each micro-batch's loss by its own counts
      and scales it by 1 / the number of micro-batches): :func:`policy_loss` with this micro-batch's own
      denominators, divided by ``micro_batches``. With ``token-mean`` and ``normalize_over: selected`` the
      mini-batch loss is (1/n) sum_m [ -sum_{M in m} surr / max(1, #M in m) ] (+ the KL term alike).

    The metrics other than ``loss/policy`` and ``loss/kl`` (fractions over the mini-batch) always use
    ``denoms``, so they stay partial sums; ``loss/policy`` and ``loss/kl`` are the terms of the loss
    returned. ``denoms`` None: the given arrays are the whole mini-batch."""
    loss, metrics = policy_loss(logp, logp_old, logp_ref, adv, valid, mask, config=config, denoms=denoms,
                                max_new_tokens=max_new_tokens)
    if config.normalize_scope == "mini_batch":
        return loss, metrics
    if config.normalize_scope != "micro_batch":
        raise ValueError(f"normalize_scope: {config.normalize_scope!r}; allowed: ['mini_batch', 'micro_batch']")
    own, own_metrics = policy_loss(logp, logp_old, logp_ref, adv, valid, mask, config=config, denoms=None,
                                   max_new_tokens=max_new_tokens)
    n = float(micro_batches)
    metrics = dict(metrics, **{k: own_metrics[k] / n for k in ("loss/policy", "loss/kl")})
    return own / n, metrics


def mini_batch_loss(
    logp: Float[Array, "B T"],
    logp_old: Float[Array, "B T"],
    logp_ref: Float[Array, "B T"] | None,
    adv: Float[Array, " B"],
    valid: Mask,
    mask: Mask,
    *,
    config: LossSection,
    micro_batches: int = 1,
    max_new_tokens: int | None = None,
) -> tuple[Float[Array, ""], dict[str, Float[Array, ""]]]:
    """The loss and metrics of a whole mini-batch cut into ``micro_batches`` contiguous micro-batches of
    equal rows, as the train step accumulates them (:func:`micro_batch_loss` summed): under
    ``normalize_scope: mini_batch`` the same as :func:`policy_loss` on the whole (to float32 rounding), under
    ``micro_batch`` the mean of the micro-batches' own losses. For notebooks and tests."""
    B = logp.shape[0]
    if micro_batches < 1 or B % micro_batches:
        raise ValueError(f"micro_batches={micro_batches} must be >= 1 and divide the mini-batch's {B} rows")
    denoms = loss_denominators(valid, mask, config)
    r = B // micro_batches
    total, metrics = None, None
    for i in range(micro_batches):
        sl = slice(i * r, (i + 1) * r)
        part = micro_batch_loss(logp[sl], logp_old[sl], None if logp_ref is None else logp_ref[sl], adv[sl],
                                jnp.asarray(valid)[sl], jnp.asarray(mask)[sl], config=config, denoms=denoms,
                                micro_batches=micro_batches, max_new_tokens=max_new_tokens)
        total = part if total is None else jax.tree.map(jnp.add, total, part)
    loss, metrics = total
    return loss, metrics
