"""The model's foundation without PyTorch: presets, mesh factory, rule table, config validation, sharded init."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import ict_jax
from ict_jax import ModelConfig
from ict_jax.config import ConfigError
from ict_jax.config_load import load_config
from ict_jax.rl.quantile import rho_fraction
from ict_jax.rl.selectors import resolved_rho, resolved_scope
from ict_jax.sharding import logical_to_spec


@pytest.mark.parametrize("preset,count", [
    ("qwen2p5_0p5b", 494_032_768), ("qwen2p5_1p5b", 1_543_714_304), ("qwen2p5_7b", 7_615_616_512)])
def test_preset_param_counts_without_memory(preset, count):
    cfg = ModelConfig.preset(preset)
    assert ict_jax.param_count(cfg) == count  # jax.eval_shape: nothing is allocated
    assert cfg.num_params() == count


def test_public_api_resolves():
    for name in ict_jax.__all__:
        assert getattr(ict_jax, name) is not None, name


def test_make_mesh_shapes_and_errors(devices8):
    m = ict_jax.make_mesh(data=2, fsdp=2, tensor=2)
    assert dict(m.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    assert all(t == jax.sharding.AxisType.Auto for t in m.axis_types)
    assert dict(ict_jax.make_mesh(data=-1, tensor=2).shape) == {"data": 4, "fsdp": 1, "tensor": 2}
    with pytest.raises(ValueError, match=r"3 x 1 x 2 = 6 does not equal the 8 available devices"):
        ict_jax.make_mesh(data=3, fsdp=1, tensor=2)
    with pytest.raises(ValueError, match="product 3 does not divide the 8 devices"):
        ict_jax.make_mesh(data=-1, fsdp=3)
    with pytest.raises(ValueError, match="only one axis may be -1"):
        ict_jax.make_mesh(data=-1, fsdp=-1)
    with pytest.raises(ValueError, match="groups never straddle a shard"):
        ict_jax.sharding.check_prompts_divide(6, m)
    ict_jax.sharding.check_prompts_divide(8, m)


def test_rule_table_replicates_what_does_not_divide(devices8):
    mesh = ict_jax.make_mesh(data=1, fsdp=2, tensor=4)
    # Qwen2.5-0.5B: 14 query heads, 2 KV heads, width 896, vocab 151,936
    assert logical_to_spec(("layers", "embed", "q_heads", "head_dim"), (24, 896, 14, 64), mesh) == P(None, "fsdp", None, None)
    assert logical_to_spec(("layers", "embed", "kv_heads", "head_dim"), (24, 896, 2, 64), mesh) == P(None, "fsdp", None, None)
    assert logical_to_spec(("vocab", "embed"), (151_936, 896), mesh) == P("tensor", "fsdp")
    assert logical_to_spec(("layers", "embed", "mlp"), (24, 896, 4_864), mesh) == P(None, "fsdp", "tensor")
    assert logical_to_spec(("batch", "seq"), (8, 5), mesh) == P("fsdp", None)
    with pytest.raises(KeyError, match="no rule"):
        logical_to_spec(("nonsense",), (4,), mesh)


def test_sharded_init_equals_unsharded(devices8):
    cfg = ModelConfig.tiny()
    mesh = ict_jax.make_mesh(data=2, fsdp=2, tensor=2)
    a = ict_jax.init_model(cfg, seed=3)
    b = ict_jax.init_model(cfg, seed=3, mesh=mesh)
    assert b.layers.w_gate[...].sharding.spec == P(None, "fsdp", "tensor")
    chex.assert_trees_all_equal(jax.tree.map(np.asarray, a.layers.arrays()),
                                jax.tree.map(np.asarray, b.layers.arrays()))


def test_gather_fsdp_drops_the_fsdp_axis_keeps_tensor_and_refuses_plain_arrays(devices8):
    """sharding.gather_fsdp inside a program under a (1, 2, 4) mesh: every weight's spec without 'fsdp'
    (tensor kept), the values unchanged; a state of plain arrays (no logical axes) is an error, not a no-op."""
    from flax import nnx

    from ict_jax.sharding import gather_fsdp

    mesh = ict_jax.make_mesh(data=1, fsdp=2, tensor=4)
    graphdef, state = nnx.split(ict_jax.init_model(ModelConfig.tiny(), seed=3, mesh=mesh))
    assert state["layers"]["w_gate"][...].sharding.spec == P(None, "fsdp", "tensor")
    with jax.set_mesh(mesh):
        out = jax.jit(gather_fsdp)(state)
    def spec_is(x, *spec):
        return x[...].sharding.is_equivalent_to(jax.sharding.NamedSharding(mesh, P(*spec)), x[...].ndim)

    assert spec_is(out["layers"]["w_gate"], None, None, "tensor")
    assert spec_is(out["embed"], "tensor", None) and spec_is(state["embed"], "tensor", "fsdp")  # vocab over tensor
    chex.assert_trees_all_equal(jax.tree.map(np.asarray, nnx.to_pure_dict(out)),
                                jax.tree.map(np.asarray, nnx.to_pure_dict(state)))
    with jax.set_mesh(mesh), pytest.raises(ValueError, match="no nnx Variables with logical_axes"):
        jax.jit(gather_fsdp)(nnx.to_pure_dict(state))
    one = ict_jax.make_mesh(data=8, fsdp=1, tensor=1)
    with jax.set_mesh(one):
        assert jax.jit(gather_fsdp)(nnx.to_pure_dict(state)) is not None  # fsdp 1: nothing to gather, no error


def test_remat_modes_give_the_same_gradients():
    base = ModelConfig.tiny(remat="none")
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 6)))
    from flax import nnx

    grads = []
    for remat in ("none", "block", "full"):
        model = ict_jax.init_model(base.replace(remat=remat), seed=0)
        g = nnx.jit(nnx.grad(lambda m: jnp.mean(m.hidden_states(ids) ** 2)))(model)  # compiled, as trained
        grads.append(np.asarray(g.layers.w_up[...]))
    np.testing.assert_allclose(grads[1], grads[0], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(grads[2], grads[0], rtol=1e-5, atol=1e-7)


def test_config_errors_are_one_line_and_name_the_key(tmp_path):
    cases = {
        "rl.selector.methd=ict": "unknown config key 'rl.selector.methd'",
        "train.steps=abc": "train.steps: expected an integer",
        "mesh.fsdp=0": "mesh.fsdp: 0 is not allowed",
        "rl.selector.rho=0.12345": "more than 4 decimals",
        "train.mini_batches=3": "does not divide train.prompts_per_step=8",
    }
    for override, message in cases.items():
        with pytest.raises(ConfigError) as e:
            load_config(None, [override])
        assert message in str(e.value) and "\n" not in str(e.value)
    # a method is a plain string, checked against its registry when the run is built
    from ict_jax.train.plugins import check_registered

    with pytest.raises(ConfigError) as e:
        check_registered(load_config(None, ["rl.selector.method=foo"]))
    assert "rl.selector.method: 'foo' is not a registered selector; registered: dense, entropy" in str(e.value)
    assert "\n" not in str(e.value)
    bad = tmp_path / "bad.yaml"
    bad.write_text("rl: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")


def test_config_yaml_base_and_overrides(tmp_path):
    (tmp_path / "base.yaml").write_text("rl:\n  selector:\n    method: entropy\ntrain:\n  steps: 7\n")
    (tmp_path / "child.yaml").write_text("base: base.yaml\ntrain:\n  steps: 9\n")
    cfg = load_config(tmp_path / "child.yaml", ["rl.loss.kl_coef=0", "data.eval_k=1,2"])
    assert cfg.rl.selector.method == "entropy" and cfg.train.steps == 9 and cfg.rl.loss.kl_coef == 0.0
    assert cfg.data.eval_k == (1, 2)
    assert resolved_rho(cfg.rl.selector) == 0.2 and resolved_scope(cfg.rl.selector) == "batch"
    assert rho_fraction(0.3) == (3, 10) and rho_fraction(0.1234) == (617, 5000)


# ------------------------------------------------------------------------------------------------
# The parameter count
# ------------------------------------------------------------------------------------------------
def test_param_count_of_a_model_and_a_clear_error(tiny_model, tiny_config):
    """param_count(model) failed with a deep flax AttributeError; it counts a model's own parameters."""
    assert ict_jax.param_count(tiny_model) == ict_jax.param_count(tiny_config) == tiny_config.num_params()
    with pytest.raises(TypeError, match="param_count takes a ModelConfig or a Qwen2 model, got str"):
        ict_jax.param_count("tiny")


def test_info_lists_every_preset_of_the_registry(capsys):
    """`ict-jax info` listed a hard-coded subset (no `demo`); it lists the registry, which is exactly what
    model.preset accepts."""
    import typing

    from ict_jax.cli.main import main
    from ict_jax.config import ModelSection

    assert set(ModelConfig.presets()) == set(typing.get_args(typing.get_type_hints(ModelSection)["preset"]))
    assert main(["info"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.split("model presets:")[1].split("real models")[0].splitlines()[2:]
              if line.strip()]
    assert listed == list(ModelConfig.presets())


def test_import_ict_jax_chooses_the_cpu_when_libtpu_has_no_tpu(tmp_path):
    """With the tpu extra (libtpu) on a machine without a TPU, library and notebook use printed libtpu's
    warnings: `import ict_jax` (before jax) sets JAX_PLATFORMS=cpu as the command line does."""
    import importlib.util
    import os
    import subprocess
    import sys

    from ict_jax.platform import nvidia_gpu_present, tpu_chips_present

    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    code = "import os, ict_jax, jax; jax.devices(); print(os.environ.get('JAX_PLATFORMS'))"
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                         cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    expected = "cpu" if (importlib.util.find_spec("libtpu") and not tpu_chips_present()
                         and not nvidia_gpu_present()) else "None"
    assert run.stdout.strip() == expected
    assert "TPU_ACCELERATOR_TYPE" not in run.stderr and "TPU_WORKER_HOSTNAMES" not in run.stderr


#: what libtpu prints when JAX starts its TPU runtime on a machine without a TPU (docs/tpu.md)
_LIBTPU_NOISE = ("TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES", "libtpu", "InitGoogle", "Source Location Trace")


def test_import_jax_before_ict_jax_prints_no_libtpu_lines(tmp_path):
    """The order users write (the docs' snippets did): `import jax` first, then `import ict_jax`, then JAX's
    first use. libtpu's lines come when JAX starts its backends, after both imports; `import ict_jax` sets
    the imported JAX's `jax_platforms` to cpu, so stderr holds none of them."""
    import importlib.util
    import os
    import subprocess
    import sys

    from ict_jax.platform import nvidia_gpu_present, tpu_chips_present

    if importlib.util.find_spec("libtpu") is None:
        pytest.skip("libtpu is not installed (the `tpu` extra): JAX starts no TPU runtime, there is nothing to quiet")
    if tpu_chips_present() or nvidia_gpu_present():
        pytest.skip("this machine has an accelerator: JAX should start it, and ict_jax leaves the platforms alone")
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    code = ("import jax\nimport numpy as np\n\nimport ict_jax\n\n"
            "tok = ict_jax.CharTokenizer()\n"
            "x = jax.numpy.asarray(np.asarray([tok.encode('95=')], np.int32))\n"
            "print(jax.devices()[0].platform, jax.config.jax_platforms, int(x.sum()))\n")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                         cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split()[:2] == ["cpu", "cpu"], run.stdout
    noise = [line for line in run.stderr.splitlines() if any(s in line for s in _LIBTPU_NOISE)]
    assert not noise, run.stderr


def test_an_imported_jax_gets_the_cpu_only_before_its_backends_start(monkeypatch):
    """`_select_cpu_in_imported_jax` on stand-ins for JAX: nothing without an imported JAX; the option set
    only when JAX's backends have not started and the user set no `jax_platforms`."""
    import sys
    import types

    from ict_jax.platform import _select_cpu_in_imported_jax

    updates = []

    def fake_jax(platforms, started):
        config = types.SimpleNamespace(jax_platforms=platforms, update=lambda k, v: updates.append((k, v)))
        monkeypatch.setitem(sys.modules, "jax", types.SimpleNamespace(config=config))
        monkeypatch.setitem(sys.modules, "jax._src.xla_bridge",
                            types.SimpleNamespace(backends_are_initialized=lambda: started))

    fake_jax(None, started=True)
    assert not _select_cpu_in_imported_jax() and updates == []  # too late: the backends exist
    fake_jax("tpu", started=False)
    assert not _select_cpu_in_imported_jax() and updates == []  # the user's choice
    fake_jax(None, started=False)
    assert _select_cpu_in_imported_jax() and updates == [("jax_platforms", "cpu")]
    monkeypatch.setitem(sys.modules, "jax", types.SimpleNamespace())  # a JAX still being imported
    assert not _select_cpu_in_imported_jax()
    monkeypatch.delitem(sys.modules, "jax")
    assert not _select_cpu_in_imported_jax()  # no JAX imported: JAX_PLATFORMS does it at JAX's import
