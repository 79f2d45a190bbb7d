"""train/programs.py: the one builder of a run's programs. Training (its real state: the SFT state of a run
with SFT ahead) and ``ict-jax compile`` (abstract train state, ``aot.compile``) build the same
computations, the SFT step among them; a program compiles once per shape from its abstract arguments and
calling it runs that executable."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest

from ict_jax.config_load import load_config

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "configs" / "demo.yaml"
# the tiny trainer run of tests/train/test_trainer.py, with SFT steps ahead (training builds the programs from its
# SFT state), the KL reference and an evaluation set (every argument of every program), on a 4 x 1 x 2 mesh of
# the 8 test devices
TINY = ["model.preset=tiny", "rollout.num_samples=4", "train.prompts_per_step=4", "rollout.max_new_tokens=6",
        "rollout.max_prompt_len=16", "train.sft_steps=2", "train.sft_batch_size=8", "rl.selector.warmup_steps=1",
        "train.steps=1",
        "data.train=[\"arith?digits=1&size=64\"]", "data.eval=[\"split?digits=1&size=4&seed=5\"]", "data.eval_n=2",
        "data.eval_k=[1,2]", "stats.chunk=8", "rl.reward.workers=1", "rl.loss.kl_coef=0.01", "mesh.data=-1",
        "mesh.tensor=2"]


@pytest.fixture(scope="module")
def run_parts(tmp_path_factory, devices8):
    from ict_jax.train.parts import build_parts

    cfg = load_config(DEMO, TINY + [f"run_dir={tmp_path_factory.mktemp('programs') / 'run'}"])
    parts, state, ref = build_parts(cfg, progress=False)
    yield cfg, parts, state, ref
    parts.close()


def test_a_run_has_four_programs_the_sft_step_first():
    from ict_jax.aot.compile import PROGRAMS, run_programs
    from ict_jax.train.programs import PROGRAM_NAMES

    assert PROGRAM_NAMES == PROGRAMS == ("sft", "step", "generate", "eval")
    cfg = load_config(DEMO, TINY)
    assert run_programs(cfg) == PROGRAM_NAMES  # ict-jax compile's default: the SFT step when the run has SFT steps
    assert run_programs(cfg.replace(**{"train.sft_steps": 0})) == ("step", "generate", "eval")


@pytest.mark.e2e  # lowers the four programs twice (~10 s on 2 cores)
def test_training_and_compile_build_the_same_programs(run_parts):
    """The programs a run trains with (built from its real state: here its SFT state, SFT being ahead)
    and those ``ict-jax compile`` checks (built from the config alone) lower to the same modules."""
    from ict_jax.aot.compile import build_programs, get_target, run_mesh, target_model_config
    from ict_jax.train.checkpoints import abstract_tree
    from ict_jax.train.programs import same_layout

    cfg, parts, state, ref = run_parts
    assert parts.sft_ahead and ref is None  # the warm start holds no KL reference and no RL optimizer state
    assert same_layout(abstract_tree(state), parts.programs.sft.abstract()[0])  # the state is the sft program's
    target = get_target("local")
    mc, source = target_model_config(cfg, target.platform)
    assert source == "preset tiny" and mc.vocab_size == parts.model_config.vocab_size  # sized to the char tokenizer
    jobs = build_programs(cfg, mc, run_mesh(cfg, target))
    assert [j.name for j in jobs] == ["sft", "step", "generate", "eval"]
    texts = {}
    for job in jobs:
        trained = parts.programs.by_name()[job.name].lower().as_text()
        texts[job.name] = job.lower().as_text()
        assert texts[job.name] == trained, f"{job.name}: compile and training lower different modules"
    # the modules are not trivially equal: the rollout and evaluation samplers differ (G, temperature)
    assert texts["generate"] != texts["eval"]


@pytest.mark.e2e  # compiles and runs the tiny evaluation sampler twice (~10 s)
def test_the_eval_program_runs_what_it_compiled_and_matches_the_jitted_sampler(run_parts):
    """The run's evaluation program, compiled from its abstract arguments, gives the tokens of the same
    sampler jitted and called directly."""
    from ict_jax.train.programs import TokenIds, sampler_fn

    cfg, parts, state, _ = run_parts
    gen = parts.programs.eval
    P, Lp = gen.largest
    assert (P, Lp) == (4, 16)
    ids = np.full((P, Lp), 5, np.int32)
    key = jax.random.fold_in(jax.random.key(0), 1)
    ro = gen(state.model_state(), ids, np.ones_like(ids), key)
    assert np.asarray(ro.tokens).shape == (P * cfg.data.eval_n, cfg.rollout.max_new_tokens)
    assert list(gen.executables) == [(P, Lp)]
    direct = sampler_fn("eval", cfg, state.graphdef, parts.mesh, TokenIds.of(parts.tokenizer), "cpu")
    np.testing.assert_array_equal(np.asarray(direct(state.model_state(), ids, np.ones_like(ids), key).tokens),
                                  np.asarray(ro.tokens))


def test_a_program_compiles_once_per_shape_and_runs_that_executable(devices8):
    """compile() from the abstract arguments once; a call at those shapes runs that very executable
    (the arguments placed as it expects: host arrays sharded, the jit's own cache never used), a call at
    another shape compiles its own; the donated argument is consumed."""
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from ict_jax.sharding import make_mesh
    from ict_jax.train.programs import Program

    mesh = make_mesh(4, 2, 1, devices=devices8)
    rows = NamedSharding(mesh, PartitionSpec(("data", "fsdp"), None))
    jitted = jax.jit(lambda w, x: (w * 2, x @ w), donate_argnums=(0,))

    def abstract_for(shape):
        return (jax.ShapeDtypeStruct((shape[1], 3), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec())),
                jax.ShapeDtypeStruct(shape, jnp.float32, sharding=rows))

    prog = Program("toy", jitted.lower, abstract_for, lambda args: tuple(args[1].shape), (8, 4))
    exe = prog.compile()
    assert prog.compile() is exe and list(prog.executables) == [(8, 4)]
    w = jax.device_put(jnp.ones((4, 3)), NamedSharding(mesh, PartitionSpec()))
    x = np.arange(32, dtype=np.float32).reshape(8, 4)
    w2, y = prog(w, x)
    np.testing.assert_array_equal(np.asarray(y), x @ np.ones((4, 3), np.float32))
    assert w.is_deleted() and y.sharding.is_equivalent_to(rows, 2)  # donated; rows split as compiled
    assert list(prog.executables) == [(8, 4)] and jitted._cache_size() == 0
    prog(w2, np.ones((16, 4), np.float32))  # another shape: its own executable
    assert sorted(prog.executables) == [(8, 4), (16, 4)]


def test_a_runs_optimizers_are_built_once_and_passed_to_its_programs(devices8, monkeypatch):
    """train.programs.Optimizers: the run's builder makes them once; the steps and their states take them
    from there (nothing below builds another from the config)."""
    import ict_jax.rl.sft
    import ict_jax.rl.train_step
    from ict_jax.aot.compile import get_target, run_mesh, target_model_config
    from ict_jax.train.checkpoints import abstract_train_state
    from ict_jax.train.programs import Optimizers, build_programs

    cfg = load_config(DEMO, TINY)
    optimizers = Optimizers.of(cfg)
    mc, _ = target_model_config(cfg, "cpu")
    mesh = run_mesh(cfg, get_target("local"))
    state = abstract_train_state(cfg, mc, mesh=mesh, tx=optimizers.rl)

    def built_again(*args, **kwargs):
        raise AssertionError("an optimizer built again from the config")

    for module, name in [(ict_jax.rl.train_step, "make_optimizer"), (ict_jax.rl.sft, "make_sft_optimizer"),
                         (ict_jax.train.programs, "make_optimizer"), (ict_jax.train.programs, "make_sft_optimizer")]:
        monkeypatch.setattr(module, name, built_again)
    programs = build_programs(cfg, mesh, mc, state, optimizers=optimizers)
    assert programs.optimizers is optimizers
    assert [p.abstract() is not None for p in (programs.sft, programs.step)] == [True, True]


def test_run_parts_are_frozen_and_typed():
    """RunParts: frozen, and no field typed Any; the train state is not among them."""
    import dataclasses
    import typing

    from ict_jax.train.parts import RunParts

    hints = typing.get_type_hints(RunParts)
    fields = {f.name for f in dataclasses.fields(RunParts)}
    assert fields == set(hints) and "state" not in fields and len(fields) >= 10
    untyped = [name for name, t in hints.items() if t is typing.Any or typing.Any in typing.get_args(t)]
    assert not untyped, untyped
    assert RunParts.__dataclass_params__.frozen


@pytest.mark.parametrize("override, gathered", [([], True), (["rollout.gather_weights=true"], True),
                                               (["rollout.gather_weights=false"], False)])
def test_both_samplers_take_rollout_gather_weights(override, gathered):
    """``rollout.gather_weights`` reaches the rollout and the evaluation sampler alike (``auto`` by default:
    gathering; the pre-flight turns it off where that does not fit, tests/train/test_preflight.py)."""
    from flax import nnx

    from ict_jax.model.config import ModelConfig
    from ict_jax.model.qwen2 import Qwen2
    from ict_jax.train.programs import PLACEHOLDER_IDS, sampler_fn

    cfg = load_config(DEMO, ["model.preset=tiny", *override])
    graphdef = nnx.split(nnx.eval_shape(lambda: Qwen2(ModelConfig.tiny(), rngs=nnx.Rngs(0))))[0]
    for name in ("generate", "eval"):
        assert sampler_fn(name, cfg, graphdef, None, PLACEHOLDER_IDS, "cpu").settings.gather_weights is gathered
