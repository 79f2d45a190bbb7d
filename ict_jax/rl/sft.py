"""Supervised warm start: token-level cross-entropy on (prompt, target) pairs.

Gives a small model a starting point before RL (so rewards are neither all 0 nor all 1). The loss goes
through :func:`ict_jax.stats_from_hidden` with ``compute=("logp",)``: like the RL step, it never holds
float32 ``[B, T, V]`` logits.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ict_jax.config import Config, StatsSection
from ict_jax.rl.state import TrainState, as_model_def, check_lora_state, make_optimizer
from ict_jax.rl.token_stats import stats_from_hidden
from ict_jax.sharding import batch_sharding

F32 = jnp.float32
_CHUNK = StatsSection().chunk  # stats.chunk's default: the largest block of positions of the log-probs


def sft_loss(params: Any, graphdef: Any, tokens: jax.Array, attention_mask: jax.Array, loss_mask: jax.Array, *,
             chunk: int = _CHUNK) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Mean negative log-likelihood of the tokens where ``loss_mask`` is 1.

    ``tokens [B, L]`` hold prompt (left-padded) then target (right-padded); ``loss_mask [B, L]`` marks
    the target tokens to learn (the EOS included). Position ``t`` predicts ``tokens[:, t]`` from the
    hidden state at ``t - 1``; the log-probs are those of softmax(logits) (temperature 1).
    """
    model = as_model_def(graphdef).merge(params)  # graphdef, or a ModelDef (LoRA: with the frozen base)
    h, targets = model.predicting_states(tokens, attention_mask)  # every position after the first
    w = loss_mask[:, 1:].astype(F32)
    stats = stats_from_hidden(h, model.unembedding(), targets, w, group_size=1, temperature=1.0,
                              chunk=min(chunk, h.shape[1]), compute=("logp",))
    n = jnp.maximum(w.sum(), 1.0)
    nll = -jnp.where(w > 0, stats.logp, 0.0).sum() / n
    return nll, {"sft/loss": nll, "sft/tokens": w.sum()}


def sft_step(state: TrainState, tokens: jax.Array, attention_mask: jax.Array, loss_mask: jax.Array, *,
             tx: Any, chunk: int = _CHUNK) -> tuple[TrainState, dict[str, jax.Array]]:
    """One SFT update (pure; jit it or use :func:`make_sft_step`): cross-entropy, then ``tx``."""
    (loss, metrics), grads = jax.value_and_grad(sft_loss, has_aux=True)(
        state.params, state.model_def(), tokens, attention_mask, loss_mask, chunk=chunk)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = dict(metrics, **{"sft/grad_norm": optax.tree.norm(grads)})
    return state.replace(params=params, opt_state=opt_state), metrics


def make_sft_optimizer(config: Config) -> Any:
    """AdamW at ``train.sft_lr`` (constant after a short warm-up), with the RL optimizer's clipping."""
    return make_optimizer(config, lr=config.train.sft_lr, total_updates=max(1, config.train.sft_steps))


def make_sft_step(config: Config, mesh: jax.sharding.Mesh | None = None, *, tx: Any = None
                  ) -> Callable[..., tuple[TrainState, dict]]:
    """``step(state, tokens, attention_mask, loss_mask) -> (state, metrics)``, jitted, state donated.
    The state's ``opt_state`` must come from the same ``tx`` (see :func:`sft_state`)."""
    tx = tx or make_sft_optimizer(config)
    chunk = config.stats.chunk
    fn = jax.jit(lambda s, t, a, m: sft_step(s, t, a, m, tx=tx, chunk=chunk), donate_argnums=(0,))

    def step(state: TrainState, tokens, attention_mask, loss_mask):
        check_lora_state(config, state)
        if mesh is None:
            return fn(state, tokens, attention_mask, loss_mask)
        rows = batch_sharding(mesh, 2)
        args = jax.device_put((tokens, attention_mask, loss_mask), rows)
        with jax.set_mesh(mesh):
            return fn(state, *args)

    step.tx = tx
    step.jitted = fn
    return step


def sft_arrays(prompt_ids: Sequence[Sequence[int]], target_ids: Sequence[Sequence[int]], *, prompt_len: int,
               target_len: int, pad_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Left-pad prompts to ``prompt_len`` and right-pad targets to ``target_len`` -> (tokens,
    attention_mask, loss_mask), each ``[B, prompt_len + target_len]``. Over-long inputs are an error,
    never silently truncated."""
    B = len(prompt_ids)
    L = prompt_len + target_len
    tokens = np.full((B, L), pad_id, np.int32)
    attn = np.zeros((B, L), np.int32)
    loss = np.zeros((B, L), np.int32)
    for i, (p, t) in enumerate(zip(prompt_ids, target_ids)):
        if len(p) > prompt_len or len(t) > target_len:
            raise ValueError(f"SFT example {i}: prompt {len(p)} / target {len(t)} tokens exceed "
                             f"{prompt_len} / {target_len}")
        tokens[i, prompt_len - len(p):prompt_len] = p
        attn[i, prompt_len - len(p):prompt_len] = 1
        tokens[i, prompt_len:prompt_len + len(t)] = t
        attn[i, prompt_len:prompt_len + len(t)] = 1
        loss[i, prompt_len:prompt_len + len(t)] = 1
    return tokens, attn, loss
