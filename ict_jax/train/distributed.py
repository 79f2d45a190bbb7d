"""A multi-process run's start: ``jax.distributed.initialize`` (docs/tpu.md, "Multi-host")."""

from __future__ import annotations

import os

import jax


def maybe_initialize_distributed(coordinator: str | None = None, num_processes: int | None = None,
                                 process_id: int | None = None) -> bool:
    """``jax.distributed.initialize`` from explicit flags, or from the environment (Cloud TPU pods and
    SLURM/Open MPI are detected by JAX itself; ``ICT_JAX_COORDINATOR`` / ``ICT_JAX_NUM_PROCESSES`` /
    ``ICT_JAX_PROCESS_ID`` otherwise). Returns True when a multi-process run was set up."""
    coordinator = coordinator or os.environ.get("ICT_JAX_COORDINATOR")
    if num_processes is None and os.environ.get("ICT_JAX_NUM_PROCESSES"):
        num_processes = int(os.environ["ICT_JAX_NUM_PROCESSES"])
    if process_id is None and os.environ.get("ICT_JAX_PROCESS_ID"):
        process_id = int(os.environ["ICT_JAX_PROCESS_ID"])
    if coordinator is None and num_processes is None:
        return False
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id)
    return True
