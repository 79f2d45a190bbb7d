"""One rollout batch as the train step sees it: prompts, G responses each, rewards and advantages."""

from __future__ import annotations

from typing import Any

import flax.struct
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from ict_jax.config import Config
from ict_jax.rl.losses import group_advantages

F32 = jnp.float32


@flax.struct.dataclass
class RolloutBatch:
    """One rollout batch, B = P*G rows prompt-major (row = p*G + j); Lr = max_new_tokens.

    ``tokens[B, Lp+Lr]``: the prompt left-padded to Lp, then the response right-padded to Lr;
    ``attention_mask`` marks real tokens of both; ``response_valid[B, Lr]`` the response tokens that
    count (the EOS included). ``row_valid[B]`` is 0 for filler rows of a bucketed batch.
    ``correct[B]`` is 1 where the final answer was right (``reward/accuracy``).
    """

    tokens: Int[Array, "B L"]
    attention_mask: Int[Array, "B L"]
    response_valid: Float[Array, "B Lr"]
    rewards: Float[Array, " B"]
    advantages: Float[Array, " B"]
    sampler_logp: Float[Array, "B Lr"]
    truncated: Float[Array, " B"]
    row_valid: Float[Array, " B"]
    correct: Float[Array, " B"]

    @property
    def response_len(self) -> int:
        return self.response_valid.shape[1]


def build_rollout_batch(prompt_ids: Int[Array, "P Lp"], prompt_mask: Int[Array, "P Lp"], rollout: Any,
                        rewards: Float[Array, " B"], *, config: Config, correct: Float[Array, " B"] | None = None,
                        row_valid: Float[Array, " B"] | None = None) -> RolloutBatch:
    """A :class:`RolloutBatch` from left-padded prompts, an :class:`~ict_jax.sampling.sampler.Rollout` of G samples per
    prompt and per-row rewards; advantages by docs/method.md §3 (``config.rl.adv``)."""
    G = config.rollout.num_samples
    B = rollout.tokens.shape[0]
    rewards = jnp.asarray(rewards, F32)
    row_valid = jnp.ones((B,), F32) if row_valid is None else jnp.asarray(row_valid, F32)
    correct = (rewards >= 1.0).astype(F32) if correct is None else jnp.asarray(correct, F32)
    ids = jnp.repeat(jnp.asarray(prompt_ids, jnp.int32), G, axis=0)
    pm = jnp.repeat(jnp.asarray(prompt_mask, jnp.int32), G, axis=0)
    valid = rollout.valid.astype(jnp.int32)
    adv = group_advantages(rewards, G, config.rl.adv.scale_rewards, config.rl.adv.eps, row_valid)
    return RolloutBatch(tokens=jnp.concatenate([ids, rollout.tokens.astype(jnp.int32)], axis=1),
                        attention_mask=jnp.concatenate([pm, valid], axis=1), response_valid=valid.astype(F32),
                        rewards=rewards, advantages=adv, sampler_logp=rollout.logp.astype(F32),
                        truncated=rollout.truncated.astype(F32), row_valid=row_valid, correct=correct)
