"""A run's training prompts: every dataset of ``data.train`` templated and tokenised through the prompt
front door (``data.prompts.encode_prompts``) and concatenated, each prompt keeping its dataset's scorer."""

from __future__ import annotations

import dataclasses
from typing import Sequence

from ict_jax.config import Config
from ict_jax.data.datasets import Dataset
from ict_jax.data.prompts import EncodedPrompts, encode_prompts
from ict_jax.model.tokenizers import Tokenizer


@dataclasses.dataclass(frozen=True)
class TrainingPrompts:
    """Encoded training prompts of all training datasets, with each prompt's scorer kind."""

    encoded: EncodedPrompts
    kinds: tuple[str, ...]


def encode_training_data(cfg: Config, tokenizer: Tokenizer, datasets: Sequence[Dataset],
                         max_positions: int | None = None) -> TrainingPrompts:
    """Template and tokenise every training dataset (``data.train``) and concatenate them; each prompt
    keeps its dataset's scorer kind. Prompts that with ``rollout.max_new_tokens`` pass ``max_positions``
    (the model's ``max_position_embeddings``) are dropped and counted, as over-long ones are."""
    parts = [encode_prompts(ds, tokenizer, template=cfg.data.template, max_prompt_len=cfg.rollout.max_prompt_len,
                            max_new_tokens=cfg.rollout.max_new_tokens, max_positions=max_positions)
             for ds in datasets]
    if len(parts) == 1:
        return TrainingPrompts(parts[0], (parts[0].scorer,) * len(parts[0]))
    fields = {f.name for f in dataclasses.fields(EncodedPrompts)}
    merged = dict(name="+".join(p.name for p in parts), scorer="mixed",
                  examples=[e for p in parts for e in p.examples], ids=[i for p in parts for i in p.ids],
                  texts=[t for p in parts for t in p.texts], pad_id=parts[0].pad_id,
                  max_prompt_len=cfg.rollout.max_prompt_len, dropped=sum(p.dropped for p in parts),
                  dropped_positions=sum(p.dropped_positions for p in parts),
                  dropped_indices=[])
    return TrainingPrompts(EncodedPrompts(**{k: v for k, v in merged.items() if k in fields}),
                           tuple(p.scorer for p in parts for _ in range(len(p))))
