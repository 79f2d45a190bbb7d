"""Loading a configuration: the defaults <- a base tree <- a YAML file (and the files it names with
``base:``) <- ``key.sub=value`` overrides, validated into a :class:`~ict_jax.config.Config`.

A YAML file is a small overlay: it names only the keys it changes. Every error is a one-line
:class:`~ict_jax.config.ConfigError` (a missing or unreadable file, invalid YAML with its line and column,
a file that includes itself)."""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Any

from ict_jax.config import Config, ConfigError, from_dict
from ict_jax.config_overrides import apply_overrides


def load_config(path: str | Path | None = None, overrides: typing.Sequence[str] = (), *,
                base: typing.Mapping[str, Any] | None = None) -> Config:
    """Load defaults <- ``base`` <- YAML file <- ``key=value`` overrides, validated.

    A YAML may name a ``base:`` file (relative to itself) that it overlays. ``base``: a plain config tree
    under everything else (a run's recorded ``config.json``: what ``ict-jax train --resume`` without
    ``--config`` continues).
    """
    data: dict[str, Any] = json_copy(base) if base is not None else {}
    if path is not None:
        data = deep_merge(data, _load_yaml(Path(path), seen=()))
    return from_dict(apply_overrides(data, overrides))


def json_copy(tree: typing.Mapping[str, Any]) -> dict[str, Any]:
    """A deep copy of a plain config tree (nested dicts and lists), safe to modify."""
    return {k: json_copy(v) if isinstance(v, dict) else list(v) if isinstance(v, list) else v for k, v in tree.items()}


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` laid over ``base`` (plain trees): a section merged key by key, any other value replaced."""
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def _yaml_where(err: Any) -> str:
    """`` at line L, column C: <problem> (<context> at line l, column c)`` of a YAML error (1-based)."""
    mark = getattr(err, "problem_mark", None)
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    out = f" at line {mark.line + 1}, column {mark.column + 1}: {problem}" if mark is not None else f": {problem}"
    context, cmark = getattr(err, "context", None), getattr(err, "context_mark", None)
    if context and cmark is not None:
        out += f" ({context} at line {cmark.line + 1}, column {cmark.column + 1})"
    return out


def _load_yaml(path: Path, seen: tuple[Path, ...]) -> dict[str, Any]:
    import yaml  # yaml only where text is parsed (the CLI parser imports this module)

    if path.is_dir():
        found = sorted(p.name for p in path.glob("*.yaml"))[:3]
        raise ConfigError(f"config file {str(path)!r} is a folder: name a YAML file in it"
                          + (f" ({', '.join(found)}, ...)" if found else ""))
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    if path.resolve() in seen:
        raise ConfigError(f"config file {str(path)!r} includes itself through 'base'")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {str(path)!r} is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset "
                          f"{e.start})") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML{_yaml_where(e)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping at the top level")
    base = data.pop("base", None)
    if base is not None:
        parent = _load_yaml((path.parent / base), seen + (path.resolve(),))
        data = deep_merge(parent, data)
    return data
