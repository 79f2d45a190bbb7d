"""LoRA in the train step: only the adapters are differentiated and in the optimizer state,
their gradient is the chain rule of the full-parameter gradient, the KL reference is the base model with
the adapters off (no copy), every method and schedule runs, and the compiled step holds neither Adam
moments of the base nor a reference copy.

The slow methods x variants matrices run a covering design (tests/covering.py's each_level_once), not the
product: every method and every variant (of the chain rule; every schedule) at least once, 7 cases each
where the products' 21 and 16 would take about 8 minutes of CI's slow stage."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import ict_jax
from ict_jax.config_load import load_config
from ict_jax.model.adapters import add_adapters, merge_adapters, split_adapters
from ict_jax.model.config import LORA_MODULES, LoraSpec
from ict_jax.rl.state import init_train_state, kl_reference, reference_params, split_trainable
from ict_jax.rl.train_step import StepPlan, _valid, make_train_step, old_policy_pass

from covering import each_level_once  # tests/ is on sys.path under pytest
from test_train_step import LP, LR, G, P, _batch  # its batch and shapes (the same folder is on sys.path)

MODEL = ict_jax.ModelConfig.tiny(num_layers=2, remat="none", compute_dtype="float32")
SPEC = LoraSpec(rank=3, alpha=6, targets=("q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"))
METHODS = ("dense", "ict", "entropy", "stapo", "random", "frequent", "selectable")


def _config(method: str = "ict", *extra: str):
    return load_config(None, [
        f"rl.selector.method={method}", f"rollout.num_samples={G}", f"train.prompts_per_step={P}",
        f"rollout.max_new_tokens={LR}", "rl.selector.warmup_steps=0", "rl.selector.tau_p=0.05", "stats.chunk=4",
        "rl.loss.kl_coef=0.05", "rl.selector.rho=0.3", "optim.lr=1e-2", *extra])


def _adapted(seed: int = 1, mesh=None):
    """A tiny model with adapters whose A and B are both nonzero (a trained adapter, not a fresh one)."""
    model = add_adapters(ict_jax.init_model(MODEL, seed=seed, mesh=mesh), SPEC, seed=seed)
    graphdef, adapters, base = split_adapters(model)
    leaves, treedef = jax.tree.flatten(adapters)
    keys = jax.random.split(jax.random.key(seed + 100), len(leaves))
    new = [jax.device_put(x + 0.2 * jax.random.normal(k, x.shape, x.dtype), x.sharding) for x, k in zip(leaves, keys)]
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, new), base)


def _grad_recorder() -> optax.GradientTransformation:
    """An 'optimizer' that leaves the parameters alone and keeps the exact gradient as its state."""
    return optax.GradientTransformation(
        lambda params: jax.tree.map(jnp.zeros_like, params),
        lambda grads, state, params=None: (jax.tree.map(jnp.zeros_like, grads), grads))


def _host(tree):
    return jax.tree.map(lambda a: np.array(a), tree)


def _lora_grads(cfg, mesh=None):
    tx = _grad_recorder()
    state = init_train_state(cfg, _adapted(mesh=mesh), tx=tx)
    batch = _batch() if mesh is None else ict_jax.sharding.shard_batch(_batch(), mesh)
    new, metrics = make_train_step(cfg, mesh, tx=tx)(state, batch)
    return _host(new.opt_state), {k: float(v) for k, v in metrics.items()}


# ------------------------------------------------------------------------------------------------
# The state
# ------------------------------------------------------------------------------------------------
def test_the_state_trains_the_adapters_and_freezes_the_base():
    model = _adapted()
    cfg = _config()
    state = init_train_state(cfg, model)
    _, adapters, base = split_adapters(model)
    assert jax.tree.structure(state.params) == jax.tree.structure(adapters)
    assert jax.tree.structure(state.frozen) == jax.tree.structure(base)
    # AdamW's moments are those of the adapters only (plus scalar counts): nothing of the base
    adapter_shapes = sorted(x.shape for x in jax.tree.leaves(adapters))
    moments = sorted(x.shape for x in jax.tree.leaves(state.opt_state) if x.ndim)
    assert moments == sorted(adapter_shapes * 2)
    assert reference_params(state) is None  # no copy: the reference is the base with the adapters off
    ids = _batch().tokens[:2]
    np.testing.assert_array_equal(np.asarray(state.model()(ids)), np.asarray(model(ids)))
    assert jax.tree.structure(state.model_state()) == jax.tree.structure(nnx.split(model)[1])
    # the same split of an abstract model (restore templates, AOT compiles): nothing allocated
    _, params, frozen = split_trainable(nnx.eval_shape(lambda: ict_jax.Qwen2(MODEL.replace(lora=SPEC),
                                                                            rngs=nnx.Rngs(0))))
    assert jax.tree.structure(params) == jax.tree.structure(adapters)
    assert jax.tree.structure(frozen) == jax.tree.structure(base)
    assert split_trainable(ict_jax.init_model(MODEL))[2] is None  # without adapters every parameter trains


def test_a_step_changes_the_adapters_and_not_the_base():
    cfg = _config("ict")
    state = init_train_state(cfg, _adapted())
    before_base, before_adapters = _host(state.frozen), _host(state.params)
    step = make_train_step(cfg)
    new, metrics = step(state, _batch())
    assert metrics["train/skipped"] == 0 and np.isfinite(float(metrics["loss/total"]))
    jax.tree.map(np.testing.assert_array_equal, _host(new.frozen), before_base)
    changed = jax.tree.map(lambda a, b: bool(np.abs(np.asarray(a) - b).max() > 1e-6), new.params, before_adapters)
    assert all(jax.tree.leaves(changed))
    new2, _ = step(new, _batch())  # the returned state steps again with the same program
    assert len(step.jitted) == 1 and int(new2.step) == 2
    with pytest.raises(ValueError, match="KL reference is the frozen base"):
        step(new2, _batch(), jax.tree.map(jnp.copy, new2.frozen))


def test_the_kl_reference_is_the_base_model():
    """logp_ref of a LoRA state = the base model's log-probabilities (float64 NumPy from its logits), while
    the policy's own logp differs (its adapters are nonzero)."""
    cfg = _config("dense", "stats.temperature=0.7")
    model = _adapted()
    state = init_train_state(cfg, model)
    plan = StepPlan.from_config(cfg, optax.identity())
    batch = _batch()
    valid = _valid(batch, False)
    ref_params, ref_def = kl_reference(state, None)
    logp_old, logp_ref, _ = old_policy_pass(plan, state.params, ref_params, state.model_def(), batch, valid, ref_def)
    assert logp_old is None  # fused: the gradient forward gives it

    def logp(logits):
        x = np.asarray(logits, np.float64)[:, LP - 1:-1] / 0.7
        x = x - x.max(-1, keepdims=True)
        lp = x - np.log(np.exp(x).sum(-1, keepdims=True))
        return np.take_along_axis(lp, np.asarray(batch.tokens)[:, LP:, None], -1)[..., 0]

    real = np.asarray(valid) > 0
    base = model(batch.tokens, batch.attention_mask, adapters=False)
    np.testing.assert_allclose(np.asarray(logp_ref)[real], logp(base)[real], atol=1e-5, rtol=1e-6)
    policy = logp(model(batch.tokens, batch.attention_mask))
    assert np.abs(policy - logp(base))[real].max() > 1e-2


# ------------------------------------------------------------------------------------------------
# The gradient: the chain rule of the full-parameter gradient at the merged model
# ------------------------------------------------------------------------------------------------
def _chain_rule(full_grads, adapters):
    """dL/dA = s G B^T and dL/dB = s A^T G per layer, from the full gradient G of each adapted weight."""
    s = SPEC.scale
    out = {}
    for target in SPEC.targets:
        name = LORA_MODULES[target][0]
        a = np.asarray(adapters["layers"]["lora"][f"{name}_lora_a"][...], np.float64)
        b = np.asarray(adapters["layers"]["lora"][f"{name}_lora_b"][...], np.float64)
        g = np.asarray(full_grads["layers"][name][...], np.float64)
        L, r = a.shape[0], a.shape[-1]
        a2, b2, g2 = a.reshape(L, -1, r), b.reshape(L, r, -1), g.reshape(L, a.reshape(L, -1, r).shape[1], -1)
        out[f"{name}_lora_a"] = (s * g2 @ b2.transpose(0, 2, 1)).reshape(a.shape)
        out[f"{name}_lora_b"] = (s * a2.transpose(0, 2, 1) @ g2).reshape(b.shape)
    return out


def _check_chain_rule(method: str, *extra: str):
    cfg = _config(method, *extra)
    tx = _grad_recorder()
    adapted = _adapted()
    _, adapters, base = split_adapters(adapted)
    lora_grads, m_lora = _lora_grads(cfg)
    # the same function, parameterised by full weights: the merged model, with the base as the reference
    merged = merge_adapters(adapted)
    full_state = init_train_state(cfg, merged, tx=tx)
    ref = jax.tree.map(jnp.copy, base)
    new, m_full = make_train_step(cfg, tx=tx)(full_state, _batch(), ref)
    want = _chain_rule(_host(new.opt_state), _host(adapters))
    got = {k: np.asarray(v[...]) for k, v in lora_grads["layers"]["lora"].items()}
    assert set(got) == set(want)
    scale = max(np.abs(w).max() for w in want.values())
    assert scale > 1e-4  # a real gradient
    for k in want:
        np.testing.assert_allclose(got[k], want[k], atol=2e-4 * scale, rtol=1e-3, err_msg=k)
    for k in ("loss/total", "loss/kl", "kl/valid_mean", "mask/selected_frac", "stats/H1_mean"):
        np.testing.assert_allclose(m_lora[k], m_full[k], rtol=1e-4, atol=1e-6, err_msg=k)
    if cfg.rl.loss.kl_coef > 0:
        assert m_lora["loss/kl"] > 0  # the reference differs from the policy


# the default suite: ict fused; micro-batches and the one-pass head (the last) in the e2e stage (8-11 s each)
@pytest.mark.parametrize("method,extra", [("ict", ()), pytest.param("entropy", ("train.micro_batches=2",), marks=pytest.mark.e2e),
                                          pytest.param("dense", ("rl.loss.kl_coef=0",), marks=pytest.mark.e2e)])
def test_the_adapter_gradient_is_the_chain_rule_of_the_full_gradient(method, extra):
    _check_chain_rule(method, *extra)


# every method and every variant at least once (each_level_once: 7 of the 21 pairs, for CI time)
@pytest.mark.slow
@pytest.mark.parametrize("method, extra", each_level_once(METHODS, [(), ("train.micro_batches=4",),
                                                                    ("rl.loss.kl_coef=0",)]))
def test_chain_rule_covering(method, extra):
    _check_chain_rule(method, *extra)


# ------------------------------------------------------------------------------------------------
# Every method and schedule
# ------------------------------------------------------------------------------------------------
SCHEDULES = {"fused": (), "micro": ("train.micro_batches=2",), "mini": ("train.mini_batches=2", "train.micro_batches=2")}
# the default suite: three methods fused (dense and entropy: the chain-rule test, e2e); two other
# schedules in the e2e stage; in the slow suite every method and every schedule at least once, 7 pairs
# the others do not run (each_level_once rotated by one, for CI time: not the 16 of the product)
_DEFAULT = (("ict", "fused"), ("stapo", "fused"), ("random", "fused"))
_E2E = (("ict", "micro"), ("stapo", "mini"))
CASES = (list(_DEFAULT) + [pytest.param(m, s, marks=pytest.mark.e2e) for m, s in _E2E]
         + [pytest.param(m, s, marks=pytest.mark.slow) for m, s in each_level_once(METHODS, list(SCHEDULES), offset=1)
            if (m, s) not in _DEFAULT + _E2E])


@pytest.mark.parametrize("method,schedule", CASES)
def test_every_method_and_schedule_steps_with_lora(method, schedule):
    cfg = _config(method, *SCHEDULES[schedule])
    state = init_train_state(cfg, _adapted())
    base = _host(state.frozen)
    new, metrics = make_train_step(cfg)(state, _batch())
    assert metrics["train/skipped"] == 0
    assert all(np.isfinite(float(v)) for v in metrics.values()), metrics
    assert 0 < float(metrics["mask/selected_frac"]) <= 1 and float(metrics["loss/kl"]) > 0
    jax.tree.map(np.testing.assert_array_equal, _host(new.frozen), base)


@pytest.mark.e2e  # two meshes compiled (15 s); the full-parameter one stays in the default suite
def test_eight_devices_give_the_adapter_gradients_of_one(devices8):
    cfg = _config("ict", "train.micro_batches=2")
    one, m1 = _lora_grads(cfg)
    eight, m8 = _lora_grads(cfg, ict_jax.make_mesh(data=2, fsdp=2, tensor=2))
    chex.assert_trees_all_close(eight, one, rtol=2e-5, atol=1e-7)
    np.testing.assert_allclose(m8["loss/total"], m1["loss/total"], rtol=1e-5, atol=1e-7)


def test_sft_step_trains_only_the_adapters():
    from ict_jax.rl.sft import make_sft_step

    cfg = _config()
    step = make_sft_step(cfg)
    state = init_train_state(cfg, _adapted(), tx=step.tx)
    base, adapters = _host(state.frozen), _host(state.params)
    tokens = _batch().tokens[:4]
    ones = jnp.ones_like(tokens)
    new, metrics = step(state, tokens, ones, ones.at[:, :LP].set(0))
    assert np.isfinite(float(metrics["sft/loss"]))
    jax.tree.map(np.testing.assert_array_equal, _host(new.frozen), base)
    assert any(jax.tree.leaves(jax.tree.map(lambda a, b: bool((np.asarray(a) != b).any()), new.params, adapters)))


# ------------------------------------------------------------------------------------------------
# Compiled memory: no Adam moments of the base, no reference copy
# ------------------------------------------------------------------------------------------------
def _nbytes(tree) -> int:
    return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def test_compiled_step_holds_no_base_moments_and_no_reference_copy():
    """The compiled step's arguments are exactly (state, batch[, reference]): with LoRA the base once, the
    adapters and their two Adam moments; without, the weights, two moments and the reference copy."""
    mc = ict_jax.ModelConfig.demo(remat="block")
    cfg = _config("ict")
    abstract = lambda tree: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)  # noqa: E731
    full_state = init_train_state(cfg, ict_jax.init_model(mc))
    lora_state = init_train_state(cfg, ict_jax.init_model(mc.replace(lora=SPEC)))
    batch = abstract(_batch())
    step = make_train_step(cfg)
    ref = abstract(full_state.params)
    m_full = step.lower(abstract(full_state), batch, ref).compile().memory_analysis()
    m_lora = step.lower(abstract(lora_state), batch).compile().memory_analysis()
    p, a = _nbytes(full_state.params), _nbytes(lora_state.params)
    assert _nbytes(lora_state.frozen) == p and a == mc.replace(lora=SPEC).num_adapter_params() * 4
    small = _nbytes(batch) + 8 + 4 + 4 * 2  # batch, rng, step, Adam's counts (int32)
    assert m_full.argument_size_in_bytes == 3 * p + p + small  # weights, mu, nu, the reference copy
    assert m_lora.argument_size_in_bytes == p + 3 * a + small  # the base once, adapters, mu, nu
    assert m_lora.argument_size_in_bytes < 0.3 * m_full.argument_size_in_bytes


def test_lora_in_the_config_without_adapters_in_the_state_is_refused():
    """model.lora.enabled with a state that holds no adapters would train every parameter: one line."""
    from ict_jax.rl.sft import make_sft_step

    cfg = _config("ict", "model.lora.enabled=true")
    state = init_train_state(cfg, ict_jax.init_model(MODEL, seed=1))
    with pytest.raises(ValueError, match="model.lora.enabled is true but the train state holds no LoRA adapters"):
        make_train_step(cfg)(state, _batch())
    tokens = _batch().tokens[:4]
    with pytest.raises(ValueError, match="model.lora.enabled is true"):
        make_sft_step(cfg)(state, tokens, jnp.ones_like(tokens), jnp.ones_like(tokens))
    new, _ = make_train_step(cfg)(init_train_state(cfg, _adapted()), _batch())  # with adapters it trains
    assert new.frozen is not None
