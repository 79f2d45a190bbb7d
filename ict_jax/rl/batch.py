"""One rollout batch as the train step sees it: prompts, G responses each, rewards and advantages."""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
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


@jax.jit
def _extent_on_device(response_valid: jax.Array, row_valid: jax.Array) -> jax.Array:
    pos = jnp.arange(1, response_valid.shape[1] + 1, dtype=jnp.int32)
    counted = (response_valid > 0) & (row_valid[:, None] > 0)
    return jnp.max(jnp.where(counted, pos[None, :], 0), initial=0)


def response_extent(batch: RolloutBatch) -> int:
    """The longest response that counts: 1 + the last response position valid in a real row
    (``response_valid`` and ``row_valid``), 0 when there is none. Responses are right-padded, so every
    column from there on is padding in every row that counts (the filler rows of dynamic sampling,
    ``row_valid = 0``, count nowhere: not in the loss, the statistics or the metrics).

    Host arrays are read directly; device arrays are reduced on their devices and one scalar comes
    back, replicated: with a batch sharded over several processes every process gets the extent of the
    global batch (the same bucket everywhere)."""
    if isinstance(batch.response_valid, jax.Array):
        return int(_extent_on_device(batch.response_valid, batch.row_valid))
    counted = (np.asarray(batch.response_valid) > 0) & (np.asarray(batch.row_valid)[:, None] > 0)
    cols = np.flatnonzero(counted.any(axis=0))
    return int(cols[-1]) + 1 if cols.size else 0


def trim_response(batch: RolloutBatch, length: int) -> RolloutBatch:
    """``batch`` with its response axis cut to the first ``length`` positions (Lr -> ``length``): the
    response columns of ``tokens`` and ``attention_mask``, ``response_valid`` and ``sampler_logp``.
    Only trailing columns go, so the position alignment of a group (docs/method.md §1) is kept; cut at
    :func:`response_extent` or later and nothing that counts is lost. Static slicing: works on host
    arrays, device arrays and inside ``jit``."""
    Lr = batch.response_len
    if not 1 <= length <= Lr:
        raise ValueError(f"response length {length}: a batch of {Lr} response positions keeps 1..{Lr}")
    if length == Lr:
        return batch
    keep = batch.tokens.shape[1] - (Lr - length)  # prompt + the first `length` response positions
    return batch.replace(tokens=batch.tokens[:, :keep], attention_mask=batch.attention_mask[:, :keep],
                         response_valid=batch.response_valid[:, :length], sampler_logp=batch.sampler_logp[:, :length])


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
