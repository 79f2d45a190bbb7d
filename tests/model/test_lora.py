"""LoRA in the model: the config, the adapters' forward against transformers + PEFT, the base
with the adapters off, merging, the sampler, the mesh, and the PEFT adapter format both ways."""

from __future__ import annotations

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import ict_jax
from ict_jax import ModelConfig
from ict_jax.config import ConfigError, LoraSection
from ict_jax.config_load import load_config
from ict_jax.model.adapters import add_adapters, merge_adapters, split_adapters
from ict_jax.model.config import LORA_MODULES, LoraSpec
from ict_jax.model.lora import lora_spec
from ict_jax.model.peft import export_model, load_peft_adapter, read_peft_spec, save_peft_adapter

ALL = tuple(LORA_MODULES)
TINY = ModelConfig.tiny(compute_dtype="float32", remat="none")


def _randomize(model, seed=3, scale=0.05):
    """The model with every adapter value drawn afresh (B != 0: the adapters change the outputs)."""
    graphdef, adapters, base = split_adapters(model)
    leaves, treedef = jax.tree.flatten(adapters)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    new = [x + scale * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, new), base)


def _ids(vocab=256, shape=(3, 9), seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, size=shape)
    mask = np.ones(shape, np.int32)
    mask[1, :3] = 0  # left-padded
    mask[2, 7:] = 0  # right-padded
    return jnp.asarray(ids), jnp.asarray(mask)


# ------------------------------------------------------------------------------------------------
# Config
# ------------------------------------------------------------------------------------------------
def test_lora_is_off_by_default_and_its_keys_load():
    assert load_config().model.lora.enabled is False
    assert lora_spec(load_config().model.lora, 2) is None
    cfg = load_config(None, ["model.lora.enabled=true", "model.lora.rank=4", "model.lora.alpha=8",
                             "model.lora.targets=v_proj,q_proj", "model.lora.base_dtype=bfloat16"])
    spec = lora_spec(cfg.model.lora, 2)
    assert spec == LoraSpec(rank=4, alpha=8.0, targets=("q_proj", "v_proj"), base_dtype="bfloat16")
    assert spec.scale == 2.0 and spec.targets == ("q_proj", "v_proj")  # PEFT's module order


@pytest.mark.parametrize("override,message", [
    ("model.lora.dropout=0.1", "model.lora.dropout: 0.1 is not supported; only 0"),
    ("model.lora.dropout=1", "model.lora.dropout: 1.0 is out of range; allowed: 0 <= dropout < 1"),
    ("model.lora.rank=0", "model.lora.rank: 0 is out of range; allowed: 1 <= rank"),
    ("model.lora.alpha=0", "model.lora.alpha: 0.0 is out of range; allowed: 0 < alpha"),
    ("model.lora.targets=q_proj,lm_head", "model.lora.targets: 'lm_head' is not allowed; allowed values: q_proj, k_proj"),
    ("model.lora.targets=q_proj,q_proj", "model.lora.targets: ['q_proj', 'q_proj'] names a projection twice"),
    ("model.lora.targets=[]", "model.lora.targets: empty; name at least one of q_proj"),
    ("model.lora.target_regex=[q", "model.lora.target_regex: '[q' is not a regular expression"),
    ("model.lora.base_dtype=float16", "model.lora.base_dtype: 'float16' is not allowed"),
])
def test_lora_config_errors_are_one_line(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("override,value", [("model.lora.rank=4", "4"), ("model.lora.alpha=8", "8.0"),
                                            ("model.lora.targets=q_proj", "['q_proj']"),
                                            ("model.lora.target_regex=.*q_proj", "'.*q_proj'"),
                                            ("model.lora.base_dtype=bfloat16", "'bfloat16'")])
def test_a_lora_setting_while_lora_is_off_is_an_error_naming_it(override, value):
    """A LoRA key set without model.lora.enabled would do nothing (every parameter trains): refused, by name;
    the same key with LoRA on, and LoRA off at the defaults, load."""
    key = override.split("=")[0]
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert str(e.value).startswith(f"{key}: {value} is set but model.lora.enabled is false, so it would do nothing")
    assert "model.lora.enabled=true" in str(e.value) and "\n" not in str(e.value)
    assert load_config(None, [override, "model.lora.enabled=true"]).model.lora.enabled
    assert not load_config(None, ["model.lora.enabled=false", "model.lora.rank=16"]).model.lora.enabled


def test_target_regex_reads_like_peft_target_modules():
    on = dict(enabled=True, rank=2)
    assert lora_spec(LoraSection(**on, target_regex=r".*\.(q|v)_proj"), 3).targets == ("q_proj", "v_proj")
    assert lora_spec(LoraSection(**on, target_regex=r"model\.layers\.\d+\.mlp\..*"), 3).targets == (
        "gate_proj", "up_proj", "down_proj")
    with pytest.raises(ConfigError, match=r"selects q_proj in 1 of the 3 layers .* every layer or in none"):
        lora_spec(LoraSection(**on, target_regex=r"model\.layers\.0\.self_attn\.q_proj"), 3)
    with pytest.raises(ConfigError, match="selects none of the projections"):
        lora_spec(LoraSection(**on, target_regex="lm_head"), 3)


def test_model_config_with_lora_survives_a_json_round_trip():
    """A checkpoint's metadata stores ModelConfig as JSON: the spec comes back equal (and hashable)."""
    mc = TINY.replace(lora=LoraSpec(rank=4, alpha=8, targets=("v_proj", "q_proj"), base_dtype="bfloat16"))
    back = ModelConfig(**json.loads(json.dumps(dataclasses.asdict(mc))))
    assert back == mc and hash(back) == hash(mc) and isinstance(back.lora, LoraSpec)
    assert back.base_param_dtype == "bfloat16" and back.param_dtype == "float32"


def test_adapter_count_and_init():
    """Shapes and logical axes come from the adapted weights; A ~ U(-1/sqrt(in), 1/sqrt(in)) (PEFT's
    kaiming_uniform_(a=sqrt(5))), B = 0; adding adapters draws nothing from the base's random stream."""
    spec = LoraSpec(rank=4, alpha=8)
    mc = TINY.replace(lora=spec)
    model = ict_jax.init_model(mc, seed=5)
    graphdef, adapters, base = split_adapters(model)
    assert sum(x.size for x in jax.tree.leaves(adapters)) == mc.num_adapter_params() > 0
    assert ict_jax.param_count(mc) == mc.num_params() + mc.num_adapter_params()
    plain = ict_jax.init_model(TINY, seed=5)
    jax.tree.map(np.testing.assert_array_equal, base, nnx.state(plain, nnx.Param))  # base unchanged
    # add_adapters to the plain model draws the same adapters as init_model with the spec
    _, again, _ = split_adapters(add_adapters(plain, spec, seed=5))
    jax.tree.map(np.testing.assert_array_equal, again, adapters)
    lora = model.layers.lora
    for target in ALL:
        w = LORA_MODULES[target][0]
        a, b = getattr(lora, f"{w}_lora_a")[...], getattr(lora, f"{w}_lora_b")[...]
        fan_in = math.prod(a.shape[1:-1])
        assert a.shape[-1] == b.shape[1] == 4 and a.dtype == b.dtype == jnp.float32
        assert float(jnp.abs(a).max()) <= 1 / math.sqrt(fan_in)
        assert float(jnp.abs(a).max()) > 0.9 / math.sqrt(fan_in)  # drawn over the whole range
        np.testing.assert_allclose(float(a.std()), 1 / math.sqrt(3 * fan_in), rtol=0.1)
        assert not np.asarray(b).any()
    assert lora.wq_lora_a.get_metadata()["logical_axes"] == ("layers", "embed", "lora_rank")
    assert lora.wo_lora_a.get_metadata()["logical_axes"] == ("layers", "q_heads", "head_dim", "lora_rank")
    assert lora.wo_lora_b.get_metadata()["logical_axes"] == ("layers", "lora_rank", "embed")


def test_frozen_base_in_bfloat16():
    spec = LoraSpec(rank=2, alpha=4, base_dtype="bfloat16")
    model = add_adapters(ict_jax.init_model(TINY, seed=0), spec)
    _, adapters, base = split_adapters(model)
    assert {x.dtype for x in jax.tree.leaves(base)} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in jax.tree.leaves(adapters)} == {jnp.dtype(jnp.float32)}
    ids, mask = _ids()
    assert np.isfinite(np.asarray(model(ids, mask))).all()


# ------------------------------------------------------------------------------------------------
# Forward: the adapted model, the base, the merged model
# ------------------------------------------------------------------------------------------------
def test_fresh_adapters_and_adapters_off_give_the_base_exactly():
    base = ict_jax.init_model(TINY, seed=0)
    fresh = add_adapters(base, LoraSpec(rank=4, alpha=8))  # B = 0
    ids, mask = _ids()
    want = np.asarray(base(ids, mask))
    np.testing.assert_array_equal(np.asarray(fresh(ids, mask)), want)
    trained = _randomize(fresh)
    assert np.abs(np.asarray(trained(ids, mask)) - want).max() > 1e-2  # the adapters do act
    np.testing.assert_array_equal(np.asarray(trained(ids, mask, adapters=False)), want)
    h, _ = trained.predicting_states(ids, mask, adapters=False)
    np.testing.assert_array_equal(np.asarray(h), np.asarray(base.predicting_states(ids, mask)[0]))


@pytest.mark.parametrize("scan", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_merged_model_is_the_adapted_model_and_its_update_has_rank_r(scan):
    """W + (alpha / r) A B in place of each weight gives the adapted model's logits; W' - W has rank <= r."""
    r = 3
    cfg = TINY.replace(scan_layers=scan, tie_word_embeddings=False)
    adapted = _randomize(add_adapters(ict_jax.init_model(cfg, seed=2), LoraSpec(rank=r, alpha=6)))
    merged = merge_adapters(adapted)
    assert merged.config.lora is None and merged.layers.lora is None
    ids, mask = _ids()
    np.testing.assert_allclose(np.asarray(merged(ids, mask)), np.asarray(adapted(ids, mask)), atol=2e-5, rtol=0)
    for name in ("wq", "wo", "w_down"):
        delta = np.asarray(getattr(merged.layers, name)[...]) - np.asarray(getattr(adapted.layers, name)[...])
        k = 2 if name == "wo" else 1
        for layer in delta:
            s = np.linalg.svd(layer.reshape(math.prod(layer.shape[:k]), -1), compute_uv=False)
            assert s[r - 1] > 1e-3 and s[r] < 1e-6 * s[0], (name, s[:r + 1])
    np.testing.assert_array_equal(np.asarray(merged.embed[...]), np.asarray(adapted.embed[...]))


@pytest.mark.parametrize("unroll", [False, True])
def test_the_sampler_runs_the_adapted_model(unroll):
    """Greedy decoding (the scanned and the unrolled CPU decode) follows the adapted model's own argmax,
    token after token, and differs from the base's."""
    base = ict_jax.init_model(TINY, seed=0)
    adapted = _randomize(add_adapters(base, LoraSpec(rank=4, alpha=16)), scale=0.3)
    prompt = jnp.asarray([[5, 17, 33, 2]], jnp.int32)
    n = 6
    out = ict_jax.generate(adapted, prompt, None, jax.random.key(0), max_new_tokens=n, greedy=True,
                           unroll_layers=unroll)
    toks = np.asarray(out.tokens[0])
    seq = np.concatenate([np.asarray(prompt[0]), toks])
    logits = np.asarray(adapted(jnp.asarray(seq[None])))[0]
    np.testing.assert_array_equal(toks, logits[len(prompt[0]) - 1:-1].argmax(-1))
    base_out = ict_jax.generate(base, prompt, None, jax.random.key(0), max_new_tokens=n, greedy=True,
                                unroll_layers=unroll)
    assert (np.asarray(base_out.tokens[0]) != toks).any()


def test_adapters_on_a_mesh_follow_the_rule_table(devices8, tmp_path):
    """On (data 2, fsdp 2, tensor 2): A shards like its weight's input, B like its output, the rank axis
    is replicated; the logits equal one device's."""
    from jax.sharding import PartitionSpec as P

    mesh = ict_jax.make_mesh(data=2, fsdp=2, tensor=2)
    spec = LoraSpec(rank=4, alpha=8)
    on_mesh = _randomize(ict_jax.init_model(TINY.replace(lora=spec), seed=1, mesh=mesh))
    lora = on_mesh.layers.lora
    assert lora.wq_lora_a[...].sharding.spec == P(None, "fsdp", None)
    assert lora.wq_lora_b[...].sharding.spec == P(None, None, "tensor", None)
    assert lora.w_down_lora_a[...].sharding.spec == P(None, "tensor", None)
    assert lora.w_down_lora_b[...].sharding.spec == P(None, None, "fsdp")
    graphdef, state = nnx.split(on_mesh)
    one = nnx.merge(graphdef, jax.device_put(state, jax.devices()[0]))
    ids, mask = _ids(shape=(4, 9))
    with jax.set_mesh(mesh):
        got = jax.jit(lambda s, i, m: nnx.merge(graphdef, s)(i, m))(state, ids, mask)
    np.testing.assert_allclose(np.asarray(got), np.asarray(one(ids, mask)), atol=1e-5, rtol=0)
    # add_adapters places new adapters on the model's mesh too, and so does loading a PEFT adapter
    base = ict_jax.init_model(TINY, seed=1, mesh=mesh)
    added = add_adapters(base, spec)
    assert added.layers.lora.wq_lora_b[...].sharding.spec == P(None, None, "tensor", None)
    loaded = load_peft_adapter(base, save_peft_adapter(on_mesh, tmp_path / "adapter"))
    assert loaded.layers.lora.wq_lora_a[...].sharding.spec == P(None, "fsdp", None)
    jax.tree.map(np.testing.assert_array_equal, split_adapters(loaded)[1], split_adapters(on_mesh)[1])


def test_add_and_merge_refuse_what_they_cannot_do(tmp_path):
    model = add_adapters(ict_jax.init_model(TINY, seed=0), LoraSpec(rank=2, alpha=2))
    with pytest.raises(ValueError, match="already has LoRA adapters"):
        add_adapters(model, LoraSpec(rank=2, alpha=2))
    with pytest.raises(ValueError, match="has no LoRA adapters"):
        save_peft_adapter(ict_jax.init_model(TINY, seed=0), tmp_path / "x")
    with pytest.raises(ValueError, match="export format 'onnx'"):
        export_model(model, tmp_path / "y", format="onnx")


# ------------------------------------------------------------------------------------------------
# PEFT: the same forward as transformers + peft, and the adapter format both ways
# ------------------------------------------------------------------------------------------------
# (name, Qwen2 with q/k/v biases or bias-free Llama, tied head, scanned layers, targets)
PEFT_CASES = [
    ("qwen2_tied_scan_all", True, True, True, ALL),
    ("llama_untied_unrolled_some", False, False, False, ("q_proj", "v_proj", "o_proj", "down_proj")),
]


@pytest.fixture(scope="module", params=PEFT_CASES, ids=[c[0] for c in PEFT_CASES])
def peft_pair(request, tmp_path_factory):
    """(transformers + peft model with random nonzero adapters, its base directory, our model with the
    same adapters copied by hand, targets)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    _, qwen, tied, scan, targets = request.param
    torch.manual_seed(0)
    common = dict(vocab_size=97, hidden_size=56, intermediate_size=72, num_hidden_layers=2, num_attention_heads=7,
                  num_key_value_heads=1, tie_word_embeddings=tied, rms_norm_eps=1e-6, max_position_embeddings=128,
                  rope_theta=10_000.0)
    if qwen:
        hf = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    else:
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(attention_bias=False, mlp_bias=False, **common))
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.input_layernorm.weight.uniform_(0.5, 1.5)
            if qwen:
                layer.self_attn.q_proj.bias.normal_(0, 0.5)
    base_dir = tmp_path_factory.mktemp("peft_base") / "base"
    hf.eval().save_pretrained(base_dir)
    r, alpha = 4, 12
    pm = peft.get_peft_model(hf, peft.LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0,
                                                 target_modules=list(targets))).eval()
    ours = add_adapters(ict_jax.load_hf(base_dir, scan_layers=scan, remat="none"),
                        LoraSpec(rank=r, alpha=alpha, targets=targets))
    graphdef, adapters, base = split_adapters(ours)
    lora = adapters["layers"]["lora"]
    with torch.no_grad():
        for i, layer in enumerate(hf.model.layers):
            for target in targets:
                module = getattr(layer.self_attn if LORA_MODULES[target][1] == "self_attn" else layer.mlp, target)
                wa, wb = module.lora_A["default"].weight, module.lora_B["default"].weight  # [r, in], [out, r]
                wa.normal_(0, 0.3)
                wb.normal_(0, 0.3)  # B != 0
                name = LORA_MODULES[target][0]
                a_var, b_var = lora[f"{name}_lora_a"], lora[f"{name}_lora_b"]
                a_var.set_value(a_var[...].at[i].set(wa.numpy().T.reshape(a_var.shape[1:])))
                b_var.set_value(b_var[...].at[i].set(wb.numpy().T.reshape(b_var.shape[1:])))
    return pm, base_dir, nnx.merge(graphdef, adapters, base), targets


def _torch_logits(model, ids, mask):
    import torch

    ids, mask = np.asarray(ids), np.asarray(mask)
    pos = np.maximum(mask.cumsum(1) - 1, 0)
    with torch.no_grad():
        return model(torch.tensor(ids), attention_mask=torch.tensor(mask), position_ids=torch.tensor(pos)).logits.numpy()


@pytest.mark.torch
def test_lora_forward_equals_transformers_with_peft(peft_pair):
    pm, _, ours, _ = peft_pair
    ids, mask = _ids(vocab=97)
    want = _torch_logits(pm, ids, mask)
    real = np.asarray(mask) > 0
    got = np.asarray(ours(ids, mask))
    np.testing.assert_allclose(got[real], want[real], atol=1e-4, rtol=0)
    with pm.disable_adapter():  # PEFT's adapters off = our adapters off = the base
        base = _torch_logits(pm, ids, mask)
    np.testing.assert_allclose(np.asarray(ours(ids, mask, adapters=False))[real], base[real], atol=1e-4, rtol=0)
    assert np.abs(want - base)[real].max() > 1e-2  # the adapters matter


@pytest.mark.torch
def test_peft_adapter_export_reloads_in_peft_with_the_same_outputs(peft_pair, tmp_path):
    """Our adapter directory, loaded by PeftModel.from_pretrained onto transformers' base model, gives our
    logits and our greedy continuation; the PEFT-saved adapter loads into ours and gives PEFT's logits."""
    import torch
    import transformers
    from peft import PeftModel

    pm, base_dir, ours, targets = peft_pair
    out = export_model(ours, tmp_path / "adapter", format="peft", base_model_name_or_path=str(base_dir))
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["r"] == 4 and cfg["lora_alpha"] == 12 and cfg["target_modules"] == list(targets)
    hf_base = transformers.AutoModelForCausalLM.from_pretrained(base_dir)
    reloaded = PeftModel.from_pretrained(hf_base, out).eval()
    ids, mask = _ids(vocab=97)
    real = np.asarray(mask) > 0
    np.testing.assert_allclose(_torch_logits(reloaded, ids, mask)[real], np.asarray(ours(ids, mask))[real],
                               atol=1e-4, rtol=0)
    prompt = np.asarray([[3, 14, 15, 92, 65]])
    with torch.no_grad():
        hf_greedy = reloaded.generate(input_ids=torch.tensor(prompt), attention_mask=torch.ones(1, 5, dtype=torch.long),
                                      max_new_tokens=8, do_sample=False, pad_token_id=0,
                                      eos_token_id=None)[0, 5:].numpy()
    ours_greedy = ict_jax.generate(ours, jnp.asarray(prompt), None, jax.random.key(0), max_new_tokens=8, greedy=True)
    np.testing.assert_array_equal(np.asarray(ours_greedy.tokens[0]), hf_greedy)
    # the other way: PEFT's own save loads into our base
    pm.save_pretrained(tmp_path / "from_peft")
    loaded = load_peft_adapter(ict_jax.load_hf(base_dir, remat="none"), tmp_path / "from_peft")
    np.testing.assert_allclose(np.asarray(loaded(ids, mask))[real], _torch_logits(pm, ids, mask)[real],
                               atol=1e-4, rtol=0)
    assert loaded.config.lora == ours.config.lora


@pytest.mark.torch
def test_merged_export_loads_in_transformers(peft_pair, tmp_path):
    import transformers

    pm, _, ours, _ = peft_pair
    out = export_model(ours, tmp_path / "merged")
    merged = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ids, mask = _ids(vocab=97)
    real = np.asarray(mask) > 0
    np.testing.assert_allclose(_torch_logits(merged, ids, mask)[real], _torch_logits(pm, ids, mask)[real],
                               atol=1e-4, rtol=0)


@pytest.mark.parametrize("change,message", [
    ({"peft_type": "IA3"}, "only LORA adapters"),
    ({"use_dora": True}, "use_dora=True is not supported"),
    ({"use_rslora": True}, "use_rslora=True is not supported"),
    ({"rank_pattern": {"q_proj": 8}}, "rank_pattern is not supported"),
    ({"layers_to_transform": [0]}, "layers_to_transform is not supported"),
    ({"target_modules": ["q_proj", "lm_head"]}, r"target module\(s\) \['lm_head'\] are not supported"),
    ({"target_modules": r".*layers\.0\.self_attn\.q_proj"}, "selects q_proj in 1 of the 2 layers"),
])
def test_peft_configs_this_model_cannot_hold_are_refused(tmp_path, change, message):
    model = add_adapters(ict_jax.init_model(TINY, seed=0), LoraSpec(rank=2, alpha=4))
    out = save_peft_adapter(model, tmp_path / "a")
    assert read_peft_spec(out, 2) == model.config.lora
    cfg = json.loads((out / "adapter_config.json").read_text())
    (out / "adapter_config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(ValueError, match=message):
        read_peft_spec(out, 2)


def test_peft_round_trip_and_weight_errors(tmp_path):
    from safetensors.numpy import load_file, save_file

    from ict_jax.model.weights import WeightError

    base = ict_jax.init_model(TINY, seed=0)
    model = _randomize(add_adapters(base, LoraSpec(rank=2, alpha=4, targets=("k_proj", "up_proj"))))
    out = save_peft_adapter(model, tmp_path / "a")
    back = load_peft_adapter(base, out)
    jax.tree.map(np.testing.assert_array_equal, split_adapters(back)[1], split_adapters(model)[1])
    with pytest.raises(FileExistsError):
        save_peft_adapter(model, out)
    tensors = load_file(str(out / "adapter_model.safetensors"))
    name = "base_model.model.model.layers.1.mlp.up_proj.lora_B.weight"
    assert tensors[name].shape == (TINY.intermediate_size, 2)
    save_file({**tensors, name: tensors[name][:, :1]}, str(out / "adapter_model.safetensors"))
    with pytest.raises(WeightError, match=r"up_proj.lora_B.weight' has shape \(128, 1\), expected \(128, 2\)"):
        load_peft_adapter(base, out)
    save_file({k: v for k, v in tensors.items() if k != name}, str(out / "adapter_model.safetensors"))
    with pytest.raises(WeightError, match="is missing"):
        load_peft_adapter(base, out)


def test_cli_export_format(tmp_path, capsys):
    """``ict-jax export --format peft`` of a run without adapters is one line and exit 2; merged works."""
    from ict_jax.cli.main import main
    from ict_jax.rl.state import init_train_state
    from ict_jax.train.checkpoints import Checkpointer

    cfg = load_config(None, [])
    with Checkpointer(tmp_path / "run" / "checkpoints", async_save=False) as ckpt:
        ckpt.save(1, init_train_state(cfg, ict_jax.init_model(TINY, seed=0)), {"config": cfg})
    args = ["export", "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "out")]
    assert main(args + ["--format", "peft"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "has no LoRA adapters" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()
    assert main(args + ["--format", "merged"]) == 0
    assert (tmp_path / "out" / "model.safetensors").is_file()
