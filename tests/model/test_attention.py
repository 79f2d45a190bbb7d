"""``model.attention``: the blocked (flash-style) attention gives the dense one's values and gradients.

The forward is checked against a float64 NumPy softmax attention, the gradients against ``jax.grad`` of the
dense :func:`ict_jax.model.attention.attend`, on grouped-query shapes with causal and left-padding masks,
key lengths that are and are not a multiple of the block, and fully masked (padding) query rows."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ict_jax.model.attention import MASKED, attend, blocked_attend


def _inputs(B=2, T=7, H=4, KV=2, hd=8, S=None, pad=(0, 3), seed=0, dtype=jnp.float32):
    """q, k, v and the causal & key-padding mask of left-padded rows (row b has pad[b] padding tokens)."""
    S = T if S is None else S
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((B, T, H, hd)), dtype)
    k = jnp.asarray(rng.standard_normal((B, KV, S, hd)), dtype)
    v = jnp.asarray(rng.standard_normal((B, KV, S, hd)), dtype)
    mask = np.ones((B, S), bool)
    for b, n in enumerate(pad):
        mask[b, :n] = False
    causal = np.tril(np.ones((T, S), bool), k=S - T)
    allowed = jnp.asarray(causal[None] & mask[:, None, :])
    return q, k, v, allowed


def _numpy_attention(q, k, v, allowed):
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    allowed = np.asarray(allowed)
    B, T, H, hd = q.shape
    KV = k.shape[1]
    qg = q.reshape(B, T, KV, H // KV, hd)
    s = np.einsum("btkgd,bksd->bkgts", qg, k) / np.sqrt(hd)
    s = np.where(allowed[:, None, None], s, MASKED)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bkgts,bksd->btkgd", p, v).reshape(B, T, H, hd)


@pytest.mark.parametrize("block", [1, 3, 7, 16])  # 7 = T: one block; 3: the last block padded; 16 > S
def test_blocked_forward_is_the_softmax_attention(block):
    q, k, v, allowed = _inputs()
    ref = _numpy_attention(q, k, v, allowed)
    out = blocked_attend(q, k, v, allowed, jnp.float32, block)
    assert out.shape == q.shape and out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), ref, atol=2e-6, rtol=2e-6)
    np.testing.assert_allclose(np.asarray(attend(q, k, v, allowed, jnp.float32)), ref, atol=2e-6, rtol=2e-6)


def test_a_fully_masked_query_row_is_the_mean_of_every_value_as_in_the_dense_form():
    q, k, v, allowed = _inputs(pad=(0, 3))  # row 1's first 3 queries see no key at all
    assert not np.asarray(allowed[1, :3]).any()
    out = np.asarray(blocked_attend(q, k, v, allowed, jnp.float32, 2))  # 7 keys: the last block padded
    mean = np.asarray(v[1], np.float64).mean(axis=1)  # [KV, hd]
    np.testing.assert_allclose(out[1, 0].reshape(2, 2, 8), np.repeat(mean[:, None], 2, 1), atol=2e-6)


def test_a_query_block_over_a_longer_key_sequence():
    """T < S (queries at the end of the keys, as a chunk of a sequence would be)."""
    q, k, v, allowed = _inputs(T=3, S=10, pad=(2, 0))
    ref = _numpy_attention(q, k, v, allowed)
    np.testing.assert_allclose(np.asarray(blocked_attend(q, k, v, allowed, jnp.float32, 4)), ref, atol=2e-6)


@pytest.mark.parametrize("block", [2, 7])
def test_blocked_gradients_are_the_dense_gradients(block):
    q, k, v, allowed = _inputs(seed=1)
    w = jnp.asarray(np.random.default_rng(2).standard_normal(q.shape), jnp.float32)
    # a loss that ignores the padding query rows, as the model's losses do, and one that reads them too
    rows = jnp.asarray(np.any(np.asarray(allowed), -1))[:, :, None, None]
    for weight in (w, w * rows):
        dense = jax.grad(lambda q, k, v, wt=weight: jnp.sum(attend(q, k, v, allowed, jnp.float32) * wt),
                         argnums=(0, 1, 2))(q, k, v)
        blocked = jax.grad(lambda q, k, v, wt=weight: jnp.sum(blocked_attend(q, k, v, allowed, jnp.float32, block) * wt),
                           argnums=(0, 1, 2))(q, k, v)
        for name, d, b in zip("qkv", dense, blocked):
            assert b.shape == d.shape and b.dtype == d.dtype, name
            np.testing.assert_allclose(np.asarray(b), np.asarray(d), atol=2e-5, rtol=2e-5, err_msg=name)


def test_bad_arguments_are_refused():
    q, k, v, allowed = _inputs()
    with pytest.raises(ValueError, match="block must be >= 1"):
        blocked_attend(q, k, v, allowed, jnp.float32, 0)
    with pytest.raises(ValueError, match="allowed has shape"):
        blocked_attend(q, k, v, allowed[:, :, :-1], jnp.float32, 4)


def test_the_model_with_blocked_attention_gives_the_dense_models_states_and_gradients(tiny_config):
    """The tiny Qwen2 (two layers, grouped-query heads, remat block, scanned layers) over left-padded rows of 11
    tokens in key blocks of 4 (the last padded): the same hidden states and parameter gradients as dense."""
    from flax import nnx

    from ict_jax import init_model

    dense = init_model(tiny_config, seed=0)
    blocked = init_model(tiny_config.replace(attention="blocked", attention_block=4), seed=0)
    rng = np.random.default_rng(5)
    ids = jnp.asarray(rng.integers(1, tiny_config.vocab_size, (3, 11)), jnp.int32)
    mask = np.ones((3, 11), np.int32)
    mask[1, :4] = 0
    mask[2, :10] = 0  # one real token
    mask = jnp.asarray(mask)
    w = jnp.asarray(rng.standard_normal((3, 11, tiny_config.hidden_size)), jnp.float32) * mask[:, :, None]

    def loss(model):
        return jnp.sum(model.hidden_states(ids, mask) * w)

    (ld, gd), (lb, gb) = (nnx.jit(nnx.value_and_grad(loss))(m) for m in (dense, blocked))  # compiled, as trained
    real = np.asarray(mask, bool)
    states = nnx.jit(lambda m: m.hidden_states(ids, mask))
    np.testing.assert_allclose(np.asarray(states(blocked))[real], np.asarray(states(dense))[real], atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(float(lb), float(ld), rtol=1e-5)
    flat_d, flat_b = jax.tree.leaves(nnx.state(gd)), jax.tree.leaves(nnx.state(gb))
    assert len(flat_d) == len(flat_b) > 0
    for d, b in zip(flat_d, flat_b):
        np.testing.assert_allclose(np.asarray(b), np.asarray(d), atol=2e-5, rtol=2e-4)
