"""Tokenised prompts and fixed-shape prompt batches.

    one = encode_prompt("What is 2+3?", tokenizer, template="qwen_chat", max_len=512)   # the front door
    one.text, one.ids                                                                  # str, int32 ids
    enc = encode_prompts(ds, tokenizer, template="qwen_chat", max_prompt_len=512)
    it = PromptIterator(enc, batch_size=8, seed=0)                      # endless, reshuffled each epoch
    batch = next(it)          # PromptBatch: ids/mask [B, L] int32 left-padded, L a length bucket
    state = it.state_dict()   # {"epoch", "position", "seed"} -> it.load_state_dict(state) on resume
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ict_jax.buckets import bucket_for, make_buckets
from ict_jax.data.datasets import Dataset
from ict_jax.data.example import DataError, Example
from ict_jax.data.templates import BOXED_INSTRUCTION, format_prompt, instruction_for
from ict_jax.model.tokenizers import UnknownCharacterError
from ict_jax.rng import DATA_ORDER_STREAM, numpy_rng

log = logging.getLogger(__name__)


class PromptRefused(ValueError):
    """A prompt :func:`encode_prompt` refuses (one line): longer than the limit after templating (never
    truncated), encoding to no token, or holding an id the model's vocabulary lacks."""


class PromptTooLong(PromptRefused):
    """A prompt plus the tokens to be generated after it exceeds the model's position limit
    (``max_position_embeddings``): the positions past it were never trained (RoPE) and the output is
    garbage. The message is one line naming the prompt, the counts and the limit."""


def prompt_fits(n_prompt_tokens: int, max_new_tokens: int, max_positions: int | None) -> bool:
    """Whether a prompt of ``n_prompt_tokens`` tokens followed by up to ``max_new_tokens`` generated ones
    stays within ``max_positions`` (a model's ``max_position_embeddings``; None = no limit). A left-padded
    prompt's positions start at 0 whatever its padding, so only its own length counts."""
    return max_positions is None or int(n_prompt_tokens) + int(max_new_tokens) <= int(max_positions)


def check_prompt_fits(n_prompt_tokens: int, max_new_tokens: int, max_positions: int | None, *,
                      where: str = "the prompt") -> None:
    """Raise :class:`PromptTooLong` (one line naming ``where``) unless :func:`prompt_fits`. The one check
    behind ``ict-jax sample``, ``eval``, ``inspect``, ``diagnose`` and the training data filter."""
    if not prompt_fits(n_prompt_tokens, max_new_tokens, max_positions):
        raise PromptTooLong(
            f"{where} is {int(n_prompt_tokens)} tokens; with {int(max_new_tokens)} new tokens that is "
            f"{int(n_prompt_tokens) + int(max_new_tokens)} positions, more than the model's "
            f"max_position_embeddings={int(max_positions)} (shorten the prompt or lower max_new_tokens)")


@dataclass(frozen=True)
class EncodedPrompt:
    """One prompt as the model sees it: the templated ``text`` and its token ``ids`` (int32)."""

    text: str
    ids: np.ndarray


def encode_prompt(question: str, tokenizer: Any, *, template: str = "qwen_chat", instruction: str = BOXED_INSTRUCTION,
                  max_len: int | None = None, vocab_size: int | None = None,
                  limit_key: str = "rollout.max_prompt_len", max_new_tokens: int = 0,
                  max_positions: int | None = None, where: str = "the prompt") -> EncodedPrompt:
    """The one prompt front door (training data, evaluation, the inspector, diagnose, ``ict-jax sample``):
    template (:func:`ict_jax.data.templates.format_prompt`: ``template``, ``instruction``; ``""`` = no
    instruction), tokenise (``tokenizer.encode``), check.

    Raises :class:`PromptRefused` (one line) when the prompt is longer than ``max_len`` tokens (None = no
    limit; the message says by how much and names the limit's config key ``limit_key``), encodes to zero
    tokens, or holds an id ``>= vocab_size`` (None = not checked); :class:`PromptTooLong` (a
    :class:`PromptRefused`) when it and ``max_new_tokens`` generated tokens exceed ``max_positions`` (the
    model's ``max_position_embeddings``; None = not checked; :func:`check_prompt_fits`, naming ``where``).
    A character the tokenizer cannot represent raises its
    :class:`~ict_jax.model.tokenizers.UnknownCharacterError`."""
    text = format_prompt(question, template, tokenizer, instruction=instruction)
    ids = np.asarray(tokenizer.encode(text), dtype=np.int32)
    n = len(ids)
    if n == 0:
        raise PromptRefused(f"the prompt encodes to zero tokens (template {template!r})")
    if max_len is not None and n > max_len:
        raise PromptRefused(f"the prompt is {n} tokens after templating, {n - max_len} more than "
                            f"{limit_key}={max_len} (prompts are never truncated)")
    if vocab_size is not None and int(ids.max()) >= vocab_size:
        raise PromptRefused(f"the prompt has token id {int(ids.max())} but the model's vocabulary has {vocab_size} ids")
    check_prompt_fits(n, max_new_tokens, max_positions, where=where)
    return EncodedPrompt(text, ids)


@dataclass
class EncodedPrompts:
    """Token ids of a dataset's prompts (over-long ones dropped and counted)."""

    name: str
    scorer: str
    examples: list[Example]
    ids: list[np.ndarray]  # int32, one per kept example
    texts: list[str]  # the templated prompt texts
    pad_id: int
    max_prompt_len: int
    dropped: int  # prompts longer than max_prompt_len, or (with max_positions) that leave no room to answer
    dropped_indices: list[int]  # their positions in the dataset
    dropped_positions: int = 0  # of ``dropped``: prompt + max_new_tokens over the model's max_positions

    def __len__(self) -> int:
        return len(self.examples)


def encode_prompts(dataset: Dataset, tokenizer: Any, *, template: str = "qwen_chat", max_prompt_len: int = 512,
                   instruction: str | None = None, max_new_tokens: int = 0,
                   max_positions: int | None = None) -> EncodedPrompts:
    """Template and tokenise every example (:func:`encode_prompt`). Prompts longer than ``max_prompt_len``
    tokens (or of no token) are dropped (never truncated) and counted in ``dropped`` (and logged); so are
    prompts that, with ``max_new_tokens`` generated after them, exceed ``max_positions`` (the model's
    ``max_position_embeddings``; None = no such check), also counted in ``dropped_positions``.
    ``instruction`` defaults to the data set's (:func:`ict_jax.data.templates.instruction_for`).
    A character the tokenizer cannot represent is a :class:`~ict_jax.data.example.DataError` naming
    the data set and the example."""
    if max_prompt_len < 1:
        raise ValueError(f"rollout.max_prompt_len: {max_prompt_len} must be >= 1")
    if instruction is None:
        instruction = instruction_for(dataset.scorer)
    examples, ids, texts, dropped = [], [], [], []
    no_room = 0
    for i, ex in enumerate(dataset):
        try:
            one = encode_prompt(ex.prompt, tokenizer, template=template, instruction=instruction,
                                max_len=max_prompt_len, max_new_tokens=max_new_tokens, max_positions=max_positions)
        except UnknownCharacterError as e:
            raise DataError(f"{dataset.name} example {ex.meta.get('index', i)}: {e}") from None
        except PromptTooLong:
            dropped.append(i)
            no_room += 1
            continue
        except PromptRefused:
            dropped.append(i)
            continue
        examples.append(ex)
        ids.append(one.ids)
        texts.append(one.text)
    if len(dropped) > no_room:
        log.warning("%s: dropped %d of %d prompts longer than max_prompt_len=%d tokens", dataset.name,
                    len(dropped) - no_room, len(dataset), max_prompt_len)
    if no_room:
        log.warning("%s: dropped %d of %d prompts that with max_new_tokens=%d exceed the model's "
                    "max_position_embeddings=%d", dataset.name, no_room, len(dataset), max_new_tokens, max_positions)
    return EncodedPrompts(dataset.name, dataset.scorer, examples, ids, texts, int(tokenizer.pad_id),
                          max_prompt_len, len(dropped), dropped, no_room)


def pad_left(seqs: Sequence[np.ndarray] | np.ndarray, length: int, pad_id: int,
             masks: Sequence[np.ndarray] | np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Left padding, the one implementation: ``ids, mask`` of shape ``[B, length]`` int32, each of the B
    sequences right-aligned (its last token in the last column), ``pad_id`` / 0 before it.

    ``seqs`` are sequences of any lengths (``mask`` is then 1 on their tokens), or the rows of an array
    ``[B, L]`` that is already left-padded, with its ``masks`` ``[B, L]``: both are widened to ``length``
    (``masks[r]`` is copied, so the old padding stays padding)."""
    ids = np.full((len(seqs), length), pad_id, dtype=np.int32)
    mask = np.zeros((len(seqs), length), dtype=np.int32)
    for r, s in enumerate(seqs):
        if len(s) > length:
            raise ValueError(f"sequence of length {len(s)} does not fit in {length}")
        if len(s):
            ids[r, length - len(s):] = s
            mask[r, length - len(s):] = 1 if masks is None else masks[r]
    return ids, mask


@dataclass
class PromptBatch:
    """``ids``/``mask`` ``[B, L]`` int32, left-padded, ``L`` a bucket; ``valid[b]`` False for filler rows
    (copies of the last real row that complete the final batch of a pass); ``examples[b]`` the
    Example of row b (filler rows repeat it); ``indices[b]`` its position in the EncodedPrompts."""

    ids: np.ndarray
    mask: np.ndarray
    valid: np.ndarray
    examples: list[Example]
    indices: np.ndarray
    epoch: int

    @property
    def length(self) -> int:
        return self.ids.shape[1]


class PromptIterator:
    """Batches of ``batch_size`` prompts, shuffled per epoch by the data-order stream of ``seed``
    (``ict_jax.rng.numpy_rng(seed, DATA_ORDER_STREAM, epoch)``: no draw depends on an earlier one).

    ``epochs=None`` repeats forever (training); ``drop_last=True`` skips an epoch's incomplete tail,
    ``False`` fills it with ``valid=False`` rows (evaluation: ``shuffle=False, epochs=1,
    drop_last=False``). ``state_dict()`` / ``load_state_dict()`` save and restore the position.
    """

    def __init__(self, prompts: EncodedPrompts, batch_size: int, *, seed: int = 0, shuffle: bool = True,
                 epochs: int | None = None, drop_last: bool = True, buckets: Sequence[int] | None = None):
        n = len(prompts)
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if n == 0 or (drop_last and n < batch_size):
            raise ValueError(f"{prompts.name}: {n} prompts cannot fill a batch of {batch_size}")
        self.prompts, self.batch_size, self.seed = prompts, batch_size, seed
        self.shuffle, self.epochs, self.drop_last = shuffle, epochs, drop_last
        self.buckets = tuple(buckets) if buckets is not None else make_buckets(prompts.max_prompt_len)
        if max(self.buckets) < prompts.max_prompt_len:
            raise ValueError(f"largest bucket {max(self.buckets)} < max_prompt_len {prompts.max_prompt_len}")
        self.epoch, self.position = 0, 0
        self._cached_order: tuple[int, np.ndarray] = (-1, np.arange(0))

    def _order(self, epoch: int) -> np.ndarray:
        if self._cached_order[0] != epoch:
            n = len(self.prompts)
            order = numpy_rng(self.seed, DATA_ORDER_STREAM, epoch).permutation(n) if self.shuffle else np.arange(n)
            self._cached_order = (epoch, order)
        return self._cached_order[1]

    def __iter__(self) -> PromptIterator:
        return self

    def __next__(self) -> PromptBatch:
        n, bs = len(self.prompts), self.batch_size
        if self.position >= n or (self.drop_last and self.position + bs > n):
            self.epoch, self.position = self.epoch + 1, 0
        if self.epochs is not None and self.epoch >= self.epochs:
            raise StopIteration
        idx = self._order(self.epoch)[self.position:self.position + bs]
        self.position += len(idx)
        valid = np.ones(bs, dtype=bool)
        if len(idx) < bs:
            valid[len(idx):] = False
            idx = np.concatenate([idx, np.full(bs - len(idx), idx[-1])])
        seqs = [self.prompts.ids[i] for i in idx]
        length = bucket_for(max(len(s) for s in seqs), self.buckets)
        ids, mask = pad_left(seqs, length, self.prompts.pad_id)
        return PromptBatch(ids, mask, valid, [self.prompts.examples[i] for i in idx], idx.astype(np.int64),
                           self.epoch)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "size": len(self.prompts)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state.get("size", len(self.prompts)) != len(self.prompts) or state.get("seed", self.seed) != self.seed:
            raise ValueError(f"data state {state} is for a different dataset or seed "
                             f"(size {len(self.prompts)}, seed {self.seed})")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])

