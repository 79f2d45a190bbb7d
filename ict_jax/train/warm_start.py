"""The SFT warm start as a phase of the run, and the switch to RL.

``train.sft_steps`` supervised steps on the training prompts' targets (``rewards.checks.sft_target``),
run by the run's one loop (``train.phase.run_phase``, through ``Trainer.sft``) as the phase
:func:`sft_phase` builds: its step is the run's ``sft`` program (``train.programs``, compiled and checked
by the memory pre-flight like the others), its checkpoints go to ``<run_dir>/checkpoints_sft`` (every
``train.sft_save_every`` steps and on Ctrl-C, ``train.hooks.save_checkpoint``); a resumed run continues
from the last one (:func:`resume_sft`). Step s trains on the batch drawn by the SFT-order stream at s
(``ict_jax.rng.numpy_rng(seed, SFT_ORDER_STREAM, s)``): nothing is replayed on resume. The finished warm
start is saved as ``<run_dir>/sft_model`` (a Hugging Face directory), from which a resumed run starts RL
instead of training again.

During SFT the only optimizer state alive is SFT's (the state ``train.parts.build_parts`` starts such a
run with, :func:`sft_state` otherwise). When SFT ends its state is dropped and RL starts from the
warm-started policy with a fresh RL optimizer state, and the KL reference is that policy
(:func:`start_rl`). With LoRA (``model.lora.enabled``) the warm start trains adapters; RL then starts
from the base with those adapters merged into it (the ``sft_model``) and fresh adapters, so that the KL
reference (the base with the adapters off) is the warm-started policy here too (docs/lora.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
from typing import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ict_jax.model.adapters import attach_lora, merge_adapters
from ict_jax.model.qwen2 import Qwen2
from ict_jax.model.weights import save_hf
from ict_jax.rewards.checks import sft_target
from ict_jax.rl.sft import sft_arrays
from ict_jax.rl.state import TrainState, check_lora_state, init_opt_state, init_train_state, reference_params
from ict_jax.rng import SFT_ORDER_STREAM, numpy_rng
from ict_jax.sharding import to_host
from ict_jax.train.checkpoints import Checkpointer
from ict_jax.train.hooks import Hook, Hooks, checkpoint_health, save_checkpoint
from ict_jax.train.logs import metrics_to_floats
from ict_jax.train.model_source import resolve_model
from ict_jax.train.parts import RunParts
from ict_jax.train.phase import Phase, PhaseEnd
from ict_jax.train.programs import has_reference, reference_dtype
from ict_jax.train.record import SFT_MODEL
from ict_jax.train.resume import SFT_CHECKPOINTS

#: ``(phase, state, first step) -> how it ended``: the run's loop (``Trainer.run_phase``)
RunPhase = Callable[[Phase, TrainState, int], PhaseEnd]

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


def sft_state(parts: RunParts, state: TrainState) -> TrainState:
    """The SFT state from a train state: its parameters with the SFT optimizer's fresh state (what
    ``train.parts.build_parts`` starts a run with SFT ahead with). ``state``'s own optimizer state is not
    kept: drop ``state`` so that only one optimizer state stays alive."""
    return state.replace(opt_state=init_opt_state(parts.programs.optimizers.sft, state.params))


@contextlib.contextmanager
def sft_phase(parts: RunParts, hooks: Sequence[tuple[Hook, int]] = ()) -> Iterator[Phase]:
    """The SFT warm start as a :class:`~ict_jax.train.phase.Phase` of ``train.sft_steps`` steps, while the
    block runs (its checkpointer, ``<run_dir>/checkpoints_sft``, is closed after it): each step one call
    of the run's ``sft`` program on :func:`sft_batch`; the hooks: the check of background saves, the
    checkpoint cadence (``train.sft_save_every``, Ctrl-C; ``train.hooks.save_checkpoint``), then
    ``hooks`` (``(fn, every)``, the user's, ``Trainer.add_hook(..., phase="sft")``)."""
    cfg, program = parts.config, parts.programs.sft
    data = sft_data(parts)

    def step(state: TrainState, s: int) -> tuple[TrainState, dict[str, float]]:
        state, metrics = program(state, *sft_batch(parts, data, s))
        return state, metrics_to_floats(metrics)

    with Checkpointer(parts.run_dir / SFT_CHECKPOINTS, keep=cfg.train.keep) as ckpt:
        phase_hooks = Hooks()
        phase_hooks.add(checkpoint_health(ckpt))
        phase_hooks.add(save_checkpoint(parts, "sft", ckpt))
        for fn, every in hooks:
            phase_hooks.add(fn, every)
        yield Phase("sft", "SFT", cfg.train.sft_steps, step, ckpt, phase_hooks,
                    resuming="resuming the SFT warm start at step {start}/{steps}")


def resume_sft(parts: RunParts, phase: Phase, state: TrainState, *, resume: bool) -> tuple[TrainState, int]:
    """``(state, first step)`` of the SFT phase: with ``resume``, the last checkpoint in
    ``<run_dir>/checkpoints_sft`` restored into ``state`` (a LoRA run's base was checked against it,
    ``train.parts``), else ``state`` from step 0."""
    check_lora_state(parts.config, state)
    start = phase.checkpointer.latest_step() if resume else None
    if start is None:
        return state, 0
    state, _ = phase.checkpointer.restore(state)
    return state, start


def run_warm_start(parts: RunParts, state: TrainState, run: RunPhase, *, resume: bool,
                   hooks: Sequence[tuple[Hook, int]] = ()) -> tuple[Qwen2, dict[str, float]]:
    """SFT from the SFT ``state`` as a phase of the run's loop, ``run(phase, state, start)``
    (``Trainer.run_phase``, ``train.phase.run_phase``), resumed from its last checkpoint with ``resume``:
    ``(the warm-started model, the last SFT step's metrics)``. The SFT state is not kept: once the caller
    drops its own reference, the SFT optimizer's state is gone and RL's may be built (:func:`start_rl`)."""
    with sft_phase(parts, hooks) as phase:
        state, start = resume_sft(parts, phase, state, resume=resume)
        end = run(phase, state, start)
    return end.state.model(), end.last


def start_rl(parts: RunParts, model: Qwen2) -> tuple[TrainState, nnx.State | None]:
    """(train state, KL reference or None) of RL starting from ``model`` (the warm start) with a fresh RL
    optimizer state; the reference is the warm-started policy. A model with LoRA adapters has them merged
    into its base first; a LoRA run then trains fresh adapters on that base (its KL reference). Call it
    once the SFT state is dropped: the RL optimizer state is allocated here."""
    if model.config.lora is not None:
        model = merge_adapters(model)
    state = init_train_state(parts.config, attach_lora(model, parts.config.model.lora, parts.config.seed),
                             tx=parts.programs.optimizers.rl)
    ref = reference_params(state, reference_dtype(model.config)) if has_reference(parts.config, state) else None
    return state, ref


def load_warm_start(parts: RunParts) -> tuple[TrainState, nnx.State | None]:
    """(train state, KL reference or None) of RL starting from a finished warm start,
    ``<run_dir>/sft_model`` (:func:`start_rl`)."""
    cfg = parts.config
    model = resolve_model(cfg, weights=parts.run_dir / SFT_MODEL, adapters=False).load(mesh=parts.mesh)
    return start_rl(parts, model)


def save_warm_start(parts: RunParts, state: TrainState) -> None:
    """``<run_dir>/sft_model`` from the RL start state (every process joins the gather; the first writes);
    the SFT checkpoints (with their Adam moments) are not needed once it exists."""
    if (parts.run_dir / SFT_MODEL).exists():
        return
    host = nnx.merge(state.graphdef, to_host(state.model_state()))
    if jax.process_index() == 0:  # a LoRA state's fresh adapters (B = 0) merge into its base exactly
        save_hf(merge_adapters(host), parts.run_dir / SFT_MODEL)
        shutil.rmtree(parts.run_dir / SFT_CHECKPOINTS, ignore_errors=True)
