"""Length buckets: the few static lengths a varying length is padded up to, one compiled program each.

Prompts are left-padded to a bucket of ``rollout.max_prompt_len`` (:mod:`ict_jax.data.prompts`); the
response axis of a rollout batch is cut to a bucket of ``rollout.max_new_tokens`` before the update
(:mod:`ict_jax.rl.train_step`), and the decode attends over a growing bucket of the KV cache
(:mod:`ict_jax.sampling.sampler`). One ladder for all of them: :func:`make_buckets`. This module
imports nothing of ict_jax, so every layer may use it.
"""

from __future__ import annotations

from collections.abc import Sequence


def make_buckets(max_len: int, smallest: int = 32) -> tuple[int, ...]:
    """Powers of two from ``smallest`` below ``max_len``, then ``max_len``: one compiled shape each."""
    buckets, b = [], smallest
    while b < max_len:
        buckets.append(b)
        b *= 2
    return (*buckets, max_len)


def bucket_for(length: int, buckets: Sequence[int]) -> int:
    """The smallest bucket that holds ``length``; ValueError past the largest."""
    for b in sorted(buckets):
        if length <= b:
            return b
    raise ValueError(f"length {length} exceeds the largest bucket {max(buckets)}")


def response_buckets(max_new_tokens: int, smallest: int | None) -> tuple[int, ...]:
    """The response-length buckets of ``rollout.max_new_tokens`` (``rollout.min_response_bucket`` =
    ``smallest``): :func:`make_buckets` from ``smallest`` up to ``max_new_tokens``; ``None`` (bucketing
    off) gives the one length ``max_new_tokens``."""
    if smallest is None:
        return (int(max_new_tokens),)
    if smallest < 1:
        raise ValueError(f"rollout.min_response_bucket: {smallest} must be at least 1 (null turns buckets off)")
    return make_buckets(int(max_new_tokens), int(smallest))
