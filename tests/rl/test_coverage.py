"""What a selector reaches (docs/method.md §5): the four shares of the selected tokens against a batch
counted by hand and against a float64 NumPy reference written from the definitions, and the selected
share by position bin."""

import jax.numpy as jnp
import numpy as np
import pytest

from ict_jax.rl.coverage import REACH_KEYS, reach_shares, response_lengths, selected_share_by_bin

G, T = 3, 6


def _rows(lengths):
    rv = np.zeros((len(lengths), T), np.float32)
    for i, n in enumerate(lengths):
        rv[i, :n] = 1
    return rv


# P 2 x G 3, T 6. Group 0: lengths 3, 5 (both ended with EOS) and 6 (truncated: hit the limit, no EOS).
# Group 1: lengths 4 and 2, and a row that does not count (row_valid 0, length 1, selected, A < 0):
# were it counted, group 1's shortest response would be 1 long and every share would change.
LENGTHS = [3, 5, 6, 4, 1, 2]
TRUNCATED = np.array([0, 0, 1, 0, 0, 0], np.float32)
ROW_VALID = np.array([1, 1, 1, 1, 0, 1], np.float32)
ADV = np.array([1.0, -0.5, -0.5, 0.7, -1.0, -0.7], np.float32)
MASK = np.array([
    [0, 1, 1, 0, 1, 0],  # t 1, 2 (t 2 its EOS); t 4 is padding: not selected
    [1, 0, 0, 1, 1, 0],  # t 0, 3, 4 (t 4 its EOS); group 0's shortest is 3 long: t 3, 4 after it
    [0, 0, 1, 0, 0, 1],  # t 2, 5 (truncated: t 5 is its last token, no EOS); t 5 after the shortest
    [0, 0, 1, 1, 0, 0],  # t 2, 3 (t 3 its EOS); group 1's shortest (of the rows that count) is 2: both after
    [1, 0, 0, 0, 0, 0],  # a row that does not count
    [0, 1, 0, 0, 0, 0],  # t 1, its EOS, the shortest response's own EOS: not after it
], np.float32)


def test_reach_shares_hand_computed():
    m = reach_shares(jnp.asarray(MASK), jnp.asarray(_rows(LENGTHS)), jnp.asarray(TRUNCATED), jnp.asarray(ADV), G,
                     jnp.asarray(ROW_VALID))
    assert list(m) == list(REACH_KEYS)
    # 10 selected tokens (2 + 3 + 2 + 2 + 0 + 1): EOS at rows 0, 1, 3, 5; after the shortest: 2 (row 1) +
    # 1 (row 2) + 2 (row 3); on the truncated row: 2; with A < 0: rows 1, 2, 5 = 3 + 2 + 1
    want = {"mask/selected_eos_frac": 4, "mask/selected_after_shortest_frac": 5, "mask/selected_truncated_frac": 2,
            "mask/selected_neg_adv_frac": 6}
    for k, count in want.items():
        assert m[k].dtype == jnp.float32
        assert float(m[k]) == float(np.float32(count) / np.float32(10)), k


def test_reach_shares_nothing_selected_gives_zero():
    m = reach_shares(jnp.zeros((6, T)), jnp.asarray(_rows(LENGTHS)), jnp.asarray(TRUNCATED), jnp.asarray(ADV), G,
                     jnp.asarray(ROW_VALID))
    assert {k: float(v) for k, v in m.items()} == dict.fromkeys(REACH_KEYS, 0.0)
    # a mask only on padding and on rows that do not count selects nothing either
    only_padding = np.where(_rows(LENGTHS) > 0, 0, 1).astype(np.float32)
    only_padding[4] = 1
    m = reach_shares(jnp.asarray(only_padding), jnp.asarray(_rows(LENGTHS)), jnp.asarray(TRUNCATED),
                     jnp.asarray(ADV), G, jnp.asarray(ROW_VALID))
    assert all(float(v) == 0.0 for v in m.values())


def test_response_lengths():
    assert response_lengths(jnp.asarray(_rows(LENGTHS))).tolist() == LENGTHS
    assert response_lengths(jnp.asarray(_rows(LENGTHS)), jnp.asarray(ROW_VALID)).tolist() == [3, 5, 6, 4, 0, 2]


def _reference(mask, rv, truncated, adv, group_size, row_valid):
    """float64 NumPy, a loop over tokens from the definitions of docs/method.md §5 (ict_jax.rl.coverage)."""
    B, Tn = rv.shape
    length = [int(rv[i].sum()) if row_valid[i] > 0 else 0 for i in range(B)]
    counts = dict.fromkeys(REACH_KEYS, 0)
    n = 0
    for i in range(B):
        g = i // group_size
        members = [j for j in range(g * group_size, (g + 1) * group_size) if row_valid[j] > 0]
        shortest = min(length[j] for j in members)
        for t in range(Tn):
            if not (mask[i, t] > 0 and rv[i, t] > 0 and row_valid[i] > 0):
                continue
            n += 1
            counts["mask/selected_eos_frac"] += t == length[i] - 1 and truncated[i] == 0
            counts["mask/selected_after_shortest_frac"] += t >= shortest
            counts["mask/selected_truncated_frac"] += truncated[i] > 0
            counts["mask/selected_neg_adv_frac"] += adv[i] < 0
    return {k: np.float64(c) / max(n, 1) for k, c in counts.items()}


@pytest.mark.parametrize("seed", range(4))
def test_reach_shares_against_numpy(seed):
    rng = np.random.default_rng(seed)
    P, Gn, Tn = 3, 4, 9
    B = P * Gn
    lengths = rng.integers(1, Tn + 1, B)
    rv = np.zeros((B, Tn), np.float32)
    for i, n in enumerate(lengths):
        rv[i, :n] = 1
    truncated = ((lengths == Tn) & (rng.random(B) < 0.7)).astype(np.float32)
    row_valid = np.ones(B, np.float32)
    row_valid[rng.integers(0, B)] = 0
    adv = rng.normal(size=B).astype(np.float32)
    adv[rng.integers(0, B)] = 0.0
    mask = (rng.random((B, Tn)) < 0.4).astype(np.float32)
    got = reach_shares(jnp.asarray(mask), jnp.asarray(rv), jnp.asarray(truncated), jnp.asarray(adv), Gn,
                       jnp.asarray(row_valid))
    want = _reference(mask, rv, truncated, adv, Gn, row_valid)
    assert 0 < want["mask/selected_after_shortest_frac"] < 1 and 0 < want["mask/selected_eos_frac"] < 1
    for k in REACH_KEYS:
        np.testing.assert_allclose(float(got[k]), want[k], rtol=1e-6, atol=1e-7, err_msg=k)


def test_reach_shares_needs_whole_groups():
    with pytest.raises(ValueError, match="group_size"):
        reach_shares(jnp.zeros((5, T)), jnp.zeros((5, T)), jnp.zeros(5), jnp.zeros(5), 3)


def test_selected_share_by_bin_hand_computed():
    Tn = 40  # bins of 16: [0, 16), [16, 32), [32, 40)
    valid = np.zeros((2, Tn), np.float32)
    valid[0, :40] = 1
    valid[1, :20] = 1
    mask = np.zeros((2, Tn), np.float32)
    mask[0, [0, 1, 2, 20]] = 1
    mask[1, [17, 25]] = 1  # t 25 is padding in row 1
    share, n_valid = selected_share_by_bin(jnp.asarray(mask), jnp.asarray(valid), 16)
    assert n_valid.tolist() == [32, 20, 8]
    assert share.dtype == jnp.float32
    assert share.tolist() == [float(np.float32(3) / np.float32(32)), float(np.float32(2) / np.float32(20)), 0.0]


def test_selected_share_by_bin_empty_bin_is_zero():
    valid = np.zeros((1, 48), np.float32)
    valid[0, :20] = 1
    share, n_valid = selected_share_by_bin(jnp.asarray(valid), jnp.asarray(valid), 16)  # everything valid selected
    assert n_valid.tolist() == [16, 4, 0] and share.tolist() == [1.0, 1.0, 0.0]
    with pytest.raises(ValueError, match="bin_size"):
        selected_share_by_bin(jnp.asarray(valid), jnp.asarray(valid), 0)
