"""Deprecation: the one way an old name or an old form of the API keeps working for a while.

Each one is declared with the ict_jax version that removes it and warns, when used, with one category
(``DeprecationWarning``) and one shape of text that names the old name, its replacement and that version::

    ict_jax.old_name is deprecated and will be removed in ict_jax 0.3.0: use ict_jax.new_home.new_name

Three kinds, one text: a module's former attribute names (:class:`MovedNames`, the module's PEP 562
``__getattr__`` calls it), former module paths (:class:`MovedModules`, an import hook), and anything else a
function still accepts in an old form (:func:`warn`, called where the old form is recognised). An old name
resolves to the very object at its new home, not a copy. Imports nothing of ict_jax: every layer may use it.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: The release that removes a name or form deprecated in ict_jax 0.2.x (CHANGELOG.md lists them).
REMOVED_IN = "0.3.0"


def message(old: str, new: str, removed_in: str) -> str:
    """The text of every deprecation warning: ``old`` (the name or form in use), ``new`` (what to use)."""
    return f"{old} is deprecated and will be removed in ict_jax {removed_in}: use {new}"


def warn(old: str, new: str, *, removed_in: str, stacklevel: int = 2) -> None:
    """A ``DeprecationWarning`` with :func:`message`'s text. ``stacklevel`` as ``warnings.warn``'s, counted
    from the caller of ``warn``: 2 (the default) points at the code that called that function."""
    warnings.warn(message(old, new, removed_in), DeprecationWarning, stacklevel=stacklevel + 1)


@dataclass(frozen=True)
class MovedNames:
    """The former attribute names of ``module`` (its ``__name__``): old name -> the dotted path of the
    object at its new home (``"ict_jax.rl.quantile.rho_fraction"``; the name may differ from the old one).
    The module's ``__getattr__`` returns ``resolve(name)``. ``use``: old name -> what the warning tells the
    reader to use instead of the new home's path, for a name whose new home is itself deprecated (so the
    warning names the replacement, not a second deprecated place)."""

    module: str
    homes: Mapping[str, str]
    removed_in: str
    use: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def __contains__(self, name: object) -> bool:
        return name in self.homes

    def resolve(self, name: str) -> Any:
        """The object ``name`` refers to now, with a warning pointed at the code that read the old name
        (called from the module's ``__getattr__``); an unknown name raises the usual ``AttributeError``."""
        if name not in self.homes:
            raise AttributeError(f"module {self.module!r} has no attribute {name!r}")
        new = self.homes[name]
        warn(f"{self.module}.{name}", self.use.get(name, new), removed_in=self.removed_in, stacklevel=3)
        home, _, attr = new.rpartition(".")
        return getattr(importlib.import_module(home), attr)


class MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Former module paths: old dotted name -> new dotted name. ``import old`` warns and binds the module at
    its new home (one module object under both names). :meth:`install` adds it to ``sys.meta_path``."""

    def __init__(self, homes: Mapping[str, str], *, removed_in: str) -> None:
        self.homes = dict(homes)
        self.removed_in = removed_in

    def install(self) -> None:
        """Append to ``sys.meta_path``, once for the same table (a package imported again adds nothing)."""
        if not any(isinstance(f, MovedModules) and f.homes == self.homes for f in sys.meta_path):
            sys.meta_path.append(self)

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in self.homes:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: Any) -> Any:
        new = self.homes[spec.name]
        # stacklevel: past this frame and the import machinery's (warnings skips importlib._bootstrap frames)
        warn(spec.name, new, removed_in=self.removed_in, stacklevel=2)
        return importlib.import_module(new)

    def exec_module(self, module: Any) -> None:  # the new home's module is already executed
        pass
