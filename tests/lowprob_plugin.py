"""A plugin module for the tests (``plugins: [lowprob_plugin]``, the tests folder on the path): it registers a
``reversed`` reward kind (the response is the gold answer written backwards), a ``row-sum-mean`` loss
aggregation (each response's term summed, averaged over the responses with a
denominator token) and a ``lowprob`` selector, the lowest-probability 10 % of each response's valid tokens by p(o_t), from its own
file. Nothing in ict_jax names it: the selector registry, the config check and the train step take it as a
built-in. ``rl.selector.params.invert: true`` keeps the most likely tokens instead (a params dataclass)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from ict_jax.rewards.checks import RewardCheck, register_reward_kind
from ict_jax.rl.losses import AggInputs, register_loss_agg
from ict_jax.rl.selectors import register_selector, resolved_rho, resolved_scope, topk_mask


@dataclasses.dataclass(frozen=True)
class LowProbParams:
    invert: bool = False  # True: the most likely tokens instead


def lowprob(stats, adv, valid, *, key, step, config, group_size, params: LowProbParams):
    score = stats.logp if params.invert else -stats.logp
    return topk_mask(score, valid, rho=resolved_rho(config), scope=resolved_scope(config), group_size=group_size,
                     ties=config.ties)


register_selector("lowprob", lowprob, needs=("logp",), rho=0.1, scope="sequence", topk=True, params=LowProbParams)


def row_sum_mean(a: AggInputs):
    return a.xw.sum() / jnp.maximum(a.rows, 1.0)


register_loss_agg("row-sum-mean", row_sum_mean)


def reversed_check(text, gold, meta, spec):
    ans = text.strip() or None
    if ans is None:
        return RewardCheck(spec.no_answer, False, None, "no_answer")
    ok = ans == str(gold).strip()[::-1]
    return RewardCheck(spec.correct if ok else spec.wrong, ok, ans)


register_reward_kind("reversed", reversed_check, answer=lambda gold: str(gold).strip()[::-1])
