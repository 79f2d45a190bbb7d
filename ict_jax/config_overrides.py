"""The ``key.sub=value`` overrides of the command line (``ict-jax train key=value ...``): each text parsed
into its dotted key and a value read as YAML, then set into a plain config tree."""

from __future__ import annotations

import typing
from typing import Any

from ict_jax.config import ConfigError, set_dotted


def parse_override(text: str) -> tuple[str, Any]:
    """``"rl.loss.kl_coef=0"`` -> ``("rl.loss.kl_coef", 0)``; the value is parsed as YAML."""
    import yaml  # yaml only where text is parsed (the CLI parser imports this module)

    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form key.sub=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override {text!r} has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key, value


def apply_overrides(data: dict[str, Any], overrides: typing.Iterable[str]) -> dict[str, Any]:
    """Each ``key.sub=value`` of ``overrides`` set into the plain tree ``data``, in order (a later one wins);
    returns ``data``."""
    for text in overrides:
        key, value = parse_override(text)
        set_dotted(data, key, value)
    return data
