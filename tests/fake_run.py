"""A training run directory made without training, for the tests of what reads one (model specs, the
commands given a run as a model): ``config.json``, an empty ``metrics.jsonl``, ``sft_model`` and
``checkpoints/1`` (tokenizer ``char``), all of one tiny random model. A test-support module (no tests of its
own): tests/ is on sys.path under pytest, so a test imports it as ``from fake_run import ...``."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from ict_jax.config_load import load_config
from ict_jax.model.config import ModelConfig
from ict_jax.model.qwen2 import init_model
from ict_jax.model.weights import save_hf

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "configs" / "demo.yaml"


def run_model():
    """The run's model: a fresh copy each call (vocabulary 100, the char tokenizer's), the same weights."""
    return init_model(ModelConfig.tiny(vocab_size=100, hidden_size=32, intermediate_size=64, num_layers=2), seed=1)


def make_run_dir(run: Path) -> Path:
    """Write the run directory ``run`` (which must not exist) as ``ict-jax train`` leaves it; returns it."""
    from ict_jax.rl.state import init_train_state
    from ict_jax.train.checkpoints import Checkpointer

    cfg = load_config(DEMO, [f"run_dir={run}", "model.preset=tiny"])
    model = run_model()
    run.mkdir()
    (run / "config.json").write_text(json.dumps(cfg.to_dict()))
    (run / "metrics.jsonl").write_text("")
    save_hf(model, run / "sft_model")
    with Checkpointer(run / "checkpoints") as ck:
        ck.save(1, init_train_state(cfg, model), {"tokenizer": "char", "config": cfg.to_dict(),
                                                  "model_config": dataclasses.asdict(model.config)})
    return run
