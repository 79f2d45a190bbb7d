"""Former home of a run's assembly (``build_run``, ``Run``, ``run_eval``), now split into
``train.parts`` (the frozen :class:`~ict_jax.train.parts.RunParts`, :func:`~ict_jax.train.parts.build_parts`),
``train.programs``, ``train.resume``, ``train.model_source``, ``train.training_data``,
``train.evaluation`` and ``train.distributed``. The names below still resolve here, with a
DeprecationWarning that names their new home and the version that removes them (``ict_jax.deprecation``);
``Run``, ``build_run`` and ``run_eval`` are gone (a run's parts no longer hold its train state:
``build_parts`` returns it, ``Evaluator.evaluate`` takes it)."""

from __future__ import annotations

from typing import Any

from ict_jax.deprecation import REMOVED_IN, MovedNames

# name -> its module in ict_jax.train
_MOVED = {
    "maybe_initialize_distributed": "distributed",
    "check_run_dir": "run_dir", "ResumePoint": "resume", "resume_point": "resume", "finished_sft_steps": "resume",
    "SFT_CHECKPOINTS": "resume", "SFT_MODEL": "resume",
    "model_overrides": "model_source", "build_model_and_tokenizer": "model_source",
    "TrainingPrompts": "training_data", "encode_training_data": "training_data",
    "make_reward_pool": "parts",
}
# their new homes in train.model_source are deprecated too: the warning names the replacement
_USE = {"model_overrides": "ict_jax.resolve_model(config), which applies the model section",
        "build_model_and_tokenizer": "ict_jax.resolve_model(config) and its .load(mesh=...), .tokenizer() and "
                                     ".tokenizer_spec"}
_FORMER = MovedNames(__name__, {name: f"ict_jax.train.{module}.{name}" for name, module in _MOVED.items()},
                     removed_in=REMOVED_IN, use=_USE)
_REPLACED = {
    "Run": "ict_jax.train.parts.RunParts (frozen; build_parts returns the train state beside it)",
    "build_run": "ict_jax.train.parts.build_parts, which returns (parts, state, reference)",
    "run_eval": "ict_jax.train.evaluation.Evaluator(parts).evaluate(state, step)",
}


def __getattr__(name: str) -> Any:
    if name in _REPLACED:
        raise AttributeError(f"ict_jax.train.run.{name} was replaced by {_REPLACED[name]}")
    return _FORMER.resolve(name)
