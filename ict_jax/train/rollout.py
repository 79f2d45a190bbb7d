"""One rollout batch, as plain functions of a run's parts and its train state (docs/architecture.md
data path): the next P prompts -> G responses each with the CURRENT policy (the state's own arrays: no
copy, no weight sync) -> decoded and scored by the reward workers -> with ``rl.adv.drop_zero_std_groups``
(DAPO) uninformative groups refilled from further prompt batches -> a :class:`RolloutBatch` on the mesh.

    batch, metrics = collect_rollout(parts, state, step)

The sampler's key of RL step s is ``fold_in(fold_in(root, SAMPLER_STREAM), s)`` (``ict_jax.rng``), a
refill r's ``fold_in(that, r)``; ``rollout.chunks`` splits each generation into sequential calls
(:meth:`ict_jax.train.programs.RunPrograms.rollout`). The next rollout needs the updated weights, so
scoring cannot overlap the next generation on-policy.
"""

from __future__ import annotations

import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from ict_jax.data.prompts import PromptBatch, pad_left
from ict_jax.model.tokenizers import decode_response
from ict_jax.rewards.checks import CUSTOM_KIND
from ict_jax.rl.batch import RolloutBatch, build_rollout_batch
from ict_jax.rl.dynamic_sampling import informative_groups
from ict_jax.rl.state import TrainState
from ict_jax.rng import SAMPLER_STREAM, stream_key
from ict_jax.sampling.sampler import Rollout
from ict_jax.sharding import shard_batch, to_host
from ict_jax.train.parts import RunParts

#: ``score(parts, prompts, tokens, valid) -> rewards [P*G]``: how responses are scored (tests pass another)
Scorer = Callable[[RunParts, PromptBatch, np.ndarray, np.ndarray], np.ndarray]
_ROLLOUT_FIELDS = ("tokens", "valid", "logp", "lengths", "truncated")


def score_rollout(parts: RunParts, pb: PromptBatch, tokens: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """Rewards of all rows (host arrays ``tokens``/``valid [P*G, N]``, rows prompt-major). Each process
    decodes and checks its contiguous share of the rows in its reward workers; the shares are
    all-gathered. ``rl.reward.fn`` scores every training response (the datasets' kinds still shape the
    SFT targets)."""
    G, B = parts.config.rollout.num_samples, tokens.shape[0]
    n_proc, me = jax.process_count(), jax.process_index()
    per = -(-B // n_proc)
    mine = range(me * per, min(B, (me + 1) * per))
    texts = [decode_response(parts.tokenizer, tokens[i], valid[i]) for i in mine]
    custom = parts.config.rl.reward.fn is not None
    kinds = [CUSTOM_KIND if custom else parts.prompts.kinds[int(pb.indices[i // G])] for i in mine]
    golds = [pb.examples[i // G].answer for i in mine]
    metas = [pb.examples[i // G].meta for i in mine]
    local = np.zeros(per, np.float32)
    if texts:
        local[:len(texts)] = parts.pool.score(kinds, texts, golds, metas)
    if n_proc == 1:
        return local[:B]
    return np.asarray(multihost_utils.process_allgather(local)).reshape(-1)[:B]


def generate_and_score(parts: RunParts, state: TrainState, key: jax.Array, score: Scorer = score_rollout
                       ) -> tuple[PromptBatch, Rollout, np.ndarray]:
    """The next P prompts of the run's iterator, G responses each from ``state``'s policy (host arrays)
    and their rewards."""
    pb = next(parts.iterator)
    ro = parts.programs.rollout(state.model_state(), pb.ids, pb.mask, key)
    return pb, ro, score(parts, pb, np.asarray(ro.tokens), np.asarray(ro.valid))


def informative(parts: RunParts, pb: PromptBatch, rewards: np.ndarray) -> np.ndarray:
    """[P] bool: real prompts whose group is informative (``rl.adv.filter_on``, docs/method.md §3)."""
    cfg = parts.config
    return pb.valid.astype(bool) & informative_groups(rewards, cfg.rollout.num_samples, cfg.rl.adv.filter_on,
                                                      cfg.rl.reward.correct)


def refill(parts: RunParts, state: TrainState, key: jax.Array, pb: PromptBatch, ro: Rollout, rewards: np.ndarray,
           score: Scorer = score_rollout) -> tuple[np.ndarray, np.ndarray, Rollout, np.ndarray, np.ndarray, int]:
    """DAPO dynamic sampling: the uninformative groups' places taken by informative groups of up to
    ``rl.adv.max_refill`` further prompt batches (refill r sampled with ``fold_in(key, r)``), in order.
    Returns (ids, mask, rollout, rewards, group_ok [P], refills); slots still empty keep ``group_ok`` False."""
    G, pad = parts.config.rollout.num_samples, parts.tokenizer.pad_id
    group_ok = informative(parts, pb, rewards)
    ids, mask, rewards = pb.ids.copy(), pb.mask.copy(), rewards.copy()
    fields = {f: np.array(getattr(ro, f)) for f in _ROLLOUT_FIELDS}
    refills = 0
    while not group_ok.all() and refills < parts.config.rl.adv.max_refill:
        refills += 1
        pb2, ro2, rew2 = generate_and_score(parts, state, jax.random.fold_in(key, refills), score)
        donors, holes = list(np.flatnonzero(informative(parts, pb2, rew2))), list(np.flatnonzero(~group_ok))
        if not donors:
            continue
        width = max(ids.shape[1], pb2.ids.shape[1])
        ids, mask = pad_left(ids, width, pad, mask)
        ids2, mask2 = pad_left(pb2.ids, width, pad, pb2.mask)
        for hole, donor in zip(holes, donors):
            ids[hole], mask[hole] = ids2[donor], mask2[donor]
            rows, rows2 = slice(hole * G, (hole + 1) * G), slice(donor * G, (donor + 1) * G)
            for f, arr in fields.items():
                arr[rows] = np.asarray(getattr(ro2, f))[rows2]
            rewards[rows] = rew2[rows2]
            group_ok[hole] = True
    return ids, mask, ro.replace(**fields), rewards, group_ok, refills


class TimedScorer:
    """A :data:`Scorer` that adds the seconds spent in the wrapped scorer (decoding the responses and
    checking their answers) to :attr:`seconds`, so a step's rollout time splits into sampling and rewards."""

    def __init__(self, score: Scorer):
        self.score, self.seconds = score, 0.0

    def __call__(self, parts: RunParts, pb: PromptBatch, tokens: np.ndarray, valid: np.ndarray) -> np.ndarray:
        t0 = time.perf_counter()
        try:
            return self.score(parts, pb, tokens, valid)
        finally:
            self.seconds += time.perf_counter() - t0


def collect_rollout(parts: RunParts, state: TrainState, step: int, *, score: Scorer = score_rollout
                    ) -> tuple[RolloutBatch, dict[str, float]]:
    """Prompts -> G responses -> rewards -> a :class:`RolloutBatch` placed on the mesh, for RL step
    ``step``, and the rollout's metrics (``time/rollout_s``, ``rollout/kept_row_frac``,
    ``rollout/refills``, and ``_tokens``: the batch's valid response tokens, for the throughput).

    Every process holds the same host data (the same seeded prompt iterator) and builds the same batch.
    With ``rl.adv.drop_zero_std_groups`` a group whose G responses are all correct or all wrong
    (``rl.adv.filter_on``) is refilled (:func:`refill`); slots still empty stay in the batch with
    ``row_valid = 0`` (out of the loss and its denominators)."""
    cfg = parts.config
    G = cfg.rollout.num_samples
    t0 = time.perf_counter()
    key = stream_key(state.rng, SAMPLER_STREAM, step)
    timed = TimedScorer(score)
    pb, ro, rewards = generate_and_score(parts, state, key, timed)
    ids, mask, group_ok, refills = pb.ids, pb.mask, pb.valid.astype(bool), 0
    if cfg.rl.adv.drop_zero_std_groups:
        ids, mask, ro, rewards, group_ok, refills = refill(parts, state, key, pb, ro, rewards, timed)
    t_roll = time.perf_counter() - t0
    correct = (rewards >= cfg.rl.reward.correct).astype(np.float32)
    row_valid = np.repeat(group_ok.astype(np.float32), G)
    batch = to_host(build_rollout_batch(ids, mask, ro, rewards, config=cfg, correct=correct, row_valid=row_valid))
    n_tokens = float(np.asarray(batch.response_valid).sum())  # on the host copy (multi-process safe)
    batch = shard_batch(batch, parts.mesh) if parts.mesh.size > 1 else jax.tree.map(jnp.asarray, batch)
    return batch, {"time/rollout_s": t_roll, "time/sample_s": t_roll - timed.seconds,
                   "time/rewards_s": timed.seconds, "rollout/kept_row_frac": float(row_valid.mean()),
                   "rollout/refills": float(refills), "_tokens": n_tokens}
