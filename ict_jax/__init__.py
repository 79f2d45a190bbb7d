"""ict_jax: RLVR on Qwen2.5 in JAX/Flax with ICT (Independent Combinatorial Tokens) and its baselines.

``__all__`` is what users call, by section; everything else is reached through its subpackage
(``ict_jax.data.prompts.pad_left``, ``ict_jax.rl.losses.loss_denominators``, ...): docs/architecture.md
maps every module. Names resolve lazily (PEP 562), so ``import ict_jax`` stays cheap (the CLI, reward
worker processes) and only the module a name lives in is imported when the name is first used.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.2.0"

# name -> module (relative to this package). One line per public name, grouped by section.
_API: dict[str, str] = {
    # -- model and weights (model/) --
    "ModelConfig": "model.config",
    "Qwen2": "model.qwen2",
    "init_model": "model.qwen2",
    "param_count": "model.qwen2",
    "WeightError": "model.weights",
    "load_hf": "model.weights",
    "save_hf": "model.weights",
    "load_gguf": "model.gguf",
    "resolve_model": "train.model_source",  # any model spec -> its ModelSource (docs/models.md)
    "ModelSource": "model.source",
    "LoraSpec": "model.config",  # LoRA adapters (docs/lora.md)
    "add_adapters": "model.adapters",
    "merge_adapters": "model.adapters",
    "save_peft_adapter": "model.peft",
    "load_peft_adapter": "model.peft",
    # -- device mesh (sharding.py) --
    "make_mesh": "sharding",
    # -- token statistics, selectors, losses, the train step, SFT (rl/) --
    "TokenStats": "rl.token_stats",
    "stats_from_logits": "rl.token_stats",
    "stats_from_hidden": "rl.token_stats",
    "stats_and_surrogate": "rl.token_stats",
    "dense_mask": "rl.selectors",
    "ict_mask": "rl.selectors",
    "entropy_mask": "rl.selectors",
    "stapo_mask": "rl.selectors",
    "random_mask": "rl.selectors",
    "select": "rl.selectors",
    "register_selector": "rl.selectors",
    "group_advantages": "rl.losses",
    "clipped_surrogate": "rl.losses",
    "k3_kl": "rl.losses",
    "policy_loss": "rl.losses",
    "register_loss_agg": "rl.losses",
    "RolloutBatch": "rl.batch",
    "build_rollout_batch": "rl.batch",
    "TrainState": "rl.state",
    "init_train_state": "rl.state",
    "make_optimizer": "rl.state",
    "reference_params": "rl.state",
    "make_train_step": "rl.train_step",
    "sft_step": "rl.sft",
    # -- sampling and evaluation (sampling/) --
    "generate": "sampling.sampler",
    "make_generate_fn": "sampling.sampler",
    "Rollout": "sampling.sampler",
    "make_text_generator": "sampling.text_generation",
    "evaluate_benchmarks": "sampling.evaluation",  # = sampling.evaluation.evaluate
    "pass_at_k": "sampling.evaluation",
    # -- data and tokenizers (data/) --
    "Example": "data.example",
    "Dataset": "data.datasets",
    "load_dataset": "data.datasets",
    "load_tokenizer": "model.tokenizers",
    "CharTokenizer": "model.tokenizers",
    # -- rewards (rewards/) --
    "RewardSpec": "rewards.checks",
    "check_text": "rewards.checks",
    "score_text": "rewards.checks",
    "register_reward_kind": "rewards.checks",
    "RewardPool": "rewards.pool",
    # -- configuration (config.py) --
    "Config": "config",
    "ConfigError": "config",
    "load_config": "config_load",
    # -- training runs (train/) --
    "Trainer": "train.trainer",
    "TrainingDiverged": "train.stopping",
    "Checkpointer": "train.checkpoints",
    "export_checkpoint": "train.export",
    # -- experiments (experiments/) --
    "run_comparison": "experiments.compare",
    # -- diagnostics (diagnostics/) --
    "token_report": "diagnostics.inspector",
    "render_html": "diagnostics.inspector_page",
}

__all__ = sorted(_API) + ["__version__"]
_SUBMODULES = ("config", "sharding", "model", "data", "rewards", "sampling", "rl", "train", "aot", "experiments",
               "diagnostics", "cli")

# What the command line does before JAX starts, for library and notebook use too: with libtpu installed
# on a machine without a TPU (or a GPU), select the CPU, so that JAX's backend start prints no libtpu
# warnings (ict_jax.platform.use_cpu_without_accelerators: JAX_PLATFORMS=cpu, and jax_platforms in a JAX
# imported before ict_jax whose backends have not started; only when JAX_PLATFORMS is unset; docs/tpu.md).
importlib.import_module(".platform", __name__).use_cpu_without_accelerators()


def _resolve(module: str, name: str) -> Any:
    if module.endswith("evaluation") and name == "evaluate_benchmarks":
        name = "evaluate"
    return getattr(importlib.import_module(f".{module}", __name__), name)


def __getattr__(name: str) -> Any:
    if name in _API:
        value = _resolve(_API[name], name)
        globals()[name] = value  # cache: the next access skips __getattr__
        return value
    if name in _SUBMODULES:  # ``ict_jax.sharding.make_mesh`` after a bare ``import ict_jax``
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'ict_jax' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_API))
