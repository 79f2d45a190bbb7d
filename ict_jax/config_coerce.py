"""Plain data -> a frozen dataclass tree: every value checked against its field's annotation.

The converter the config tree is built with (``ict_jax.config.from_dict``, ``Config.replace``,
``build_section``: a registry member's own settings). It reads the annotations alone (``Literal``,
``X | None``, ``tuple[X, ...]``, ``dict[str, Any]``, ``bool``, ``int``, ``float``, ``str`` and nested
dataclasses) and raises the caller's error class with one line naming the dotted key and what is allowed.
Imports nothing of ict_jax: the schema (``ict_jax.config``) sits on top of it.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any, Callable, Literal, get_args, get_origin


def _finite(key: str) -> str:
    return "a finite number"


def build(cls: type, data: Any, prefix: str = "", *, error: type[Exception] = ValueError,
          allowed: Callable[[str], str] = _finite) -> Any:
    """The frozen dataclass ``cls`` from the plain mapping ``data`` (nested mappings for nested dataclass
    fields), each value coerced to its field's type; ``error`` (one line naming ``prefix.<key>``) for an
    unknown key or a wrong type. ``allowed(key)``: the text of a numeric key's allowed values, for the
    message of a non-finite float (``nan``, ``.inf``)."""
    if not isinstance(data, dict):
        raise error(f"{prefix or 'config'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        key = f"{prefix}.{unknown[0]}" if prefix else unknown[0]
        raise error(f"unknown config key {key!r}; allowed keys here: {', '.join(fields)}")
    kwargs = {}
    for name, value in data.items():
        key = f"{prefix}.{name}" if prefix else name
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            kwargs[name] = build(tp, value, key, error=error, allowed=allowed)
        else:
            kwargs[name] = coerce(value, tp, key, error=error, allowed=allowed)
    return cls(**kwargs)


def type_name(tp: Any) -> str:
    """A field type in words: ``one of 'a', 'b'``, ``a list of int``, ``float or null``."""
    origin = get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(type_name(a) for a in get_args(tp))
    if origin is tuple:
        return f"a list of {type_name(get_args(tp)[0])}"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _yaml_or_text(text: str) -> Any:
    """``text`` parsed as YAML, or the text itself when it is not valid YAML (``[a?b`` is a string)."""
    import yaml  # yaml only where text is parsed (the CLI parser imports the config)

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def coerce(value: Any, tp: Any, key: str, *, error: type[Exception] = ValueError,
           allowed: Callable[[str], str] = _finite) -> Any:
    """``value`` as the annotation ``tp`` of the field ``key``, or ``error`` (one line naming ``key``).
    A string for a tuple field is a comma-separated list (``"1,4"`` from the command line), each element
    parsed as YAML; a string for a float is parsed (YAML 1.1 reads ``1e-6`` as a string)."""
    def again(v: Any, t: Any) -> Any:
        return coerce(v, t, key, error=error, allowed=allowed)

    origin = get_origin(tp)
    if origin is Literal:
        if value in get_args(tp):
            return value
        raise error(f"{key}: {value!r} is not allowed; allowed values: {', '.join(map(str, get_args(tp)))}")
    if origin in (typing.Union, types.UnionType):
        others = [a for a in get_args(tp) if a is not type(None)]
        if value is None and len(others) < len(get_args(tp)):
            return None
        if len(others) == 1:  # "X or null" with a value: X's own message ("not a finite number", ...)
            return again(value, others[0])
        for arg in get_args(tp):
            try:
                return again(value, arg)
            except error:
                pass
        raise error(f"{key}: {value!r} is not {type_name(tp)}")
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise error(f"{key}: expected a mapping of names to values, got {value!r}")
        return dict(value)
    if origin is tuple:
        if isinstance(value, str):  # "1,4" from the command line: each element parsed as YAML
            value = [_yaml_or_text(v) for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise error(f"{key}: expected {type_name(tp)}, got {value!r}")
        return tuple(again(v, get_args(tp)[0]) for v in value)
    if tp is type(None):
        if value is None:
            return None
        raise error(f"{key}: expected null, got {value!r}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise error(f"{key}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise error(f"{key}: expected an integer, got {value!r}")
    if tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):  # YAML 1.1 reads "1e-6" (no dot) as a string
            try:
                number = float(value.strip())
            except ValueError:
                pass
        if number is None:
            raise error(f"{key}: expected a number, got {value!r}")
        if not math.isfinite(number):  # nan / inf (also YAML's .nan, .inf) never make sense here
            raise error(f"{key}: {value!r} is not a finite number; allowed: {allowed(key)}")
        return number
    if tp is str:
        if isinstance(value, str):
            return value
        raise error(f"{key}: expected a string, got {value!r}")
    raise TypeError(f"unsupported config type {tp!r} for {key}")  # programming error, not user input
