"""The SFT warm start and the switch to RL.

``train.sft_steps`` supervised steps on the training prompts' targets (``rewards.checks.sft_target``),
with their own checkpoints (``<run_dir>/checkpoints_sft``, every ``train.sft_save_every`` steps and on
Ctrl-C); a resumed run continues from the last one. Step s trains on the batch drawn by the SFT-order
stream at s (``ict_jax.rng.numpy_rng(seed, SFT_ORDER_STREAM, s)``): nothing is replayed on resume. The
finished warm start is saved as ``<run_dir>/sft_model`` (a Hugging Face directory), from which a
resumed run starts RL instead of training again.

RL then starts from the warm-started policy with a fresh RL optimizer state, and the KL reference is
that policy (:func:`start_rl`). With LoRA (``model.lora.enabled``) the warm start trains adapters; RL then
starts from the base with those adapters merged into it (the ``sft_model``) and fresh adapters, so that
the KL reference (the base with the adapters off) is the warm-started policy here too (docs/lora.md).
"""

from __future__ import annotations

import dataclasses
import shutil
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ict_jax.model.adapters import merge_adapters
from ict_jax.model.qwen2 import Qwen2
from ict_jax.model.weights import load_hf, save_hf
from ict_jax.rewards.checks import sft_target
from ict_jax.rl.sft import make_sft_step, sft_arrays
from ict_jax.rl.state import TrainState, init_opt_state, init_train_state, reference_params
from ict_jax.rng import SFT_ORDER_STREAM, numpy_rng
from ict_jax.sharding import to_host
from ict_jax.train.checkpoints import Checkpointer
from ict_jax.train.stopping import Interrupted, stop_after_step
from ict_jax.train.logs import RunLogger, metrics_to_floats
from ict_jax.train.model_source import model_overrides, with_adapters
from ict_jax.train.parts import RunParts
from ict_jax.train.programs import has_reference, reference_dtype
from ict_jax.train.resume import SFT_CHECKPOINTS, SFT_MODEL

#: ``(phase, total steps, first step) -> the run's logger, started for the phase``
StartLogger = Callable[[str, int, int], RunLogger]


@dataclasses.dataclass(frozen=True)
class SftData:
    """The warm start's examples: prompt ids and target ids (the target's tokens and an EOS) of every
    training prompt whose target fits ``rollout.max_new_tokens`` (``keep``: their indices)."""

    prompt_ids: list[np.ndarray]
    targets: list[list[int]]
    keep: list[int]


def sft_data(parts: RunParts) -> SftData:
    enc, tok = parts.prompts.encoded, parts.tokenizer
    eos = tok.eos_ids[0]
    targets = [tok.encode(sft_target(ex, k)) + [eos] for ex, k in zip(enc.examples, parts.prompts.kinds)]
    t_len = parts.config.rollout.max_new_tokens
    keep = [i for i, t in enumerate(targets) if len(t) <= t_len]
    if not keep:
        raise ValueError(f"no SFT target fits in rollout.max_new_tokens={t_len}")
    return SftData(list(enc.ids), targets, keep)


def sft_batch(parts: RunParts, data: SftData, step: int) -> tuple[jax.Array, ...]:
    """(tokens, attention_mask, loss_mask) of SFT step ``step``: ``train.sft_batch_size`` examples drawn
    by the SFT-order stream at ``step`` (with replacement only when there are fewer examples)."""
    cfg = parts.config
    bs = cfg.train.sft_batch_size
    idx = numpy_rng(cfg.seed, SFT_ORDER_STREAM, step).choice(data.keep, size=bs, replace=len(data.keep) < bs)
    arrays = sft_arrays([data.prompt_ids[i] for i in idx], [data.targets[i] for i in idx],
                        prompt_len=cfg.rollout.max_prompt_len, target_len=cfg.rollout.max_new_tokens,
                        pad_id=parts.tokenizer.pad_id)
    return tuple(map(jnp.asarray, arrays))


def start_rl(parts: RunParts, model: Qwen2) -> tuple[TrainState, nnx.State | None]:
    """(train state, KL reference or None) of RL starting from ``model`` (the warm start) with a fresh RL
    optimizer state; the reference is the warm-started policy. A model with LoRA adapters has them merged
    into its base first; a LoRA run then trains fresh adapters on that base (its KL reference)."""
    if model.config.lora is not None:
        model = merge_adapters(model)
    state = init_train_state(parts.config, with_adapters(parts.config, model))
    ref = reference_params(state, reference_dtype(model.config)) if has_reference(parts.config, state) else None
    return state, ref


def run_sft(parts: RunParts, state: TrainState, start_logger: StartLogger, *, resume: bool
            ) -> tuple[TrainState, dict[str, float]]:
    """SFT from ``state``'s policy with a fresh SFT optimizer -> (the SFT state, the last step's metrics).
    ``resume``: continue from the last checkpoint in ``<run_dir>/checkpoints_sft``. Ctrl-C saves a
    checkpoint after the step in progress and raises :class:`Interrupted`."""
    cfg, steps = parts.config, parts.config.train.sft_steps
    sft = make_sft_step(cfg, parts.mesh)
    sft_state = TrainState(params=state.params, opt_state=init_opt_state(sft.tx, state.params), step=state.step,
                           rng=state.rng, graphdef=state.graphdef, frozen=state.frozen)
    data = sft_data(parts)
    meta = {"phase": "sft", "config": cfg.to_dict(), "model_config": dataclasses.asdict(parts.model_config),
            "tokenizer": parts.tokenizer_spec, **parts.base_meta("sft")}
    directory = parts.run_dir / SFT_CHECKPOINTS
    with Checkpointer(directory, keep=cfg.train.keep) as ckpt:
        start = ckpt.latest_step() if resume else None
        if start is not None:  # a LoRA run's base was checked against this checkpoint's (train.parts)
            sft_state, _ = ckpt.restore(sft_state)
        start = start or 0
        logger = start_logger("sft", steps, start)
        if start:
            logger.message(f"resuming the SFT warm start at step {start}/{steps}")
        last: dict[str, float] = {}
        with stop_after_step(logger.message) as stop:
            for s in range(start, steps):
                sft_state, m = sft(sft_state, *sft_batch(parts, data, s))
                last = metrics_to_floats(m)
                logger.log(s, last, phase="sft")
                done, every = s + 1, cfg.train.sft_save_every
                if done < steps and ((every and done % every == 0) or stop.requested):
                    ckpt.save(done, sft_state, meta)
                if stop.requested and done < steps:
                    ckpt.wait()
                    raise Interrupted(f"interrupted at SFT step {done}/{steps}; its checkpoint is in {directory}: "
                                      f"continue with --resume run_dir={cfg.run_dir}")
    return sft_state, last


def save_warm_start(parts: RunParts, state: TrainState) -> None:
    """``<run_dir>/sft_model`` from the RL start state (every process joins the gather; the first writes);
    the SFT checkpoints (with their Adam moments) are not needed once it exists."""
    if (parts.run_dir / SFT_MODEL).exists():
        return
    host = nnx.merge(state.graphdef, to_host(state.model_state()))
    if jax.process_index() == 0:  # a LoRA state's fresh adapters (B = 0) merge into its base exactly
        save_hf(merge_adapters(host), parts.run_dir / SFT_MODEL)
        shutil.rmtree(parts.run_dir / SFT_CHECKPOINTS, ignore_errors=True)


def warm_start(parts: RunParts, state: TrainState, start_logger: StartLogger, *, resume: bool
               ) -> tuple[TrainState, nnx.State | None, dict[str, float] | None]:
    """The warm start and the switch to RL: ``(RL start state, KL reference or None, the last SFT step's
    metrics)``; the metrics are None when a finished warm start (``<run_dir>/sft_model``) was loaded
    instead of trained."""
    cfg = parts.config
    sft_dir = parts.run_dir / SFT_MODEL
    if sft_dir.is_dir():  # finished before: the RL phase starts from it
        model = load_hf(sft_dir, mesh=parts.mesh, dtype=cfg.model.param_dtype, **model_overrides(cfg))
        return *start_rl(parts, model), None
    sft_state, last = run_sft(parts, state, start_logger, resume=resume)
    rl_state, ref = start_rl(parts, sft_state.model())
    save_warm_start(parts, rl_state)
    return rl_state, ref, last
