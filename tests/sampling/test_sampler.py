"""The jitted sampler against references: a full forward without cache, float64 NumPy, and
the 1-device run. One tiny model, a handful of compiled programs shared through module fixtures."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import ict_jax
from ict_jax.model.config import ModelConfig
from ict_jax.sampling.sampler import _FNS, generate, make_generate_fn
from ict_jax.sharding import make_mesh, state_shardings

P, G, LP, N = 4, 2, 6, 10
TEMP = 0.9
EOS = tuple(range(0, 256, 16))  # 16 of 256 ids: some rows end early, some hit the limit


def _sharpen(model):
    """Random init gives near-uniform logits (ties make argmax checks meaningless): scale the
    matrices so the next-token distribution is peaked but not one-hot."""
    graphdef, state = nnx.split(model)
    state = jax.tree.map(lambda x: x * 8.0 if x.ndim >= 3 or x.shape[0] == 256 else x, state)
    return nnx.merge(graphdef, state)


@pytest.fixture(scope="module")
def model():
    return _sharpen(ict_jax.init_model(ModelConfig.tiny(compute_dtype="float32"), seed=0))


@pytest.fixture(scope="module")
def prompts():
    ids = np.asarray(jax.random.randint(jax.random.key(7), (P, LP), 1, 256), np.int32)
    lens = [LP, 3, 5, 1]
    mask = np.zeros((P, LP), np.int32)
    for p, n in enumerate(lens):
        mask[p, LP - n:] = 1
    return np.where(mask > 0, ids, 0).astype(np.int32), mask


@pytest.fixture(scope="module")
def forward(model):
    """Full forward (no cache) on [prompt, response]: float32 logits [B, LP + N, V]."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def f(state, ids, mask):
        return nnx.merge(graphdef, state)(ids, mask)

    return lambda ids, mask: np.asarray(f(state, ids, mask))


@pytest.fixture(scope="module")
def sampled(model, prompts):
    return generate(model, *prompts, jax.random.key(3), num_samples=G, max_new_tokens=N, temperature=TEMP,
                    eos_ids=EOS)


@pytest.fixture(scope="module")
def greedy(model, prompts):
    return generate(model, *prompts, jax.random.key(3), num_samples=G, max_new_tokens=N, greedy=True)


def _np(r):
    return jax.tree.map(np.asarray, r)


def _full(prompts, r):
    ids, mask = prompts
    rows = np.arange(P * G) // G  # prompt-major
    seq = np.concatenate([ids[rows], np.asarray(r.tokens)], 1)
    m = np.concatenate([mask[rows], np.asarray(r.valid).astype(np.int32)], 1)
    return seq, m


def _log_softmax64(x):
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_greedy_equals_stepwise_argmax_of_full_forward(greedy, prompts, forward):
    ids, mask = prompts
    rows = np.arange(P * G) // G
    seq = np.concatenate([ids[rows], np.zeros((P * G, N), np.int32)], 1)
    m = np.concatenate([mask[rows], np.zeros((P * G, N), np.int32)], 1)
    for t in range(N):  # one token at a time, each from a fresh full forward (right padding is inert)
        logits = forward(seq, m)[:, LP - 1 + t]
        seq[:, LP + t] = logits.argmax(-1)
        m[:, LP + t] = 1
    r = _np(greedy)
    np.testing.assert_array_equal(r.tokens, seq[:, LP:])
    assert r.valid.all() and r.truncated.all() and (r.lengths == N).all()
    assert len(np.unique(r.tokens)) > 3  # the model is not degenerate


def test_logp_matches_full_forward(sampled, prompts, forward):
    r = _np(sampled)
    seq, m = _full(prompts, r)
    logits = forward(seq, m)[:, LP - 1:LP - 1 + N] / TEMP
    ref = np.take_along_axis(_log_softmax64(logits), r.tokens[..., None], -1)[..., 0]
    np.testing.assert_allclose(r.logp[r.valid], ref[r.valid], atol=1e-5, rtol=0)
    assert (r.logp[~r.valid] == 0).all()
    assert len(np.unique(r.tokens[r.valid])) > 10  # genuinely sampled


def test_eos_padding_valid_lengths_truncated(sampled):
    r = _np(sampled)
    is_eos = np.isin(r.tokens, EOS) & r.valid
    assert (is_eos.sum(1) <= 1).all()
    for i in range(P * G):
        hits = np.flatnonzero(np.isin(r.tokens[i], EOS))
        end = hits[0] + 1 if len(hits) else N
        np.testing.assert_array_equal(r.valid[i], np.arange(N) < end)
        assert (r.tokens[i, end:] == 0).all()  # pad_id
        assert r.lengths[i] == end
        assert r.truncated[i] == (len(hits) == 0)
    assert r.truncated.any() and not r.truncated.all()  # both kinds of row occur


def test_top_k_1_equals_greedy(model, prompts, greedy):
    r = generate(model, *prompts, jax.random.key(11), num_samples=G, max_new_tokens=N, temperature=1.3, top_k=1)
    np.testing.assert_array_equal(np.asarray(r.tokens), np.asarray(greedy.tokens))


def test_top_k_top_p_stay_in_kept_set(model, prompts, forward):
    k, top_p = 6, 0.6
    r = _np(generate(model, *prompts, jax.random.key(5), num_samples=G, max_new_tokens=N, temperature=TEMP,
                     top_k=k, top_p=top_p, eos_ids=EOS))
    seq, m = _full(prompts, r)
    lp = _log_softmax64(forward(seq, m)[:, LP - 1:LP - 1 + N] / TEMP)
    order = np.argsort(-lp, axis=-1, kind="stable")[..., :k]
    p = np.exp(np.take_along_axis(lp, order, -1))
    p = p / p.sum(-1, keepdims=True)
    kept = (np.cumsum(p, -1) - p) < top_p
    n_kept = []
    for i, t in zip(*np.nonzero(r.valid)):
        allowed = order[i, t][kept[i, t]]
        assert r.tokens[i, t] in allowed, (i, t, r.tokens[i, t], allowed)
        n_kept.append(len(allowed))
    assert max(n_kept) > 1  # truncation left a real choice somewhere


def test_mesh_8_devices_equals_1_device(model, prompts, sampled, devices8):
    mesh = make_mesh(2, 2, 2)
    graphdef, state = nnx.split(model)
    with jax.set_mesh(mesh):
        state8 = jax.device_put(state, state_shardings(state, mesh))
    model8 = nnx.merge(graphdef, state8)
    r8 = generate(model8, *prompts, jax.random.key(3), num_samples=G, max_new_tokens=N, temperature=TEMP, eos_ids=EOS)
    assert len(r8.tokens.sharding.device_set) == 8
    assert r8.tokens.sharding.shard_shape(r8.tokens.shape)[0] == P * G // 4  # rows over data x fsdp
    # the weights gathered once a call (rollout.gather_weights) instead of at every step: the same samples
    r8g = generate(model8, *prompts, jax.random.key(3), num_samples=G, max_new_tokens=N, temperature=TEMP, eos_ids=EOS,
                   gather_weights=True)
    r1 = _np(sampled)
    for r in (_np(r8), _np(r8g)):
        np.testing.assert_array_equal(r.tokens, r1.tokens)
        np.testing.assert_array_equal(r.valid, r1.valid)
        np.testing.assert_array_equal(r.truncated, r1.truncated)
        np.testing.assert_allclose(r.logp, r1.logp, atol=1e-5, rtol=0)


class _CountTraces:
    """Counts jit traces and backend compilations (jax.monitoring events) inside the block."""

    EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/backend_compile_duration")

    def __enter__(self):
        self.n = 0

        def listener(event, duration, **kw):
            if event in self.EVENTS:
                self.n += 1

        self._listener = listener
        jax.monitoring.register_event_duration_secs_listener(listener)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self._listener)


def test_repeated_calls_compile_once(model, prompts, sampled):
    fns = [f for k, f in _FNS.items() if f.settings.temperature == TEMP and f.settings.top_k == 0 and f.mesh is None]
    assert len(fns) == 1
    n_before = len(_FNS)
    graphdef, state = nnx.split(model)
    other = nnx.merge(graphdef, jax.tree.map(lambda x: x * 1.01, state))
    ids, mask = prompts
    with _CountTraces() as counter:
        # new weights (same graph), new prompt contents, new key: same program
        r = generate(other, (ids + 1) % 256, mask, jax.random.key(99), num_samples=G, max_new_tokens=N,
                     temperature=TEMP, eos_ids=list(EOS))
        r.tokens.block_until_ready()
    assert counter.n == 0
    assert not np.array_equal(np.asarray(r.tokens), np.asarray(sampled.tokens))
    assert len(_FNS) == n_before
    # the trainer's path: the same pure program called with an explicit state
    with _CountTraces() as counter:
        again = fns[0](state, jnp.asarray(ids), jnp.asarray(mask), jax.random.key(3))
        np.testing.assert_array_equal(np.asarray(again.tokens), np.asarray(sampled.tokens))
    assert counter.n == 0
    with _CountTraces() as counter:  # the counter does see a new program
        jax.jit(lambda x: x * 3 + 1)(jnp.arange(5)).block_until_ready()
    assert counter.n >= 1


def test_deterministic_for_key(model, prompts, sampled):
    again = generate(model, *prompts, jax.random.key(3), num_samples=G, max_new_tokens=N, temperature=TEMP,
                     eos_ids=EOS)
    np.testing.assert_array_equal(np.asarray(again.tokens), np.asarray(sampled.tokens))
    np.testing.assert_array_equal(np.asarray(again.logp), np.asarray(sampled.logp))


def test_bf16_kv_cache(model, prompts, forward):
    r = _np(generate(model, *prompts, jax.random.key(3), num_samples=G, max_new_tokens=N, greedy=True,
                     kv_cache_dtype="bfloat16"))
    seq, m = _full(prompts, r)
    ref = np.take_along_axis(_log_softmax64(forward(seq, m)[:, LP - 1:LP - 1 + N]), r.tokens[..., None], -1)[..., 0]
    # bfloat16 keys/values (8 mantissa bits) perturb the logits at the 1e-2 level, not more
    np.testing.assert_allclose(r.logp, ref, atol=5e-2, rtol=0)


def test_settings_validation(model):
    graphdef = nnx.split(model)[0]
    for bad in (dict(temperature=0.0), dict(top_p=0.0), dict(top_k=-1), dict(max_new_tokens=0),
                dict(num_samples=0)):
        with pytest.raises(ValueError):
            make_generate_fn(graphdef, **bad)


def test_the_sampler_says_how_it_holds_its_kv_cache():
    """``cache_chunks``: one chunk a decode phase (the response buckets of max_new_tokens) when the decode
    unrolls the layers on a CPU; one array per layer otherwise (what ``ict-jax compile`` checks for)."""
    from ict_jax.sampling.sampler import UNROLL_MAX_LAYERS, SampleSettings, cache_chunks, phase_ends

    s = SampleSettings(max_new_tokens=64, min_response_bucket=16)  # phases of 16, 32, 64 responses
    assert phase_ends(s, 8) == (23, 39, 71)
    assert cache_chunks(s, 2, 8, backend="cpu") == (23, 16, 32)  # sums to the cache's 8 + 64 - 1 slots
    assert cache_chunks(s, 2, 8, backend="tpu") is None  # the layer scan: one stacked cache
    assert cache_chunks(s, UNROLL_MAX_LAYERS + 1, 8, backend="cpu") is None
    assert cache_chunks(SampleSettings(max_new_tokens=64, min_response_bucket=16, unroll_layers=False), 2, 8,
                        backend="cpu") is None
    one_phase = SampleSettings(max_new_tokens=64, min_response_bucket=None)
    assert phase_ends(one_phase, 8) is None and cache_chunks(one_phase, 2, 8, backend="cpu") is None


# ------------------------------------------------------------------------------------------------
# ict-jax sample
# ------------------------------------------------------------------------------------------------
def test_cli_sample_prints_decoded_responses(tmp_path, model, capsys):
    import argparse
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers

    from ict_jax.cli.sample import add_sample_args, sample_main

    ict_jax.save_hf(model, tmp_path / "ckpt")
    vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, 256)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "ckpt" / "tokenizer.json"))
    (tmp_path / "ckpt" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>", "pad_token": "<pad>"}))
    parser = argparse.ArgumentParser()
    add_sample_args(parser)
    args = parser.parse_args(["--model", str(tmp_path / "ckpt"), "--prompt", "w5 w7 w9", "--prompt", "w3",
                              "-n", "2", "--max-new-tokens", "5", "--seed", "1", "--no-chat"])
    assert sample_main(args) == 0
    out = capsys.readouterr().out
    assert "=== prompt 0: 'w5 w7 w9'" in out and "=== prompt 1: 'w3'" in out
    samples = [line for line in out.splitlines() if line.startswith("--- sample")]
    assert len(samples) == 4
    body = out.splitlines()[out.splitlines().index(samples[0].rstrip()) + 1]
    assert body and all(w.startswith("w") for w in body.split())  # decoded words, not ids


def test_scan_decode_path_equals_unrolled(model, prompts, greedy):
    r = generate(model, *prompts, jax.random.key(3), num_samples=G, max_new_tokens=N, greedy=True,
                 unroll_layers=False)  # model.decode under lax.scan over the stacked layers
    np.testing.assert_array_equal(np.asarray(r.tokens), np.asarray(greedy.tokens))
    np.testing.assert_allclose(np.asarray(r.logp), np.asarray(greedy.logp), atol=1e-5, rtol=0)


@pytest.mark.parametrize("unroll", [True, False])
def test_a_fused_attention_prefill_gives_the_same_samples(model, prompts, sampled, unroll):
    """``model.attention: xla`` (the path cuDNN takes on a GPU): the prefill's left-padded prompts attend
    through the fused kernel (``Qwen2.extend(..., prefill=True)``), the decode as before; the same tokens
    and log-probabilities as the dense prefill, for both layer loops."""
    from ict_jax.model.qwen2 import Qwen2

    graphdef, state = nnx.split(model)
    fused = nnx.merge(nnx.split(Qwen2(model.config.replace(attention="xla"), rngs=nnx.Rngs(0)))[0], state)
    assert fused.config.resolved_attention() == "xla"
    r = generate(fused, *prompts, jax.random.key(3), num_samples=G, max_new_tokens=N, temperature=TEMP,
                 eos_ids=EOS, unroll_layers=unroll)
    np.testing.assert_array_equal(np.asarray(r.tokens), np.asarray(sampled.tokens))
    np.testing.assert_allclose(np.asarray(r.logp), np.asarray(sampled.logp), atol=1e-5, rtol=0)
