"""Datasets by name: the paper's benchmarks from local files, procedural tasks, reasoning-gym, tfds.

    ds = load_dataset("gsm8k", data_dir="data", split="train")          # Dataset of Example
    ds = load_dataset("split?digits=2&size=256")                          # a built-in task with options

``Dataset.scorer`` is the reward kind that checks a response (:func:`ict_jax.rewards.checks.reward_kinds`):
"math" (last \\boxed{} vs the gold, math-verify), "gsm8k" (numeric gold from "#### n"), "mc" (one
letter), "gym" (reasoning-gym's scorer on ``meta["gym_entry"]``), "exact" (the stripped response equals
the gold; ``arith``), "sum" (``x+y``, two positive integers adding up to the gold; ``split``).
Templating is :mod:`ict_jax.data.templates`, tokenising and batching :mod:`ict_jax.data.prompts`.
Sources, file names and field mappings: docs/data.md.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ict_jax.data.example import Example
from ict_jax.data.sources import (
    examples_from_files,
    find_files,
    gym_examples,
    parse_aime,
    parse_generic,
    parse_gpqa,
    parse_gsm8k,
    parse_math,
    parse_mmlu,
    tfds_examples,
)
from ict_jax.data.tasks import arith_examples, split_examples
from ict_jax.rewards.checks import CUSTOM_KIND, reward_kinds

log = logging.getLogger(__name__)

# The paper's seven benchmarks (docs/method.md §6), as load_dataset names.
PAPER_BENCHMARKS = ("math500", "gsm8k_test", "mmlu_stem", "gpqa_diamond", "aime2023", "aime2024", "aime2025")


class Dataset(Sequence[Example]):
    """A named, scored list of Examples (``len``, indexing, iteration)."""

    def __init__(self, name: str, examples: Sequence[Example], scorer: str, split: str | None = None):
        if scorer not in reward_kinds() + (CUSTOM_KIND,):
            raise ValueError(f"scorer must be one of {reward_kinds() + (CUSTOM_KIND,)}, got {scorer!r}")
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
# Built-in and procedural names: "arith", "split", "gym:<reasoning-gym name>", "tfds:<builder name>";
# a user's own file: "file:<path>?prompt=F&answer=F&reward=KIND" (load_file_task).
FILE_EXTENSIONS = (".jsonl", ".parquet", ".csv")


def load_file_task(path: str, *, data_dir: str | None, split: str | None, prompt: str = "prompt",
                   answer: str = "answer", reward: str = "math", choices: str | None = None,
                   **unknown: Any) -> Dataset:
    """A generic task from one JSONL / Parquet / CSV file: ``prompt`` and ``answer`` name the fields,
    ``reward`` the reward kind that checks a response (a registered one,
    :func:`~ict_jax.rewards.checks.reward_kinds`, a plugin's included, or ``custom`` = the config's
    ``rl.reward.fn``), ``choices`` optionally a list-of-options field (``mc``).
    ``path`` is absolute, or relative to ``data_dir`` (when the file is there), else to the working
    directory. A malformed row is a DataError naming the file and line (docs/data.md)."""
    if unknown:
        raise ValueError(f"file:{path}: unknown option(s) {', '.join(sorted(unknown))}; allowed: prompt, "
                         "answer, reward, choices")
    if reward not in reward_kinds() + (CUSTOM_KIND,):
        raise ValueError(f"file:{path}: reward={reward!r} is not a reward kind; allowed: "
                         f"{', '.join(reward_kinds() + (CUSTOM_KIND,))}")
    if not path.endswith(FILE_EXTENSIONS):
        raise ValueError(f"file:{path}: expected a {', '.join(FILE_EXTENSIONS)} file")
    found = path
    if not os.path.isabs(path) and data_dir and os.path.isfile(os.path.join(data_dir, path)):
        found = os.path.join(data_dir, path)
    if not os.path.isfile(found):
        where = f" (nor under data.data_dir {data_dir!r})" if data_dir and not os.path.isabs(path) else ""
        raise FileNotFoundError(f"file:{path}: no such file{where}")
    examples = examples_from_files([found], parse_generic, f"file:{path}", prompt=str(prompt), answer=str(answer),
                                   choices=None if choices is None else str(choices))
    return Dataset(f"file:{path}", examples, reward, split)


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
    ``ops="+"`` only: the column-by-column working then the sum); ``split``: size (1000), digits (3),
    force_x (False; true: the x-forced evaluation, ``"95=07+"`` -> ``"88"``, scorer exact);
    ``gym:NAME``: size (1000), seed, and the generator's own config keys; ``mmlu_stem``: stem_only (True).
    """
    base, spec_options = parse_spec(name)
    options = {**spec_options, **options}
    seed = int(options.pop("seed", seed))
    if base == "arith":
        ds = Dataset(base, arith_examples(seed=seed, source=base, size=int(options.pop("size", 1000)), **options),
                     "exact", split)
    elif base == "split":
        forced = options.get("force_x", False) is True
        ds = Dataset(base, split_examples(seed=seed, source=base, size=int(options.pop("size", 1000)), **options),
                     "exact" if forced else "sum", split)
    elif base.startswith("gym:"):
        gym_name = base[4:]
        size = int(options.pop("size", 1000))
        ds = Dataset(base, gym_examples(gym_name, size=size, seed=seed, source=base, **options), "gym", split)
    elif base.startswith("tfds:"):
        split = split or "train"
        ds = Dataset(base, tfds_examples(base[5:], data_dir=data_dir, split=split, source=base), "gsm8k", split)
    elif base.startswith("file:"):
        ds = load_file_task(base[5:], data_dir=data_dir, split=split, **options)
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
                         "'gym:<reasoning-gym name>', 'tfds:<builder>' or 'file:<path>'")
    return ds[:limit] if limit is not None else ds
