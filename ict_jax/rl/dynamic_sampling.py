"""DAPO's dynamic sampling: which groups of a rollout batch are informative (``rl.adv.drop_zero_std_groups``,
``rl.adv.filter_on``; docs/method.md §3, docs/config.md).

A group whose G responses all get the same value carries no policy gradient from that value; dynamic
sampling drops such groups and refills the batch. What "the same" is judged on is the choice DAPO's users
have (verl's ``algorithm.filter_groups.metric``):

- ``correct`` (the default, DAPO's own definition: keep a prompt only when 0 < #correct < G, Yu et al.
  2025, Eq. 11; verl's DAPO recipe filters on ``acc``): a group is informative when its responses are not
  all right or all wrong. A group that is all wrong but whose rewards differ only through a format
  penalty (``rl.reward.no_answer < 0``) or a partial score is dropped: it teaches format, not answers.
- ``reward``: informative when the total rewards differ (max > min). Keeps such format-only groups: for
  shaped rewards where the shaping is what is being trained.

Host-side NumPy (the trainer decides on the rewards it has gathered); float64 comparisons, exact.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

__all__ = ["FilterOn", "informative_groups"]

#: What dynamic sampling judges a group on (``rl.adv.filter_on``).
FilterOn = Literal["reward", "correct"]


def informative_groups(rewards: np.ndarray, group_size: int, filter_on: str = "correct",
                       correct_reward: float = 1.0) -> np.ndarray:
    """``bool [P]``: group p (rows ``p*G .. p*G+G-1`` of ``rewards [P*G]``, prompt-major) is informative.

    ``filter_on="correct"``: its responses are not all correct and not all wrong, a response being correct
    when its reward is at least ``correct_reward`` (``rl.reward.correct``, as the trainer's
    ``reward/accuracy``); ``"reward"``: its rewards are not all equal (max > min)."""
    r = np.asarray(rewards, np.float64)
    G = int(group_size)
    if G < 1 or r.ndim != 1 or r.size % G:
        raise ValueError(f"informative_groups: {r.shape} rewards are not P groups of group_size={group_size}")
    if filter_on == "correct":
        values = (r >= float(correct_reward)).astype(np.float64)
    elif filter_on == "reward":
        values = r
    else:
        raise ValueError(f"filter_on must be 'reward' or 'correct', got {filter_on!r}")
    grouped = values.reshape(-1, G)
    return grouped.max(axis=1) > grouped.min(axis=1)
