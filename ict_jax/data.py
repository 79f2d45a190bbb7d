"""Datasets, prompt templates and fixed-shape prompt batches.

    ds = load_dataset("gsm8k", data_dir="data", split="train")          # Dataset of Example
    enc = encode_prompts(ds, tokenizer, template="qwen_chat", max_prompt_len=512)
    it = PromptIterator(enc, batch_size=8, seed=0)                      # endless, reshuffled each epoch
    batch = next(it)          # PromptBatch: ids/mask [B, L] int32 left-padded, L a length bucket
    state = it.state_dict()   # {"epoch", "position", "seed"} -> it.load_state_dict(state) on resume

``Dataset.scorer`` says how a response is checked: "math" (last \\boxed{} vs the gold, math-verify),
"gsm8k" (numeric gold from "#### n"), "mc" (one letter), "gym" (reasoning-gym's scorer on
``meta["gym_entry"]``, see ``gym_score``), "exact" (the stripped response equals the gold; ``arith``),
"sum" (``x+y``, two positive integers adding up to the gold; ``split``).
Sources, file names and field mappings: docs/data.md.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .data_sources import (DataError, Example, arith_examples, examples_from_files, find_files, gym_examples,
                           gym_score, parse_aime, parse_gpqa, parse_gsm8k, parse_math, parse_mmlu, split_examples,
                           tfds_examples)

__all__ = ["DataError", "Example", "Dataset", "load_dataset", "DATASETS", "PAPER_BENCHMARKS", "TEMPLATES",
           "BOXED_INSTRUCTION", "MC_INSTRUCTION", "format_prompt", "EncodedPrompts", "encode_prompts",
           "make_buckets", "bucket_for", "pad_left", "PromptBatch", "PromptIterator", "gym_score"]

log = logging.getLogger(__name__)

SCORERS = ("math", "gsm8k", "mc", "gym", "exact", "sum")
TEMPLATES = ("qwen_chat", "plain", "none")
BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
MC_INSTRUCTION = "Please reason step by step, and put the letter of the correct option within \\boxed{}."
# The paper's seven benchmarks (METHOD §6), as load_dataset names.
PAPER_BENCHMARKS = ("math500", "gsm8k_test", "mmlu_stem", "gpqa_diamond", "aime2023", "aime2024", "aime2025")


class Dataset(Sequence[Example]):
    """A named, scored list of Examples (``len``, indexing, iteration)."""

    def __init__(self, name: str, examples: Sequence[Example], scorer: str, split: str | None = None):
        if scorer not in SCORERS:
            raise ValueError(f"scorer must be one of {SCORERS}, got {scorer!r}")
        self.name, self.scorer, self.split = name, scorer, split
        self.examples = list(examples)

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return Dataset(self.name, self.examples[i], self.scorer, self.split)
        return self.examples[i]

    def __iter__(self) -> Iterator[Example]:
        return iter(self.examples)

    def shuffled(self, seed: int) -> Dataset:
        order = np.random.default_rng(seed).permutation(len(self.examples))
        return Dataset(self.name, [self.examples[i] for i in order], self.scorer, self.split)

    def __repr__(self) -> str:
        return f"Dataset({self.name!r}, split={self.split!r}, scorer={self.scorer!r}, n={len(self)})"


# --------------------------------------------------------------------------------------------------
# The registry: name -> (subdirectories under data_dir, default split, parser, scorer, extra file names)
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _FileSource:
    subdirs: tuple[str, ...]
    split: str
    parser: Any
    scorer: str
    extra: tuple[str, ...] = ()
    options: tuple[tuple[str, Any], ...] = ()


DATASETS: dict[str, _FileSource] = {
    "gsm8k": _FileSource(("gsm8k",), "train", parse_gsm8k, "gsm8k"),
    "gsm8k_test": _FileSource(("gsm8k",), "test", parse_gsm8k, "gsm8k"),
    "math": _FileSource(("math",), "train", parse_math, "math"),
    "math500": _FileSource(("math500",), "test", parse_math, "math"),
    "mmlu_stem": _FileSource(("mmlu_stem", "mmlu"), "test", parse_mmlu, "mc"),
    "gpqa_diamond": _FileSource(("gpqa_diamond",), "train", parse_gpqa, "mc", ("gpqa_diamond.csv",)),
    **{f"aime{y}": _FileSource((f"aime{y}", "aime"), "test", parse_aime, "math", options=(("year", y),))
       for y in (2023, 2024, 2025)},
}
# Built-in and procedural names: "arith", "split", "gym:<reasoning-gym name>", "tfds:<builder name>".


def _parse_value(text: str) -> Any:
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def parse_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``"gym:chain_sum?size=200&seed=3"`` -> ``("gym:chain_sum", {"size": 200, "seed": 3})``."""
    name, _, query = spec.partition("?")
    options = {}
    for part in filter(None, query.split("&")):
        key, eq, value = part.partition("=")
        if not eq or not key:
            raise ValueError(f"dataset spec {spec!r}: options are key=value pairs joined by '&'")
        options[key.strip()] = _parse_value(value.strip())
    return name.strip(), options


def load_dataset(name: str, *, data_dir: str | None = None, split: str | None = None, seed: int = 0,
                 limit: int | None = None, **options: Any) -> Dataset:
    """A dataset by name (``DATASETS``, ``arith``, ``gym:NAME``, ``tfds:NAME``; ``name?k=v&k=v`` sets
    options). ``seed`` drives procedural generation and GPQA's option order; ``limit`` keeps the first N.

    Options: ``arith``: size (1000), digits (3), ops ("+-"), allow_negative (False), scratchpad (False,
    ``ops="+"`` only: the column-by-column working then the sum); ``split``: size (1000), digits (3);
    ``gym:NAME``: size (1000), seed, and the generator's own config keys; ``mmlu_stem``: stem_only (True).
    """
    base, spec_options = parse_spec(name)
    options = {**spec_options, **options}
    seed = int(options.pop("seed", seed))
    if base == "arith":
        ds = Dataset(base, arith_examples(seed=seed, source=base, size=int(options.pop("size", 1000)), **options),
                     "exact", split)
    elif base == "split":
        ds = Dataset(base, split_examples(seed=seed, source=base, size=int(options.pop("size", 1000)), **options),
                     "sum", split)
    elif base.startswith("gym:"):
        gym_name = base[4:]
        size = int(options.pop("size", 1000))
        ds = Dataset(base, gym_examples(gym_name, size=size, seed=seed, source=base, **options), "gym", split)
    elif base.startswith("tfds:"):
        split = split or "train"
        ds = Dataset(base, tfds_examples(base[5:], data_dir=data_dir, split=split, source=base), "gsm8k", split)
    elif base in DATASETS:
        src = DATASETS[base]
        split = split or src.split
        files, last_error = None, None
        for sub in src.subdirs:
            try:
                files = find_files(data_dir, sub, split, src.extra)
                break
            except FileNotFoundError as e:
                last_error = e
        if files is None:
            raise FileNotFoundError(f"{base}: {last_error}") from None
        opts = {**dict(src.options), "seed": seed, **options}
        ds = Dataset(base, examples_from_files(files, src.parser, base, **opts), src.scorer, split)
    else:
        raise ValueError(f"unknown dataset {base!r}: expected one of {sorted(DATASETS)}, 'arith', 'split', "
                         "'gym:<reasoning-gym name>' or 'tfds:<builder>'")
    return ds[:limit] if limit is not None else ds


# --------------------------------------------------------------------------------------------------
# Templates and tokenisation
# --------------------------------------------------------------------------------------------------
def format_prompt(question: str, template: str = "qwen_chat", tokenizer: Any = None, *,
                  instruction: str = BOXED_INSTRUCTION) -> str:
    """The text the model sees.

    ``qwen_chat``: one user turn ``"{question}\\n{instruction}"`` through the tokenizer's chat template
    (Qwen2.5's ``QWEN2P5_CHAT_TEMPLATE`` when the tokenizer has none, or no tokenizer is given), with
    the generation prompt. ``plain`` (base models): ``"Question: {question}\\n{instruction}\\nAnswer:"``.
    ``none``: the question as is.
    """
    if template == "none":
        return question
    if template == "plain":
        return f"Question: {question}\n{instruction}\nAnswer:"
    if template == "qwen_chat":
        messages = [{"role": "user", "content": f"{question}\n{instruction}"}]
        from .tokenizer import QWEN2P5_CHAT_TEMPLATE, HFTokenizer, render_chat_template

        if tokenizer is None or isinstance(tokenizer, HFTokenizer) and tokenizer.chat_template is None:
            return render_chat_template(QWEN2P5_CHAT_TEMPLATE, messages)
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    raise ValueError(f"template must be one of {TEMPLATES}, got {template!r}")


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
    dropped: int  # prompts longer than max_prompt_len
    dropped_indices: list[int]  # their positions in the dataset

    def __len__(self) -> int:
        return len(self.examples)


def encode_prompts(dataset: Dataset, tokenizer: Any, *, template: str = "qwen_chat", max_prompt_len: int = 512,
                   instruction: str | None = None) -> EncodedPrompts:
    """Template and tokenise every example. Prompts longer than ``max_prompt_len`` tokens are dropped
    (never truncated) and counted in ``dropped`` (and logged). ``instruction`` defaults to
    ``MC_INSTRUCTION`` for multiple choice and ``BOXED_INSTRUCTION`` otherwise."""
    if max_prompt_len < 1:
        raise ValueError(f"max_prompt_len must be >= 1, got {max_prompt_len}")
    if instruction is None:
        instruction = MC_INSTRUCTION if dataset.scorer == "mc" else BOXED_INSTRUCTION
    examples, ids, texts, dropped = [], [], [], []
    for i, ex in enumerate(dataset):
        text = format_prompt(ex.prompt, template, tokenizer, instruction=instruction)
        tok = np.asarray(tokenizer.encode(text), dtype=np.int32)
        if len(tok) > max_prompt_len or len(tok) == 0:
            dropped.append(i)
            continue
        examples.append(ex)
        ids.append(tok)
        texts.append(text)
    if dropped:
        log.warning("%s: dropped %d of %d prompts longer than max_prompt_len=%d tokens", dataset.name,
                    len(dropped), len(dataset), max_prompt_len)
    return EncodedPrompts(dataset.name, dataset.scorer, examples, ids, texts, int(tokenizer.pad_id),
                          max_prompt_len, len(dropped), dropped)


def make_buckets(max_len: int, smallest: int = 32) -> tuple[int, ...]:
    """Powers of two from ``smallest`` below ``max_len``, then ``max_len``: one compiled shape each."""
    buckets, b = [], smallest
    while b < max_len:
        buckets.append(b)
        b *= 2
    return (*buckets, max_len)


def bucket_for(length: int, buckets: Sequence[int]) -> int:
    for b in sorted(buckets):
        if length <= b:
            return b
    raise ValueError(f"length {length} exceeds the largest bucket {max(buckets)}")


def pad_left(seqs: Sequence[np.ndarray], length: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """``ids, mask`` of shape ``[B, length]`` int32: each sequence right-aligned, ``mask`` 1 on tokens."""
    ids = np.full((len(seqs), length), pad_id, dtype=np.int32)
    mask = np.zeros((len(seqs), length), dtype=np.int32)
    for r, s in enumerate(seqs):
        if len(s) > length:
            raise ValueError(f"sequence of length {len(s)} does not fit in {length}")
        if len(s):
            ids[r, length - len(s):] = s
            mask[r, length - len(s):] = 1
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
    """Batches of ``batch_size`` prompts, shuffled per epoch by ``default_rng([seed, epoch])``.

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
            order = np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)
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
