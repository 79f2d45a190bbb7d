"""ict_jax.train.export: a training checkpoint written as a Hugging Face directory that loads back as the same
model, with the run's config beside it."""

import dataclasses
import json
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from ict_jax.config_load import load_config
from ict_jax.model.config import ModelConfig
from ict_jax.model.qwen2 import init_model
from ict_jax.model.source import RUN_CONFIG_FILE
from ict_jax.train.export import export_checkpoint
from ict_jax.train.model_source import resolve_model

DEMO = Path(__file__).resolve().parents[2] / "configs" / "demo.yaml"


def test_export_of_a_checkpoint_loads_back_as_the_same_model(tmp_path):
    from ict_jax.rl.state import init_train_state
    from ict_jax.train.checkpoints import Checkpointer

    cfg = load_config(DEMO, [f"run_dir={tmp_path / 'run'}", "model.preset=tiny"])
    model = init_model(ModelConfig.tiny(vocab_size=100, hidden_size=32, intermediate_size=64, num_layers=1), seed=2)
    with Checkpointer(tmp_path / "run" / "checkpoints") as ck:
        ck.save(3, init_train_state(cfg, model), {"tokenizer": "char", "config": cfg.to_dict(),
                                                  "model_config": dataclasses.asdict(model.config)})
    source = resolve_model(tmp_path / "run", checkpoint=True)
    out = export_checkpoint(source, tmp_path / "hf")
    assert json.loads((out / RUN_CONFIG_FILE).read_text()) == cfg.to_dict()
    back = resolve_model(out)  # an exported char run's directory: its recorded tokenizer
    assert back.kind == "hf" and back.tokenizer_spec == "char" and back.config == model.config
    for x, y in zip(jax.tree.leaves(nnx.state(back.load(), nnx.Param)), jax.tree.leaves(nnx.state(model, nnx.Param))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    with pytest.raises(FileNotFoundError, match="no finished checkpoint in"):
        export_checkpoint(out, tmp_path / "again")
