"""train/warm_start.py: the SFT warm start, a phase of the run's one loop. The former entry points
(``run_sft``, ``warm_start``) still work, with a DeprecationWarning, and train exactly what the trainer's
warm start trains. (The warm start's live arrays: tests/train/test_trainer.py; its checkpoints, Ctrl-C and
bitwise resume: tests/train/test_record.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from ict_jax.config import load_config

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "configs" / "demo.yaml"
TINY = ["model.preset=tiny", "rollout.num_samples=4", "train.prompts_per_step=4", "rollout.max_new_tokens=6",
        "rollout.max_prompt_len=16", "train.sft_steps=3", "train.sft_batch_size=8", "train.sft_save_every=2",
        "train.steps=1", "data.train=[\"arith?digits=1&size=64\"]", "data.eval=[]", "stats.chunk=8",
        "rl.reward.workers=1", "rl.loss.kl_coef=0.01", "mesh.data=-1", "mesh.tensor=2"]


@pytest.mark.parametrize("name", ["run_sft", "warm_start"])
def test_the_former_entry_points_warn_first_naming_the_trainer_and_the_removal(name):
    """The warning comes before any work (here: none, the run's parts are missing)."""
    import ict_jax.train.warm_start as ws

    text = (f"ict_jax.train.warm_start.{name} is deprecated and will be removed in ict_jax 0.3.0: use "
            "ict_jax.Trainer.sft (the warm start as a phase of the run's loop, ict_jax.train.phase.run_phase)")
    with pytest.warns(DeprecationWarning) as caught, pytest.raises(AttributeError):
        getattr(ws, name)(None, None, None, resume=False)
    assert [str(w.message) for w in caught] == [text] and caught[0].filename == __file__


@pytest.mark.e2e  # two tiny warm starts (~20 s on 2 cores)
def test_the_former_warm_start_function_warns_and_trains_what_the_trainer_trains(tmp_path, devices8):
    from safetensors.numpy import load_file

    from ict_jax.train.parts import build_parts
    from ict_jax.train.trainer import Trainer
    from ict_jax.train.warm_start import warm_start

    with Trainer(load_config(DEMO, TINY + [f"run_dir={tmp_path / 'a'}"]), progress=False, rl=False) as t:
        last = t.sft()
        assert t.phase == "rl" and t.ref_params is not None  # RL's state and reference, built when SFT ended
    parts, state, ref = build_parts(load_config(DEMO, TINY + [f"run_dir={tmp_path / 'b'}"]), progress=False,
                                    preflight=False)
    try:
        assert parts.sft_ahead and ref is None

        def start_logger(phase, total, initial=0):
            parts.logger.start(phase, total, initial)
            return parts.logger

        with pytest.warns(DeprecationWarning, match="use ict_jax.Trainer.sft"):
            rl_state, ref, former = warm_start(parts, state, start_logger, resume=False)
    finally:
        parts.close()
    assert ref is not None and int(rl_state.step) == 0 and former == last
    a, b = (load_file(tmp_path / d / "sft_model" / "model.safetensors") for d in ("a", "b"))
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    assert not (tmp_path / "b" / "checkpoints_sft").exists()  # its checkpoint at step 2, gone with the sft_model
