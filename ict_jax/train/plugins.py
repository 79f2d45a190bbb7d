"""A run's open sets, checked when the run is built: the user's ``plugins: [module, ...]`` imported (each
registers selectors, loss aggregations or reward kinds at its home: ``rl.selectors``, ``rl.losses``,
``rewards.checks``), then every member the config names checked against its registry (docs/plugins.md).

Training, SFT, ``ict-jax compile``, ``ict-jax eval`` and ``ict-jax compare --plan`` call
:func:`check_registered` before anything is written; the reward workers import the same plugins
(``rewards.pool.RewardPool(plugins=...)``)."""

from __future__ import annotations

import os
from typing import Sequence

from ict_jax.config import Config, ConfigError
from ict_jax.rewards.pool import RewardFunctionError, load_plugins
from ict_jax.rl.losses import check_loss_agg
from ict_jax.rl.selectors import check_selector


def import_plugins(modules: Sequence[str]) -> None:
    """Import the plugin modules (the working directory searched first); :class:`ConfigError` (one line
    naming ``plugins`` and the module) for one that cannot be imported."""
    try:
        load_plugins(tuple(modules), os.getcwd())
    except RewardFunctionError as e:
        raise ConfigError(str(e)) from None


def check_registered(cfg: Config) -> None:
    """``cfg.plugins`` imported, then ``rl.selector.method`` (and its ``params``) and ``rl.loss.loss_agg``
    checked against their registries: :class:`ConfigError`, one line naming the key and the registered names."""
    import_plugins(cfg.plugins)
    check_selector(cfg.rl.selector)
    check_loss_agg(cfg.rl.loss)
