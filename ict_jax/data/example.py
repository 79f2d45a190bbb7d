"""One problem of a dataset (:class:`Example`) and the error a malformed data file raises."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class DataError(ValueError):
    """A malformed data file or row; the message names the file and the line (or Parquet row)."""


@dataclass(frozen=True)
class Example:
    """One problem: the prompt text (before any chat template), the gold answer, and metadata.

    ``meta`` always has ``source`` (dataset name) and ``index`` (position in the source); loaders add
    their own keys (``solution``, ``level``, ``choices``, ``gym_entry``, ...)."""

    prompt: str
    answer: str
    meta: dict[str, Any] = field(default_factory=dict, compare=False)

