"""``model.attention: xla | cudnn | splash``: the fused kernels give today's dense attention's values and
gradients at every real position, on left-padded (and right-padded) rows, in float32.

``xla`` runs here as the reference of the sequence-lengths path (``cudnn`` takes the same path on a GPU);
``splash`` runs in Pallas' interpreter on the CPU; the TPU compile of the splash path is in
tests/aot/test_compile.py (the tiny preset, whose ``auto`` attention on a TPU is splash)."""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ict_jax
from ict_jax.model.attention import attend
from ict_jax.model.config import ModelConfig, resolve_attention
from ict_jax.model.fused_attention import fused_attend, splash_block

# the parity tolerances of tests/model/test_attention.py (float32)
ATOL = RTOL = 2e-6
GRAD_TOL = 1e-5


def _rows(B=3, T=21, H=4, KV=2, hd=16, seed=0):
    """q, k, v and the key mask of rows: unpadded, left-padded by 8, left-padded by 3 and right-padded
    by 5 (a prompt + response row whose response ended early)."""
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((B, T, H, hd)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((B, KV, T, hd)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((B, KV, T, hd)), jnp.float32)
    mask = np.ones((B, T), np.int32)
    mask[1, :8] = 0
    mask[2, :3] = 0
    mask[2, T - 5:] = 0
    return q, k, v, jnp.asarray(mask)


def _allowed(mask):
    T = mask.shape[1]
    return jnp.tril(jnp.ones((T, T), bool))[None] & (mask[:, None, :] > 0)


def _fused(impl):
    kw = dict(interpret=True) if impl == "splash" else {}
    return lambda q, k, v, mask: fused_attend(q, k, v, mask, jnp.float32, impl, **kw)


@pytest.mark.parametrize("impl", ["xla", "splash"])
def test_values_equal_dense_attention_at_every_real_position(impl):
    q, k, v, mask = _rows()
    ref = np.asarray(attend(q, k, v, _allowed(mask), jnp.float32))
    out = np.asarray(_fused(impl)(q, k, v, mask))
    assert out.shape == q.shape and np.isfinite(out).all()  # padding positions too: no NaN flows on
    real = np.asarray(mask, bool)
    np.testing.assert_allclose(out[real], ref[real], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("impl", ["xla", "splash"])
def test_gradients_equal_dense_attention(impl):
    """d/d(q, k, v) of a weighted sum over the real positions (what every loss reads): the padding
    positions' outputs differ between the forms, and get no gradient in either."""
    q, k, v, mask = _rows(seed=1)
    w = jnp.asarray(np.random.default_rng(2).standard_normal(q.shape), jnp.float32) * mask[:, :, None, None]
    allowed = _allowed(mask)
    ref = jax.grad(lambda *a: (attend(*a, allowed, jnp.float32) * w).sum(), argnums=(0, 1, 2))(q, k, v)
    got = jax.grad(lambda *a: (_fused(impl)(*a, mask) * w).sum(), argnums=(0, 1, 2))(q, k, v)
    for name, r, g in zip("qkv", ref, got):
        assert np.isfinite(np.asarray(g)).all(), name
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=GRAD_TOL, rtol=GRAD_TOL, err_msg=name)


def test_splash_pads_the_sequence_to_whole_blocks():
    assert [splash_block(n) for n in (1, 128, 129, 384, 1151, 1152, 2048)] == [128, 128, 256, 128, 128, 128, 512]


def test_bad_inputs_are_one_line_errors():
    q, k, v, mask = _rows()
    with pytest.raises(ValueError, match="implementation must be one of xla, cudnn, splash; got 'flash'"):
        fused_attend(q, k, v, mask, jnp.float32, "flash")
    with pytest.raises(ValueError, match="mask has shape"):
        fused_attend(q, k, v, mask[:, 1:], jnp.float32, "xla")


def test_auto_picks_the_backends_kernel():
    assert resolve_attention("auto", "tpu") == "splash"
    assert resolve_attention("auto", "gpu", "bfloat16") == "cudnn"
    assert resolve_attention("auto", "gpu", "float32") == "dense"  # cuDNN's flash attention takes no float32
    assert resolve_attention("auto", "cpu", "float32") == "dense"
    assert resolve_attention("blocked", "tpu") == "blocked" and resolve_attention("xla", "cpu") == "xla"
    assert ModelConfig.tiny().resolved_attention("cpu") == "dense"
    with pytest.raises(ValueError, match="ModelConfig.attention must be one of auto, dense, blocked, xla, cudnn, "
                                         "splash; got 'flash'"):
        ModelConfig.tiny(attention="flash")


# ------------------------------------------------------------------------------------------------
# The model: hidden states, parameter gradients and the sampler's prefill through the xla kernel
# ------------------------------------------------------------------------------------------------
def _model(attention: str, remat: str = "block"):
    return ict_jax.init_model(ModelConfig.tiny(compute_dtype="float32", attention=attention, remat=remat), seed=0)


def _batch():
    rng = np.random.default_rng(3)
    ids = jnp.asarray(rng.integers(3, 256, (3, 13)), jnp.int32)
    mask = np.ones((3, 13), np.int32)
    mask[0, :5] = 0  # left-padded prompts
    mask[1, :2] = 0
    mask[2, 10:] = 0  # a response that ended early
    return ids, jnp.asarray(mask)


@pytest.mark.parametrize("remat", ["none", "block"])
def test_the_models_hidden_states_and_parameter_gradients_equal_dense(remat):
    from flax import nnx

    ids, mask = _batch()
    real = np.asarray(mask, bool)

    def loss_and_grad(attention):
        model = _model(attention, remat)
        graphdef, params = nnx.split(model)
        w = jnp.asarray(np.random.default_rng(4).standard_normal((3, 13, 64)), jnp.float32) * mask[:, :, None]

        def loss(p):
            h = nnx.merge(graphdef, p).hidden_states(ids, mask)
            return (h * w).sum(), h

        (_, h), g = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)  # compiled, as trained
        return np.asarray(h), g

    h_ref, g_ref = loss_and_grad("dense")
    h, g = loss_and_grad("xla")
    np.testing.assert_allclose(h[real], h_ref[real], atol=1e-5, rtol=1e-5)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g), jax.tree.leaves(g_ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=GRAD_TOL, rtol=1e-4, err_msg=str(path))


def test_prefill_through_the_kernel_gives_the_caches_and_states_of_a_plain_extend():
    ids, mask = _batch()
    ids, mask = ids[:2, :9], mask[:2, :9]  # left-padded prompts
    model = _model("xla")
    cache = model.init_cache(2, 12)
    h_ref, c_ref = model.extend(ids, mask, cache)
    h, c = model.extend(ids, mask, cache, prefill=True)
    real = np.asarray(mask, bool)
    np.testing.assert_allclose(np.asarray(h)[real], np.asarray(h_ref)[real], atol=1e-5, rtol=1e-5)
    # the cache's slots of real tokens (what every later token reads) and its bookkeeping
    keep = np.pad(real, ((0, 0), (0, 3)))[None, :, None, :, None]  # the 3 empty slots stay empty in both
    np.testing.assert_allclose(np.where(keep, c.k, 0), np.where(keep, c_ref.k, 0), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.where(keep, c.v, 0), np.where(keep, c_ref.v, 0), atol=1e-5, rtol=1e-5)
    assert (np.asarray(c.mask) == np.asarray(c_ref.mask)).all() and (np.asarray(c.pos) == np.asarray(c_ref.pos)).all()


# ------------------------------------------------------------------------------------------------
# The splash path through the real TPU compiler (libtpu, the tpu extra)
# ------------------------------------------------------------------------------------------------

@pytest.mark.libtpu
@pytest.mark.parametrize("remat, kernels", [("block", 3), ("full", 4)])
def test_the_splash_kernel_compiles_for_a_v5e_slice_and_keeps_the_scores_on_chip(remat, kernels):
    """The tiny model's loss gradient, bfloat16, rows sharded over 4 v5e chips (the kernel under
    ``shard_map``), T = 200 (padded to 256 inside): no ``[rows, heads, T, T]`` array anywhere in the
    compiled program (the dense form's scores), and the kernel calls of the layer scans: the forward, then
    dq and dk/dv in the backward pass, where ``remat: block`` reads the saved residuals and ``full`` runs
    the forward kernel again."""
    from flax import nnx

    from ict_jax.aot.compile import get_target
    from ict_jax.sharding import make_mesh
    from ict_jax.train.checkpoints import abstract_params

    target = get_target("v5e:2x2")
    mesh = make_mesh(data=1, fsdp=4, devices=target.devices)
    c = ModelConfig.tiny(compute_dtype="bfloat16", attention="splash", remat=remat)
    graphdef, params, _ = abstract_params(c, mesh)
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "fsdp"), None))
    B, T = 8, 200
    ids = jax.ShapeDtypeStruct((B, T), jnp.int32, sharding=rows)

    def loss(p, ids, mask):
        return nnx.merge(graphdef, p).hidden_states(ids, mask).astype(jnp.float32).sum()

    with jax.set_mesh(mesh):
        text = jax.jit(jax.grad(loss)).lower(params, ids, ids).compile().as_text()
    assert text.count('custom_call_target="tpu_custom_call"') == kernels
    H, Tp = c.num_heads, 256
    for n in (T, Tp):  # neither the sequence nor its padded length squared, per chip or in all
        for rows_ in (B, B // 4):
            assert f"[{rows_},{H},{n},{n}]" not in text and f"[{rows_},2,2,{n},{n}]" not in text


@pytest.mark.e2e  # a whole program compiled for a TPU: seconds to half a minute
@pytest.mark.libtpu
def test_the_recipe_compiled_for_a_tpu_runs_splash_and_keeps_memory_discipline(tmp_path):
    """``ict-jax compile`` of the 0.5B recipe shrunk to the tiny preset (tests/aot/test_compile.py's) for
    v5e:2x2: ``model.attention: auto`` resolves to splash for the target, the step's HLO holds the kernel,
    and every memory-discipline check holds (the kernel's block tables are constants, not parameters)."""
    from ict_jax.aot.compile import compile_run, get_target
    from ict_jax.config_load import load_config

    tiny = ["model.preset=tiny", "train.prompts_per_step=16", "train.mini_batches=1", "train.micro_batches=2",
            "rollout.max_prompt_len=32", "rollout.max_new_tokens=40", "stats.chunk=16", "data.eval_n=4",
            "mesh.data=1", "mesh.fsdp=-1"]
    recipe = pathlib.Path(__file__).resolve().parents[2] / "configs" / "qwen2p5_0p5b_ict.yaml"
    cfg = load_config(str(recipe), tiny)
    assert cfg.model.attention == "auto"
    (step,), _ = compile_run(cfg, get_target("v5e:2x2"), ("step",), dump_dir=tmp_path)
    assert step.compiled and step.fits
    assert [c for c in step.checks if not c.ok] == []
    text = "".join(p.read_text() for p in tmp_path.rglob("*") if p.is_file())
    assert 'custom_call_target="tpu_custom_call"' in text


@pytest.mark.libtpu
def test_the_splash_kernel_runs_on_each_devices_rows_and_kv_heads_under_tensor_parallelism():
    """fsdp 2 x tensor 2 on v5e:2x2 (the 1.5B recipe's kind of mesh): each device's kernel calls take its 4
    of the 8 rows and its 1 of the 2 KV heads (with that head's 2 query heads), ``[4 x 1, 2, 256, 16]``:
    not the whole ``[8 x 2, ...]`` gathered onto every device."""
    from flax import nnx

    from ict_jax.aot.compile import get_target
    from ict_jax.sharding import make_mesh
    from ict_jax.train.checkpoints import abstract_params

    mesh = make_mesh(data=1, fsdp=2, tensor=2, devices=get_target("v5e:2x2").devices)
    c = ModelConfig.tiny(compute_dtype="bfloat16", attention="splash", remat="block")
    graphdef, params, _ = abstract_params(c, mesh)
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "fsdp"), None))
    ids = jax.ShapeDtypeStruct((8, 200), jnp.int32, sharding=rows)

    def loss(p, ids, mask):
        return nnx.merge(graphdef, p).hidden_states(ids, mask).astype(jnp.float32).sum()

    with jax.set_mesh(mesh):
        text = jax.jit(jax.grad(loss)).lower(params, ids, ids).compile().as_text()
    calls = [line for line in text.splitlines() if 'custom_call_target="tpu_custom_call"' in line]
    assert len(calls) == 3 and all("bf16[4,2,256,16]" in line for line in calls)
    assert not any("[8,2,256,16]" in line or "[16,2,256,16]" in line for line in calls)
