"""ict_jax: RLVR on Qwen2.5 in JAX/Flax with ICT (Independent Combinatorial Tokens) and its baselines.

The public API is listed below by section. Names are resolved lazily (PEP 562) so that
``import ict_jax`` stays cheap (the CLI, reward worker processes) and only the submodule a name lives
in is imported when the name is first used.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# name -> submodule (relative to this package). One line per public name, grouped by section.
_API: dict[str, str] = {
    # -- model and weights (model/) --
    "ModelConfig": "model.config",
    "Qwen2": "model.qwen2",
    "KVCache": "model.qwen2",
    "init_model": "model.qwen2",
    "param_count": "model.qwen2",
    "WeightError": "model.weights",
    "load_hf": "model.weights",
    "save_hf": "model.weights",
    "load_gguf": "model.gguf",
    # -- device mesh and the logical-axis rule table (sharding.py) --
    "make_mesh": "sharding",
    "LOGICAL_RULES": "sharding",
    "logical_sharding": "sharding",
    "batch_sharding": "sharding",
    "shard_batch": "sharding",
    "logical_to_spec": "sharding",
    "state_shardings": "sharding",
    "check_prompts_divide": "sharding",
    # -- tokenizers (tokenizer.py) --
    "Tokenizer": "tokenizer",
    "load_tokenizer": "tokenizer",
    "CharTokenizer": "tokenizer",
    "HFTokenizer": "tokenizer",
    "QWEN2P5_CHAT_TEMPLATE": "tokenizer",
    "render_chat_template": "tokenizer",
    # -- losses (grpo.py) --
    "group_advantages": "grpo",
    "zero_std_groups": "grpo",
    "k3_kl": "grpo",
    "clipped_surrogate": "grpo",
    "policy_loss": "grpo",
    "loss_denominators": "grpo",
    "LossDenominators": "grpo",
    # -- token statistics (token_stats.py) --
    "TokenStats": "token_stats",
    "stats_from_logits": "token_stats",
    "stats_from_hidden": "token_stats",
    "stats_and_surrogate": "token_stats",
    # -- selectors (selectors.py) --
    "dense_mask": "selectors",
    "ict_mask": "selectors",
    "entropy_mask": "selectors",
    "stapo_mask": "selectors",
    "random_mask": "selectors",
    "register_selector": "selectors",
    "select": "selectors",
    "RANDOM_MASK_STREAM": "selectors",
    # -- data (data.py) --
    "Example": "data",
    "Dataset": "data",
    "DataError": "data",
    "load_dataset": "data",
    "DATASETS": "data",
    "PAPER_BENCHMARKS": "data",
    "format_prompt": "data",
    "EncodedPrompts": "data",
    "encode_prompts": "data",
    "PromptBatch": "data",
    "PromptIterator": "data",
    "make_buckets": "data",
    "pad_left": "data",
    "gym_score": "data",
    # -- sampler (sampler.py) --
    "generate": "sampler",
    "Rollout": "sampler",
    "make_generate_fn": "sampler",
    "GenerateFn": "sampler",
    "SampleSettings": "sampler",
    "sample_token": "sampler",
    # -- the train step (train_step.py) --
    "RolloutBatch": "train_step",
    "build_rollout_batch": "train_step",
    "TrainState": "train_step",
    "make_train_step": "train_step",
    "init_train_state": "train_step",
    "make_optimizer": "train_step",
    "reference_params": "train_step",
    # -- rewards (rewards.py) --
    "RewardPool": "reward_pool",
    "RewardSpec": "rewards",
    "RewardCheck": "rewards",
    "score_text": "rewards",
    "check_text": "rewards",
    "math_equal": "rewards",
    "extract_answer": "rewards",
    "extract_choice": "rewards",
    "last_boxed": "rewards",
    # -- evaluation (evaluate.py) --
    "evaluate_benchmarks": "evaluate",  # = evaluate.evaluate (``ict_jax.evaluate`` is the submodule)
    "pass_at_k": "evaluate",
    "aggregate": "evaluate",
    "format_table": "evaluate",
    "EVAL_DEFAULTS": "evaluate",
    # -- loading a model by path, text generation (loading.py, generation.py) --
    "load_model_and_tokenizer": "loading",
    "make_text_generator": "generation",
    "TextGenerator": "generation",
    "template_dataset": "generation",
    # -- SFT warm start and the trainer (sft.py, trainer.py) --
    "sft_step": "sft",
    "make_sft_step": "sft",
    "sft_loss": "sft",
    "Trainer": "trainer",
    "TrainingDiverged": "trainer",
    # -- configuration (config.py) --
    "Config": "config",
    "ConfigError": "config",
    "load_config": "config",
    # -- checkpoints (checkpoint.py) --
    "Checkpointer": "checkpoint",
    "load_params_from_checkpoint": "checkpoint",
    "export_checkpoint": "checkpoint",
    # -- the token inspector (inspect_tokens.py, its page in inspect_html.py) --
    "token_report": "inspect_tokens",
    "render_html": "inspect_html",
    # -- the method comparison (compare.py; ``ict_jax.compare`` is the submodule) --
    "run_comparison": "compare",
}

__all__ = sorted(_API) + ["__version__"]


def __getattr__(name: str) -> Any:
    try:
        module = _API[name]
    except KeyError:
        raise AttributeError(f"module 'ict_jax' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # cache: the next access skips __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_API))
