"""The optional extras that data sources need: which dataset spec needs which package, and the check made
before any work (a missing extra is bad input like any other: one line that names it, exit 2).

    check_extras(["gym:chain_sum?size=4", "split"])   # MissingExtra when reasoning-gym is not installed
    rg = require("gym")                                # the module itself, imported

``gym:NAME`` needs the ``gym`` extra (reasoning-gym), ``tfds:NAME`` the ``tfds`` extra
(tensorflow-datasets); every other source needs nothing beyond the core install. Whether a package is
installed is read without importing it (``importlib.util.find_spec``), so the check costs milliseconds.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Iterable
from dataclasses import dataclass
from types import ModuleType

from ict_jax.install import install_line


class MissingExtra(ImportError):
    """An optional extra of ict_jax that is not installed (the message names it): a data source's, or the
    ``stats`` extra (SciPy) of the experiments' statistics. The command line prints it in one line and exits
    with 2."""


@dataclass(frozen=True)
class Extra:
    """An extra of pyproject.toml: its name, the module it provides, the distribution and why it costs."""

    name: str
    module: str
    distribution: str
    note: str = ""


#: dataset spec prefix -> the extra its source needs
EXTRAS: dict[str, Extra] = {
    "gym:": Extra("gym", "reasoning_gym", "reasoning-gym",
                  "it builds a few packages from source and needs a C compiler"),
    "tfds:": Extra("tfds", "tensorflow_datasets", "tensorflow-datasets",
                   "needed only for tfds: sources; local JSONL/Parquet files need nothing more"),
}


def extra_of(spec: str) -> Extra | None:
    """The extra a dataset spec (``gym:chain_sum?size=4``) needs, or None."""
    name = spec.strip()
    return next((extra for prefix, extra in EXTRAS.items() if name.startswith(prefix)), None)


def _install_line(extra: Extra) -> str:
    note = f" ({extra.note})" if extra.note else ""
    return install_line(extra.name) + note


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent that fails to import; a module without a spec
        return False


def check_extras(specs: Iterable[str]) -> None:
    """Raise :class:`MissingExtra` for the first spec whose extra is not installed (nothing is imported)."""
    for spec in specs:
        extra = extra_of(spec)
        if extra is not None and not _installed(extra.module):
            raise MissingExtra(f"{spec!r} needs the {extra.name} extra ({extra.distribution}), which is not "
                               f"installed: {_install_line(extra)}")


def require(name: str) -> ModuleType:
    """The module of the extra ``name`` (``"gym"``, ``"tfds"``), imported; :class:`MissingExtra` (one line
    that names the extra) when it is not installed or fails to import."""
    extra = next(e for e in EXTRAS.values() if e.name == name)
    try:
        return importlib.import_module(extra.module)
    except ImportError as e:
        what = "is not installed" if not _installed(extra.module) else f"cannot be imported ({e})"
        raise MissingExtra(f"{extra.distribution} (the {extra.name} extra) {what}: {_install_line(extra)}") from None
