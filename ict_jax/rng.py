"""Every random stream of a run, in one place (docs/architecture.md "RNG"). Imports nothing of ict_jax:
every layer may import it.

A run has one ``seed``. Each stream is derived from it, never from another stream's draws:

- JAX streams: ``fold_in(root, STREAM)`` then ``fold_in(step)`` (:func:`stream_key`), ``root =
  PRNGKey(seed)`` (:func:`root_key`; the train state's ``rng``);
- NumPy streams (host-side data orders): ``default_rng([seed, STREAM, step or epoch])``
  (:func:`numpy_rng`).

So a run reproduces from its seed, and a resumed run continues every stream at its step with nothing
replayed: the draws of step s depend on (seed, stream, s) only.
"""

from __future__ import annotations

import jax
import numpy as np

#: the initial weights of a randomly initialised model (``model.preset`` without ``model.path``)
INIT_STREAM = 0x494E4954  # "INIT"
#: the order of the training prompts: one permutation per epoch (data.prompts.PromptIterator)
DATA_ORDER_STREAM = 0x44415441  # "DATA"
#: the SFT warm start's batches: one draw per SFT step (train.warm_start)
SFT_ORDER_STREAM = 0x53465420  # "SFT "
#: the rollout sampler: one key per RL step (train.rollout), then per chunk and DAPO refill
SAMPLER_STREAM = 0x53414D50  # "SAMP"
#: the random-mask control: per RL step, then per mini-batch (rl.selectors.random_key, docs/method.md §2)
RANDOM_MASK_STREAM = 0x4D41534B  # "MASK"
#: the evaluation sampler: per call of an evaluation, restarted at every evaluation (common random numbers)
EVAL_STREAM = 0x4556414C  # "EVAL"
#: ``ict-jax diagnose``: per batch of prompts
DIAGNOSE_STREAM = 0x44494147  # "DIAG"

#: name -> stream id, for documentation and the test that keeps the ids distinct
STREAMS: dict[str, int] = {"init": INIT_STREAM, "data_order": DATA_ORDER_STREAM, "sft_order": SFT_ORDER_STREAM,
                           "sampler": SAMPLER_STREAM, "random_mask": RANDOM_MASK_STREAM, "eval": EVAL_STREAM,
                           "diagnose": DIAGNOSE_STREAM}


def root_key(seed: int) -> jax.Array:
    """The run's root key, ``PRNGKey(seed)`` (raw ``uint32[2]``, as the train state keeps it)."""
    return jax.random.PRNGKey(int(seed))


def stream_key(root: jax.Array, stream: int, *indices: int | jax.Array) -> jax.Array:
    """``fold_in(root, stream)`` then ``fold_in`` of each index in order (the step, then a chunk or a
    mini-batch). ``root``: a raw or typed key (the result has its kind); indices may be traced."""
    key = jax.random.fold_in(root, stream)
    for i in indices:
        key = jax.random.fold_in(key, i)
    return key


def numpy_rng(seed: int, stream: int, *indices: int) -> np.random.Generator:
    """The NumPy generator of ``stream`` at ``indices`` (a step or an epoch): ``default_rng([seed,
    stream, *indices])``; independent of every other stream and index."""
    return np.random.default_rng([int(seed), int(stream), *(int(i) for i in indices)])
