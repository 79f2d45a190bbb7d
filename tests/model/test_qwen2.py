"""Qwen2 parity with transformers' PyTorch model (layered), KV cache, mesh, presets, HF I/O."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ict_jax
from ict_jax import ModelConfig
from ict_jax.model.weights import WeightError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.torch

# (name, heads, kv_heads, hidden, tied, bias, scan): GQA ratios 1, 2 and 7 (Qwen2.5-0.5B: 14 / 2).
CASES = [
    ("gqa2_tied_bias_scan", 4, 2, 64, True, True, True),
    ("gqa1_untied_bias_loop", 4, 4, 64, False, True, False),
    ("gqa7_tied_nobias_scan", 14, 2, 112, True, False, True),
    ("gqa7_untied_bias_loop", 14, 2, 112, False, True, False),
]


def _hf_model(heads, kv, hidden, tied, bias, seed=0):
    torch.manual_seed(seed)
    common = dict(vocab_size=97, hidden_size=hidden, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=heads, num_key_value_heads=kv, tie_word_embeddings=tied,
                  rms_norm_eps=1e-6, max_position_embeddings=256)
    if bias:
        cfg = transformers.Qwen2Config(rope_theta=10_000.0, **common)
        model = transformers.Qwen2ForCausalLM(cfg)
        # random (not zero) biases so that a missed bias would show
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    else:
        cfg = transformers.LlamaConfig(rope_theta=10_000.0, attention_bias=False, mlp_bias=False, **common)
        model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for layer in model.model.layers:  # non-trivial norm scales
            layer.input_layernorm.weight.uniform_(0.5, 1.5)
            layer.post_attention_layernorm.weight.uniform_(0.5, 1.5)
        model.model.norm.weight.uniform_(0.5, 1.5)
    return model.eval()


@pytest.fixture(scope="module", params=CASES, ids=[c[0] for c in CASES])
def pair(request, tmp_path_factory):
    name, heads, kv, hidden, tied, bias, scan = request.param
    hf = _hf_model(heads, kv, hidden, tied, bias)
    d = tmp_path_factory.mktemp(name)
    hf.save_pretrained(d)
    ours = ict_jax.load_hf(d, scan_layers=scan, remat="none")
    return hf, ours, d


def _batch():
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 97, size=(3, 11))
    mask = np.ones((3, 11), np.int64)
    mask[1, :4] = 0  # left-padded
    mask[2, 8:] = 0  # right-padded
    return ids, mask


def _hf_forward(hf, ids, mask):
    pos = np.maximum(mask.cumsum(1) - 1, 0)
    with torch.no_grad():
        out = hf(torch.tensor(ids), attention_mask=torch.tensor(mask), position_ids=torch.tensor(pos),
                 output_hidden_states=True)
    return out.logits.numpy(), [h.numpy() for h in out.hidden_states]


def test_one_weight_after_loading(pair):
    hf, ours, _ = pair
    np.testing.assert_array_equal(np.asarray(ours.embed[...]), hf.model.embed_tokens.weight.detach().numpy())
    q = hf.model.layers[1].self_attn.q_proj.weight.detach().numpy()  # [H*hd, D]
    c = ours.config
    ours_q = np.asarray(ours.layers.wq[...][1])  # [D, H, hd]
    np.testing.assert_array_equal(ours_q.reshape(c.hidden_size, -1).T, q)


def test_layered_parity_and_logits(pair):
    hf, ours, _ = pair
    ids, mask = _batch()
    ref_logits, ref_hidden = _hf_forward(hf, ids, mask)
    states = ours.layer_states(jnp.asarray(ids), jnp.asarray(mask))
    real = mask > 0
    # after layer 1 (HF hidden_states[1] is the output of the first layer), then after all layers
    np.testing.assert_allclose(np.asarray(states[0])[real], ref_hidden[1][real], atol=1e-4, rtol=0)
    np.testing.assert_allclose(np.asarray(states[-1])[real], ref_hidden[-1][real], atol=1e-4, rtol=0)
    hidden = ours.hidden_states(jnp.asarray(ids), jnp.asarray(mask))
    np.testing.assert_allclose(np.asarray(hidden)[real], ref_hidden[-1][real], atol=1e-4, rtol=0)
    logits = np.asarray(ours(jnp.asarray(ids), jnp.asarray(mask)))
    assert logits.dtype == np.float32
    np.testing.assert_allclose(logits[real], ref_logits[real], atol=1e-4, rtol=0)
    # padding does not change a row's real tokens: the left-padded row equals its unpadded self
    unpadded = np.asarray(ours(jnp.asarray(ids[1:2, 4:])))
    np.testing.assert_allclose(logits[1, 4:], unpadded[0], atol=1e-5, rtol=0)


def test_unembedding_is_the_head(pair):
    hf, ours, _ = pair
    w = hf.lm_head.weight.detach().numpy().T  # [D, V]; the embedding's transpose when tied
    np.testing.assert_array_equal(np.asarray(ours.unembedding()), w)


def test_kv_cache_decode_matches_full_forward(pair):
    _, ours, _ = pair
    ids, mask = _batch()
    ids, mask = ids[:2, :9], mask[:2, :9]  # row 0 plain, row 1 left-padded prompt
    prompt = 5
    full = np.asarray(ours(jnp.asarray(ids), jnp.asarray(mask)))
    from flax import nnx

    graphdef, state = nnx.split(ours)
    extend = jax.jit(lambda st, i, m, c: nnx.merge(graphdef, st).extend(i, m, c))
    decode = jax.jit(lambda st, t, c: nnx.merge(graphdef, st).decode(t, c))
    cache = ours.init_cache(2, 16)
    h, cache = extend(state, jnp.asarray(ids[:, :prompt]), jnp.asarray(mask[:, :prompt]), cache)
    got = [np.asarray(ours.logits_from_hidden(h))]
    for t in range(prompt, ids.shape[1]):
        logits, cache = decode(state, jnp.asarray(ids[:, t]), cache)
        got.append(np.asarray(logits)[:, None])
    got = np.concatenate(got, axis=1)
    real = mask > 0
    np.testing.assert_allclose(got[real], full[real], atol=1e-5, rtol=0)


def test_save_hf_roundtrip_through_transformers(pair, tmp_path):
    hf, ours, _ = pair
    out = ict_jax.save_hf(ours, tmp_path / "export")
    cfg = json.loads((out / "config.json").read_text())
    cls = transformers.Qwen2ForCausalLM if cfg["model_type"] == "qwen2" else transformers.LlamaForCausalLM
    reloaded = cls.from_pretrained(out).eval()
    ids, mask = _batch()
    a, _ = _hf_forward(hf, ids, mask)
    b, _ = _hf_forward(reloaded, ids, mask)
    np.testing.assert_array_equal(a, b)
    with pytest.raises(FileExistsError):
        ict_jax.save_hf(ours, out)  # never overwrites a saved checkpoint


def test_mesh_forward_equals_single_device(devices8, tmp_path):
    hf = _hf_model(14, 2, 112, False, True, seed=3)
    hf.save_pretrained(tmp_path)
    one = ict_jax.load_hf(tmp_path)
    mesh = ict_jax.make_mesh(data=2, fsdp=2, tensor=2)
    eight = ict_jax.load_hf(tmp_path, mesh=mesh)
    # 14 heads / 2 KV heads on tensor=2 divide; the layer-norm scales stay replicated
    assert eight.layers.wq[...].sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor", None)
    assert len(eight.embed[...].sharding.device_set) == 8
    ids, mask = _batch()
    # 8 rows (a multiple of data x fsdp = 4) mixing plain, left- and right-padded rows
    ids, mask = np.concatenate([ids, ids, ids[:2]]), np.concatenate([mask, mask[::-1], mask[:2]])
    ref = np.asarray(one(jnp.asarray(ids), jnp.asarray(mask)))
    batch = ict_jax.sharding.batch_sharding(mesh)
    with jax.set_mesh(mesh):
        got = jax.jit(lambda i, m: eight(i, m))(jax.device_put(jnp.asarray(ids), batch),
                                                jax.device_put(jnp.asarray(mask), batch))
    np.testing.assert_allclose(np.asarray(got)[mask > 0], ref[mask > 0], atol=1e-5, rtol=0)


def test_load_hf_errors(tmp_path):
    hf = _hf_model(4, 2, 64, True, True)
    good = tmp_path / "good"
    hf.save_pretrained(good)
    with pytest.raises(FileNotFoundError, match="not a directory"):
        ict_jax.load_hf(tmp_path / "nope")
    # missing safetensors file
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text((good / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        ict_jax.load_hf(empty)
    # a tensor of the wrong shape: the error names the tensor and both shapes
    from safetensors.numpy import load_file, save_file

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((good / "config.json").read_text())
    tensors = load_file(str(good / "model.safetensors"))
    tensors["model.layers.1.mlp.up_proj.weight"] = np.zeros((95, 64), np.float32)
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(WeightError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*\(95, 64\).*\(96, 64\)"):
        ict_jax.load_hf(bad)
    # a missing tensor
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(WeightError, match="up_proj.weight' is missing"):
        ict_jax.load_hf(bad)
    # an unknown architecture
    cfg = json.loads((good / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture.*GPT2LMHeadModel"):
        ict_jax.load_hf(bad)


def test_from_hf_rope_theta_locations():
    base = dict(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, architectures=["Qwen2ForCausalLM"])
    assert ModelConfig.from_hf({**base, "rope_theta": 123.0}).rope_theta == 123.0
    assert ModelConfig.from_hf({**base, "rope_parameters": {"rope_theta": 456.0, "rope_type": "default"}}).rope_theta == 456.0
    with pytest.raises(ValueError, match="rope type 'yarn'"):
        ModelConfig.from_hf({**base, "rope_parameters": {"rope_theta": 1.0, "rope_type": "yarn"}})
    with pytest.raises(ValueError, match="missing required key 'hidden_size'"):
        ModelConfig.from_hf({k: v for k, v in base.items() if k != "hidden_size"})
