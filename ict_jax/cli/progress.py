"""A command's heartbeat (:class:`ict_jax.heartbeat.Heartbeat`) on stderr from its first second:
``ict-jax eval: loading the benchmarks (gsm8k_test): still running, 30s so far (42s in all)`` whenever
``$ICT_JAX_HEARTBEAT_S`` (30 by default) seconds pass without a line, naming the phase that runs. Imports
nothing heavy: a command starts it before JAX is imported."""

from __future__ import annotations

import sys

from ict_jax.heartbeat import Heartbeat


def command_heartbeat(command: str, *, enabled: bool = True) -> Heartbeat:
    """``with command_heartbeat("eval") as beat: beat.phase("loading ..."); ...``: lines
    ``ict-jax <command>: <phase>: still running, ...`` on stderr; ``phase(None)`` while the work speaks for
    itself; ``enabled`` False: none."""
    return Heartbeat(lambda line: print(f"ict-jax {command}: {line}", file=sys.stderr, flush=True), enabled=enabled)
