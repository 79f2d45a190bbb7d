"""``plugins: [module, ...]``: a user's module imported when a run is built registers a selector that the
config then names like a built-in one (tests/lowprob_plugin.py registers ``lowprob``); every method the
config names is checked against its registry, one line naming the key and the registered names."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ict_jax.config import ConfigError
from ict_jax.config_load import load_config
from ict_jax.train.plugins import check_registered

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
DEMO = ROOT / "configs" / "demo.yaml"
PLUGIN = "lowprob_plugin"


@pytest.fixture
def plugin_path(monkeypatch):
    monkeypatch.syspath_prepend(str(TESTS))


def _error(overrides) -> str:
    with pytest.raises(ConfigError) as e:
        check_registered(load_config(None, overrides))
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


def test_a_plugin_registers_a_selector_the_config_names(plugin_path):
    from ict_jax.rl.selectors import BUILTIN_SELECTORS, registered_selectors, select, selector_info
    from ict_jax.rl.token_stats import TokenStats

    check_registered(load_config(None, [f"plugins=[{PLUGIN}]", "rl.selector.method=lowprob"]))
    assert "lowprob" in registered_selectors() and "lowprob" not in BUILTIN_SELECTORS
    info = selector_info("lowprob")
    assert (info.needs, info.rho, info.scope, info.topk, info.warmup) == (("logp",), 0.1, "sequence", True, False)
    # the lowest-probability 10 % of each response: k = max(1, ceil(0.1 * 12)) = 2 of 12 valid tokens
    logp = jnp.log(jnp.asarray(np.linspace(0.05, 0.95, 24, dtype=np.float32).reshape(2, 12)))
    valid = jnp.ones((2, 12))
    for invert, keep in ((False, [0, 1]), (True, [10, 11])):
        cfg = load_config(None, ["rl.selector.method=lowprob", f"rl.selector.params={{invert: {str(invert).lower()}}}"])
        m = np.asarray(select("lowprob", TokenStats(logp, None, None, None), jnp.zeros(2), valid,
                              key=jax.random.key(0), step=0, config=cfg.rl.selector))
        assert [list(np.flatnonzero(row)) for row in m] == [keep, keep]


def test_an_unknown_method_names_the_key_and_the_registered_ones(plugin_path):
    msg = _error(["rl.selector.method=lowprobb"])
    assert msg.startswith("rl.selector.method: 'lowprobb' is not a registered selector; registered: ")
    assert all(name in msg for name in ("dense", "grpo", "ict", "entropy", "stapo", "random", "frequent"))
    assert "lowprob," in _error([f"plugins=[{PLUGIN}]", "rl.selector.method=lowprobb"])  # the plugin's too


def test_a_plugin_that_cannot_be_imported_and_bad_params_are_one_line(plugin_path):
    assert _error(["plugins=[no_such_plugin_module]"]).startswith(
        "plugins: 'no_such_plugin_module': cannot import 'no_such_plugin_module' (ModuleNotFoundError")
    with pytest.raises(ConfigError, match="plugins: 'a-b' is not a module name"):
        load_config(None, ["plugins=[a-b]"])
    base = [f"plugins=[{PLUGIN}]", "rl.selector.method=lowprob"]
    assert "rl.selector.params.invert: expected true or false" in _error(base + ["rl.selector.params={invert: 3}"])
    assert "unknown config key 'rl.selector.params.inverse'" in _error(base + ["rl.selector.params={inverse: true}"])
    assert _error(["rl.selector.params={rho: 0.2}"]).startswith("rl.selector.params: selector 'ict' takes no params")
    with pytest.raises(ConfigError, match="rl.selector.params: expected a mapping"):
        load_config(None, ["rl.selector.params=3"])


def test_a_plugin_registers_a_loss_aggregation(plugin_path):
    from ict_jax.config import LossSection
    from ict_jax.rl.losses import policy_loss, registered_loss_aggs

    assert "unknown" not in registered_loss_aggs()
    msg = _error(["rl.loss.loss_agg=row-sum-mea"])
    assert msg.startswith("rl.loss.loss_agg: 'row-sum-mea' is not a registered loss aggregation; registered: "
                          "seq-mean-token-mean, token-mean, seq-mean-token-sum-norm")
    check_registered(load_config(None, [f"plugins=[{PLUGIN}]", "rl.loss.loss_agg=row-sum-mean"]))
    # sum w x / R against seq-mean-token-mean's (1/R) sum_i [sum_t w x / sum_t d]: equal when each row has 1 token
    rng = np.random.default_rng(0)
    logp = jnp.asarray(rng.normal(size=(4, 5)) - 2, jnp.float32)
    valid = jnp.asarray(np.arange(5) < np.asarray([5, 4, 3, 2])[:, None], jnp.float32)
    mask = jnp.zeros((4, 5)).at[:, 0].set(1.0) * valid
    adv = jnp.asarray([1.0, -0.5, 0.25, 2.0])
    losses = {agg: float(policy_loss(logp, logp, None, adv, valid, mask,
                                       config=LossSection(loss_agg=agg, kl_coef=0.0))[0])
              for agg in ("row-sum-mean", "seq-mean-token-mean")}
    assert losses["row-sum-mean"] == pytest.approx(losses["seq-mean-token-mean"]), losses
    assert losses["row-sum-mean"] == pytest.approx(-float(adv.mean()))


def test_a_plugin_registers_a_reward_kind_the_workers_score(plugin_path, monkeypatch):
    from ict_jax.rewards.checks import KINDS, answer_text, check_text, reward_kinds
    from ict_jax.rewards.pool import RewardPool

    check_registered(load_config(None, [f"plugins=[{PLUGIN}]"]))
    assert "reversed" in reward_kinds() and "reversed" not in KINDS
    assert check_text("reversed", answer_text("reversed", "123"), "123").correct
    assert check_text("reversed", "123", "123").reward == 0.0
    monkeypatch.chdir(TESTS)  # the workers search the working directory first
    with RewardPool(1, plugins=[PLUGIN], mem_limit_mb=None) as pool:
        checks = pool.check("reversed", ["  321", "123", ""], ["123"] * 3)
    assert [c.correct for c in checks] == [True, False, False] and checks[2].status == "no_answer"


def test_the_command_refuses_an_unregistered_method_before_writing(tmp_path, capsys):
    """``ict-jax train`` with a method nothing registered: one line naming the key and the registered names,
    exit 2, nothing written (the check runs first when the run is built)."""
    from ict_jax.cli.main import main

    run = tmp_path / "run"
    assert main(["train", "--config", str(DEMO), "rl.selector.method=lowprobb", f"run_dir={run}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "rl.selector.method: 'lowprobb' is not a registered selector; registered: " in err
    assert not run.exists() or sorted(p.name for p in run.iterdir()) == []


def test_no_module_of_the_package_names_the_plugin():
    named = [str(p.relative_to(ROOT)) for p in (ROOT / "ict_jax").rglob("*.py") if "lowprob" in p.read_text()]
    assert not named, named


@pytest.mark.e2e
def test_train_with_a_plugin_selector(tmp_path):
    """``ict-jax train --config configs/demo.yaml plugins=[lowprob_plugin] rl.selector.method=lowprob``
    trains (tiny settings), in a fresh process."""
    run = tmp_path / "run"
    env = dict(os.environ, XLA_FLAGS=os.environ["ICT_JAX_TEST_SUBPROCESS_XLA_FLAGS"], JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    tiny = ["model.preset=tiny", "rollout.num_samples=4", "train.prompts_per_step=4", "rollout.max_new_tokens=6",
            "train.sft_steps=0", "rl.selector.warmup_steps=0", "data.eval=[]", "stats.chunk=8",
            "rl.reward.workers=1", "train.save_every=0"]
    p = subprocess.run([sys.executable, "-m", "ict_jax.cli", "train", "--config", str(DEMO), "--no-progress",
                        f"plugins=[{PLUGIN}]", "rl.selector.method=lowprob", "rl.loss.loss_agg=row-sum-mean", "train.steps=2", *tiny,
                        f"run_dir={run}"], env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-4000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rl = [r for r in rows if r.get("phase", "rl") == "rl" and "mask/selected_frac" in r]
    assert [r["step"] for r in rl] == [0, 1]
    assert all(0 < r["mask/selected_frac"] < 0.5 for r in rl), [r["mask/selected_frac"] for r in rl]
    assert json.loads((run / "config.json").read_text())["plugins"] == [PLUGIN]
