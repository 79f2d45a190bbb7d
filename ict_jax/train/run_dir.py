"""A run directory's checks and its hold, without JAX (``ict-jax train`` takes the hold in its first second,
before it imports the trainer): a new run never writes over an existing one, ``--resume`` continues one
that exists, and one process at a time holds it (:func:`ict_jax.outputs.hold_output_dir`)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

from ict_jax.config import ConfigError
from ict_jax.outputs import has_entries, hold_output_dir


def check_run_dir(run_dir: Path, resume: bool) -> None:
    """A new run never writes over an existing one; ``--resume`` continues one that exists. A folder that
    holds nothing but a hold's lock file (:func:`hold_run_dir`) holds no run."""
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"run_dir: {str(run_dir)!r} exists and is not a directory")
    if resume and not run_dir.is_dir():
        raise ConfigError(f"--resume: run_dir {str(run_dir)!r} does not exist, so there is nothing to resume "
                          "(drop --resume to start a new run there)")
    if not resume and has_entries(run_dir):
        raise ConfigError(f"run_dir: {str(run_dir)!r} already holds a run; pass --resume to continue it or "
                          "choose another run_dir (nothing was written)")


@contextlib.contextmanager
def hold_run_dir(run_dir: Path, resume: bool, *, primary: bool | None = None) -> Iterator[None]:
    """:func:`check_run_dir`, then hold ``run_dir`` while the block runs (:func:`ict_jax.outputs.hold_output_dir`,
    on the ``primary`` process only: process 0 of a multi-process run, read from JAX when not given; False
    where the caller holds it already): a
    second run on the same directory is refused at once with :class:`~ict_jax.outputs.OutputInUse`, naming
    the process that holds it. The hold is a ``flock`` on ``<run_dir>/.lock``, which the kernel releases
    however the holder ends (a kill included); a new run that fails before writing anything leaves no
    directory behind."""
    check_run_dir(run_dir, resume)
    if primary is None:
        import jax

        primary = jax.process_index() == 0
    if not primary:
        yield
        return
    with hold_output_dir(run_dir, "run_dir"):
        yield
