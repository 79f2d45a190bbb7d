"""train/parts.py: what a run is checked for before anything is built (the rest of build_parts runs in
every trainer test: tests/train/test_trainer.py, test_programs.py, test_preflight.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ict_jax.config import ConfigError
from ict_jax.config_load import load_config

DEMO = Path(__file__).resolve().parents[2] / "configs" / "demo.yaml"


def test_the_sft_batch_must_split_over_the_batch_shards(devices8):
    """The SFT step splits its rows over data x fsdp like the train step: a batch that does not split is one
    line naming train.sft_batch_size, before anything compiles; without SFT steps it is not read."""
    from ict_jax.train.parts import run_mesh_checked

    cfg = load_config(DEMO, ["mesh.data=8", "train.prompts_per_step=8", "train.sft_steps=2",
                             "train.sft_batch_size=12"])
    with pytest.raises(ConfigError, match=r"^train\.sft_batch_size: 12 rows do not split over data x fsdp = 8 "):
        run_mesh_checked(cfg)
    assert dict(run_mesh_checked(cfg.replace(**{"train.sft_steps": 0})).shape) == {"data": 8, "fsdp": 1, "tensor": 1}
    assert dict(run_mesh_checked(cfg.replace(**{"train.sft_batch_size": 16})).shape)["data"] == 8
