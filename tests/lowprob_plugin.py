"""A plugin module for the tests (``plugins: [lowprob_plugin]``, the tests folder on the path): it registers a
``lowprob`` selector, the lowest-probability 10 % of each response's valid tokens by p(o_t), from its own
file. Nothing in ict_jax names it: the selector registry, the config check and the train step take it as a
built-in. ``rl.selector.params.invert: true`` keeps the most likely tokens instead (a params dataclass)."""

from __future__ import annotations

import dataclasses

from ict_jax.rl.selectors import register_selector, resolved_rho, resolved_scope, topk_mask


@dataclasses.dataclass(frozen=True)
class LowProbParams:
    invert: bool = False  # True: the most likely tokens instead


def lowprob(stats, adv, valid, *, key, step, config, group_size, params: LowProbParams):
    score = stats.logp if params.invert else -stats.logp
    return topk_mask(score, valid, rho=resolved_rho(config), scope=resolved_scope(config), group_size=group_size,
                     ties=config.ties)


register_selector("lowprob", lowprob, needs=("logp",), rho=0.1, scope="sequence", topk=True, params=LowProbParams)
