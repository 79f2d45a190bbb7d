"""Where examples come from: local JSONL / Parquet / CSV files in their public Hugging Face formats,
prepared tensorflow-datasets builders and reasoning-gym generators (the built-in procedural tasks are in
:mod:`ict_jax.data.tasks`).

Every reader yields ``(location, row)`` pairs; ``location`` ("file:LINE" for JSONL/CSV, "file: row N"
for Parquet, 0-based) goes into every ``DataError`` so a bad row can be found. Field mappings and file
names are documented in docs/data.md.
"""

from __future__ import annotations

import csv
import glob
import io
import json
import os
import random
from collections.abc import Callable, Iterator
from typing import Any

from ict_jax.data.example import DataError, Example
from ict_jax.data.extras import require
from ict_jax.rewards.checks import last_boxed


# --------------------------------------------------------------------------------------------------
# Row readers
# --------------------------------------------------------------------------------------------------
def read_text(path: str) -> str:
    """The file as UTF-8 text (a byte-order mark is dropped). Any other encoding is a :class:`DataError`
    naming the line and column of the first byte that is not UTF-8."""
    with open(path, "rb") as f:
        data = f.read()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise DataError(f"{path}:{line}: not UTF-8 text (byte 0x{data[e.start]:02x} at column {column}): save the "
                        "file as UTF-8") from None


def _json_row(line: str, loc: str) -> dict:
    text = line.rstrip("\r\n")
    try:
        row = json.loads(text)
    except json.JSONDecodeError as e:  # the column within this line (1-based), whatever json counts
        where = "at the end of the line" if e.pos >= len(text) else f"at column {e.pos + 1}"
        raise DataError(f"{loc}: invalid JSON ({e.msg} {where})") from None
    if not isinstance(row, dict):
        raise DataError(f"{loc}: expected a JSON object, got {type(row).__name__}")
    return row


def read_rows(path: str) -> Iterator[tuple[str, dict]]:
    """Rows of a ``.jsonl``, ``.parquet`` or ``.csv`` file as dicts, with their location."""
    if path.endswith(".jsonl"):
        # split on "\n" only: str.splitlines would also split inside strings at U+2028 and friends
        for lineno, line in enumerate(read_text(path).split("\n"), start=1):
            if line.strip():
                loc = f"{path}:{lineno}"
                yield loc, _json_row(line, loc)
    elif path.endswith(".parquet"):
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except Exception as e:  # pyarrow raises several types for a corrupt file
            raise DataError(f"{path}: cannot read Parquet file ({e})") from None
        for i, row in enumerate(table.to_pylist()):
            yield f"{path}: row {i}", row
    elif path.endswith(".csv"):
        reader = csv.DictReader(io.StringIO(read_text(path), newline=""))
        for row in reader:
            loc = f"{path}:{reader.line_num}"
            if None in row or any(v is None for v in row.values()):
                raise DataError(f"{loc}: wrong number of CSV fields")
            yield loc, row
    else:
        raise DataError(f"{path}: unsupported file type (expected .jsonl, .parquet or .csv)")


def get_field(row: dict, loc: str, *names: str, types: tuple[type, ...] = (str,), default: Any = ...) -> Any:
    """The first of ``names`` present in ``row`` and not null, type-checked (ints/floats given as str are
    kept). A required field that is there but null is named as such, not as missing."""
    for name in names:
        if name in row and row[name] is not None:
            value = row[name]
            if isinstance(value, bool) or not isinstance(value, types):
                raise DataError(f"{loc}: field {name!r} should be {'/'.join(t.__name__ for t in types)}, "
                                f"got {type(value).__name__}")
            return value
    if default is not ...:
        return default
    nulls = [n for n in names if n in row]
    if nulls:
        raise DataError(f"{loc}: field {nulls[0]!r} is null; expected {'/'.join(t.__name__ for t in types)}")
    raise DataError(f"{loc}: missing field {' or '.join(repr(n) for n in names)} (has {sorted(row)})")


def find_files(data_dir: str | None, subdir: str, split: str, extra: tuple[str, ...] = ()) -> list[str]:
    """``{data_dir}/{subdir}/{split}.{jsonl,parquet,csv}``, then Hugging Face shards
    ``{data_dir}/{subdir}/**/{split}-*.parquet``, then ``extra`` names under ``{data_dir}/{subdir}``."""
    if not data_dir:
        raise FileNotFoundError(f"dataset {subdir!r} needs data.data_dir, the folder of its files: see docs/data.md")
    root = os.path.join(data_dir, subdir)
    for ext in ("jsonl", "parquet", "csv"):
        p = os.path.join(root, f"{split}.{ext}")
        if os.path.isfile(p):
            return [p]
    shards = sorted(glob.glob(os.path.join(glob.escape(root), "**", f"{split}-*.parquet"), recursive=True))
    if shards:
        return shards
    for name in extra:
        p = os.path.join(root, name)
        if os.path.isfile(p):
            return [p]
    expected = [f"{split}.jsonl", f"{split}.parquet", f"{split}.csv", f"**/{split}-*.parquet", *extra]
    raise FileNotFoundError(f"no {subdir!r} files for split {split!r} under {root}: expected one of {expected} "
                            "(see docs/data.md)")


# --------------------------------------------------------------------------------------------------
# Row -> Example parsers (one per public format). They return None to skip a row (filters).
# --------------------------------------------------------------------------------------------------


def parse_gsm8k(row: dict, loc: str, index: int, **_: Any) -> Example:
    question = get_field(row, loc, "question")
    solution = get_field(row, loc, "answer")
    if "####" not in solution:
        raise DataError(f"{loc}: GSM8K 'answer' has no '#### <number>' line")
    gold = solution.rsplit("####", 1)[1].strip().replace(",", "")
    if not gold:
        raise DataError(f"{loc}: GSM8K 'answer' has an empty '####' line")
    return Example(question, gold, {"solution": solution})


def parse_math(row: dict, loc: str, index: int, **_: Any) -> Example:
    """hendrycks MATH {problem, solution, level, type}; MATH-500 adds {answer, subject, unique_id}."""
    problem = get_field(row, loc, "problem")
    solution = get_field(row, loc, "solution", default="")
    answer = get_field(row, loc, "answer", types=(str, int), default=None)
    if answer is None:
        answer = last_boxed(solution)
        if answer is None:
            raise DataError(f"{loc}: no 'answer' field and no \\boxed{{...}} in 'solution'")
    meta = {"solution": solution}
    for key in ("level", "type", "subject", "unique_id"):
        if key in row and row[key] is not None:
            meta[key] = row[key]
    return Example(problem, str(answer).strip(), meta)


LETTERS = "ABCDEFGHIJ"


def mc_prompt(question: str, choices: list[str]) -> str:
    return question.strip() + "\n\n" + "\n".join(f"{LETTERS[i]}. {c}" for i, c in enumerate(choices))


# hendrycks' category "STEM" (physics, chemistry, biology, computer science, math, engineering):
# 18 subjects, 3,018 test questions (anatomy is "health", not STEM).
MMLU_STEM_SUBJECTS = frozenset({
    "abstract_algebra", "astronomy", "college_biology", "college_chemistry", "college_computer_science",
    "college_mathematics", "college_physics", "computer_security", "conceptual_physics",
    "electrical_engineering", "elementary_mathematics", "high_school_biology", "high_school_chemistry",
    "high_school_computer_science", "high_school_mathematics", "high_school_physics", "high_school_statistics",
    "machine_learning"})


def parse_mmlu(row: dict, loc: str, index: int, *, stem_only: bool = True, **_: Any) -> Example | None:
    """cais/mmlu {question, subject, choices: list[str], answer: int 0..3 (or a letter)}."""
    question = get_field(row, loc, "question")
    subject = get_field(row, loc, "subject")
    if stem_only and subject not in MMLU_STEM_SUBJECTS:
        return None
    choices = get_field(row, loc, "choices", types=(list,))
    if not 2 <= len(choices) <= len(LETTERS) or not all(isinstance(c, str) for c in choices):
        raise DataError(f"{loc}: 'choices' must be 2..{len(LETTERS)} strings")
    answer = get_field(row, loc, "answer", types=(int, str))
    idx = LETTERS.find(answer.strip().upper()) if isinstance(answer, str) else answer
    if isinstance(answer, str) and len(answer.strip()) != 1:
        idx = -1
    if not 0 <= idx < len(choices):
        raise DataError(f"{loc}: 'answer' {answer!r} is not a valid choice index or letter")
    return Example(mc_prompt(question, choices), LETTERS[idx],
                   {"subject": subject, "choices": list(choices), "answer_index": idx})


def parse_gpqa(row: dict, loc: str, index: int, *, seed: int = 0, **_: Any) -> Example:
    """Idavidrein/gpqa {Question, Correct Answer, Incorrect Answer 1..3}; options shuffled by
    ``random.Random(f"{seed}:{index}")`` so the order is fixed for a seed and row."""
    question = get_field(row, loc, "Question")
    correct = get_field(row, loc, "Correct Answer").strip()
    options = [correct] + [get_field(row, loc, f"Incorrect Answer {k}").strip() for k in (1, 2, 3)]
    order = list(range(4))
    random.Random(f"{seed}:{index}").shuffle(order)
    choices = [options[k] for k in order]
    gold = order.index(0)
    meta = {"choices": choices, "answer_index": gold, "shuffle_seed": seed}
    for key in ("Subdomain", "High-level domain", "Record ID"):
        if isinstance(row.get(key), str):
            meta[key] = row[key]
    return Example(mc_prompt(question, choices), LETTERS[gold], meta)


def _row_year(row: dict) -> int | None:
    for key in ("year", "Year"):
        if isinstance(row.get(key), (int, str)) and str(row[key]).strip().isdigit():
            return int(row[key])
    for key in ("url", "ID", "id"):  # AIMO validation urls ".../2023_AIME_I_Problems/...", IDs "2024-I-1"
        value = row.get(key)
        if isinstance(value, str):
            for year in range(1983, 2100):
                if f"/{year}_AIME" in value or value.startswith(f"{year}-") or value.startswith(f"{year}_"):
                    return year
    return None


def parse_aime(row: dict, loc: str, index: int, *, year: int | None = None, **_: Any) -> Example | None:
    """AIME sets {problem|Problem|question|Question, answer|Answer}; rows of other years are skipped
    when the row says its year (year/Year field, AIMO url, '2024-I-1' style ID)."""
    if year is not None:
        row_year = _row_year(row)
        if row_year is not None and row_year != year:
            return None
    problem = get_field(row, loc, "problem", "Problem", "question", "Question")
    answer = get_field(row, loc, "answer", "Answer", types=(str, int))
    answer = str(answer).strip()
    if answer.isdigit():
        answer = str(int(answer))  # "033" -> "33"
    meta = {k: row[k] for k in ("id", "ID", "url", "problem_idx") if isinstance(row.get(k), (str, int))}
    if year is not None:
        meta["year"] = year
    return Example(problem, answer, meta)


def parse_generic(row: dict, loc: str, index: int, *, prompt: str = "prompt", answer: str = "answer",
                  choices: str | None = None, **_: Any) -> Example:
    """A row of a user's own task file (``file:PATH?prompt=F&answer=F&reward=KIND``): the field named by
    ``prompt`` -> prompt, by ``answer`` (a string or a number) -> the gold answer; with ``choices`` (the
    name of a list-of-strings field) the prompt is lettered as for MMLU and a 0-based index or a letter
    answer becomes the gold letter. Every other field goes to ``meta`` (a custom reward function
    receives it)."""
    text = get_field(row, loc, prompt)
    gold = get_field(row, loc, answer, types=(str, int, float))
    meta = {k: v for k, v in row.items() if k not in (prompt, answer)}
    if choices is not None:
        options = get_field(row, loc, choices, types=(list,))
        if not 2 <= len(options) <= len(LETTERS) or not all(isinstance(c, str) for c in options):
            raise DataError(f"{loc}: {choices!r} must be 2..{len(LETTERS)} strings")
        idx = gold if isinstance(gold, int) else LETTERS.find(str(gold).strip().upper())
        if isinstance(gold, float) or (isinstance(gold, str) and len(gold.strip()) != 1) or not 0 <= idx < len(options):
            raise DataError(f"{loc}: {answer!r} {gold!r} is not a valid choice index or letter")
        meta["choices"] = list(options)
        return Example(mc_prompt(text, options), LETTERS[idx], meta)
    gold = str(gold).strip()
    if not text.strip() or not gold:
        raise DataError(f"{loc}: empty {prompt if not text.strip() else answer!r} field")
    return Example(text, gold, meta)


def examples_from_files(files: list[str], parser: Callable[..., Example | None], source: str,
                        **options: Any) -> list[Example]:
    out, index = [], 0
    for path in files:
        for loc, row in read_rows(path):
            ex = parser(row, loc, index, **options)
            index += 1
            if ex is not None:
                out.append(Example(ex.prompt, ex.answer, {"source": source, "index": index - 1, **ex.meta}))
    if not out:
        raise DataError(f"{', '.join(files)}: no {source} examples")
    return out


# --------------------------------------------------------------------------------------------------
# tensorflow-datasets (only if prepared locally; never downloads)
# --------------------------------------------------------------------------------------------------
def tfds_examples(builder_name: str, *, data_dir: str | None, split: str, source: str) -> list[Example]:
    """Rows of a prepared TFDS builder whose features hold GSM8K-style ``question``/``answer``."""
    tfds = require("tfds")  # optional: MissingExtra (one line naming the extra) without it

    prepare = (f"prepare it once on a machine with network access: python -c \"import tensorflow_datasets as tfds, "
               f"tensorflow_datasets.text.gsm8k; tfds.builder('{builder_name}', "
               f"data_dir='{data_dir or '~/tensorflow_datasets'}', "
               f"file_format='array_record').download_and_prepare()\"")
    try:
        builder = tfds.builder(builder_name, data_dir=data_dir)
    except Exception as first:  # DatasetNotFoundError: gsm8k's builder module is not imported by default
        try:
            if builder_name == "gsm8k":
                import tensorflow_datasets.text.gsm8k  # noqa: F401  (registers the builder)
            builder = tfds.builder(builder_name, data_dir=data_dir)
        except Exception:
            raise FileNotFoundError(f"tfds builder {builder_name!r} not found ({first}); {prepare}") from None
    if not builder.is_prepared():
        raise FileNotFoundError(f"tfds dataset {builder_name!r} is not prepared under {builder.data_dir}; {prepare}")
    if split not in builder.info.splits:
        raise DataError(f"tfds {builder_name!r}: no split {split!r} (has {sorted(builder.info.splits)})")
    try:
        source_rows = builder.as_data_source(split=split)
    except Exception as e:  # tfrecord files need TensorFlow to read; array_record files do not
        raise DataError(f"tfds {builder_name!r} at {builder.data_dir}: cannot read without TensorFlow ({e}); "
                        "prepare it with file_format='array_record' or install tensorflow") from None
    out = []
    for i in range(len(source_rows)):
        row = {k: v.decode("utf-8") if isinstance(v, bytes) else v for k, v in source_rows[i].items()}
        ex = parse_gsm8k(row, f"tfds {builder_name}/{split}: record {i}", i)
        out.append(Example(ex.prompt, ex.answer, {"source": source, "index": i, **ex.meta}))
    return out


# --------------------------------------------------------------------------------------------------
# reasoning-gym generators
# --------------------------------------------------------------------------------------------------
def gym_examples(name: str, *, size: int, seed: int, source: str, **config: Any) -> list[Example]:
    """``reasoning_gym.create_dataset(name, size=size, seed=seed, **config)`` entries as Examples; the
    entry itself is ``meta['gym_entry']`` so that :func:`ict_jax.rewards.checks.gym_answer_score` can score a
    response against it."""
    rg = require("gym")  # MissingExtra (one line naming the extra) without it
    try:
        ds = rg.create_dataset(name, size=size, seed=seed, **config)
    except Exception as e:
        raise DataError(f"reasoning-gym dataset {name!r}: {e}") from None
    out = []
    for i in range(len(ds)):
        entry = ds[i]
        out.append(Example(str(entry["question"]), str(entry["answer"]),
                           {"source": source, "index": i, "gym_dataset": name, "gym_entry": entry}))
    return out


