"""rl/group_stats.py: the one statistics-of-a-group function (train step, inspector, diagnose) against the
full-logits reference path on the session's tiny model, every statistic under every reading of u."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from ict_jax.config import StatsSection
from ict_jax.rl.group_stats import GroupStatsRequest, compiled_group_stats, group_rows, group_stats
from ict_jax.rl.token_stats import ALL_STATS, GROUP_STATS, U_FORMS, stats_from_logits

P, G, LP, N = 2, 3, 4, 6


@pytest.fixture(scope="module")
def rows(tiny_model):
    """Two left-padded prompts, three ragged responses each (one empty), as prompt + response rows."""
    rng = np.random.default_rng(0)
    V = tiny_model.config.vocab_size
    prompts = rng.integers(7, V, (P, LP)).astype(np.int32)
    pmask = np.ones((P, LP), np.int32)
    pmask[1, :2] = 0
    responses = rng.integers(7, V, (P * G, N)).astype(np.int32)
    lengths = np.array([6, 3, 1, 0, 5, 6])
    valid = np.arange(N)[None] < lengths[:, None]
    tokens, mask = group_rows(prompts, pmask, responses, valid, G)
    return tokens, mask, responses, valid


def _reference(model, tokens, mask, responses, valid, u_form, temperature):
    logits = model(tokens[:, :-1], mask[:, :-1])[:, -N:]  # the full [B, N, V] logits
    return stats_from_logits(logits, responses, valid, group_size=G, temperature=temperature, compute=ALL_STATS,
                             u_form=u_form)


def test_group_rows_repeat_each_prompt_for_its_group(rows):
    tokens, mask, responses, valid = rows
    assert tokens.shape == mask.shape == (P * G, LP + N)
    np.testing.assert_array_equal(np.asarray(tokens[:, LP:]), responses)
    np.testing.assert_array_equal(np.asarray(mask[:, LP:]), valid.astype(np.int32))
    np.testing.assert_array_equal(np.asarray(mask[G:, :2]), 0)  # prompt 1's padding, in all of its G rows
    assert np.asarray(tokens[0, :LP]).tolist() == np.asarray(tokens[G - 1, :LP]).tolist()
    with pytest.raises(ValueError, match="5 responses for 2 prompts of group_size=3"):
        group_rows(np.zeros((P, LP)), np.ones((P, LP)), responses[:5], valid[:5], G)


def test_every_statistic_under_every_reading_equals_the_logits_reference(tiny_model, rows):
    tokens, mask, responses, valid = rows
    graphdef, state = nnx.split(tiny_model)
    request = GroupStatsRequest(G, 0.7, 4, ALL_STATS, U_FORMS)
    by_form = compiled_group_stats(graphdef, request)(state, tokens, mask, valid)
    assert set(by_form) == set(U_FORMS)
    for form in U_FORMS:
        ref = _reference(tiny_model, tokens, mask, responses, valid, form, 0.7)
        for name in ALL_STATS:
            np.testing.assert_allclose(np.asarray(getattr(by_form[form], name)), np.asarray(getattr(ref, name)),
                                       rtol=1e-5, atol=2e-6, err_msg=f"{form} {name}")
    # the statistics that do not read the group are computed once, the same under every reading
    for name in set(ALL_STATS) - GROUP_STATS:
        for f in U_FORMS:
            np.testing.assert_array_equal(np.asarray(getattr(by_form[f], name)),
                                          np.asarray(getattr(by_form[U_FORMS[0]], name)))
    assert np.asarray(by_form["pooled"].js).max() > 0


def test_one_reading_is_one_pass_and_the_compiled_function_is_built_once(tiny_model, rows):
    tokens, mask, responses, valid = rows
    graphdef, state = nnx.split(tiny_model)
    request = GroupStatsRequest.from_section(StatsSection(u_form="loo", chunk=4), group_size=G, temperature=1.0)
    assert request == GroupStatsRequest(G, 1.0, 4, ("logp", "H1", "H2", "js"), ("loo",))
    fn = compiled_group_stats(graphdef, request)
    assert compiled_group_stats(graphdef, GroupStatsRequest(G, 1.0, 4, ("logp", "H1", "H2", "js"), ("loo",))) is fn
    got = fn(state, tokens, mask, valid)["loo"]
    ref = _reference(tiny_model, tokens, mask, responses, valid, "loo", 1.0)
    np.testing.assert_allclose(np.asarray(got.js), np.asarray(ref.js), rtol=1e-5, atol=2e-6)
    assert got.pmax is None and got.pbar_tok is None
    # unjitted, as the train step calls it inside its own jit: the same numbers
    again = jax.jit(lambda s: group_stats(s, graphdef, tokens, mask, valid, request))(state)["loo"]
    np.testing.assert_allclose(np.asarray(again.logp), np.asarray(got.logp), rtol=1e-6, atol=1e-7)


def test_without_group_statistics_rows_need_not_hold_whole_groups(tiny_model, rows):
    tokens, mask, responses, valid = rows
    graphdef, state = nnx.split(tiny_model)
    request = GroupStatsRequest(G, 1.0, 4, ("logp", "H1"))
    part = group_stats(state, graphdef, tokens[:4], mask[:4], valid[:4], request)["aligned"]  # 4 rows, G = 3
    ref = _reference(tiny_model, tokens, mask, responses, valid, "aligned", 1.0)
    np.testing.assert_allclose(np.asarray(part.logp), np.asarray(ref.logp)[:4], rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("kwargs, message", [
    ({"compute": ("H3",)}, "compute: unknown statistics"),
    ({"u_forms": ("index",)}, "stats.u_form"),
    ({"u_forms": ()}, "stats.u_form"),
    ({"temperature": 0.0}, "stats.temperature: 0.0 must be > 0"),
    ({"chunk": 0}, "stats.chunk: 0 must be >= 1"),
])
def test_bad_requests_name_the_config_key(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GroupStatsRequest(2, **kwargs)
