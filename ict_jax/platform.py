"""What accelerators this machine has, read from the operating system without importing JAX (the
command line must decide ``JAX_PLATFORMS`` before JAX starts its backends; docs/tpu.md)."""

from __future__ import annotations

import glob
import os
import sys

#: The PCI vendor id of Google's TPU chips (what JAX's own TPU detection reads).
GOOGLE_PCI_VENDOR = "0x1ae0"
_NVIDIA_DEVICES = ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg")


def tpu_chips_present() -> bool:
    """A TPU chip on this machine's PCI bus."""
    for vendor in glob.glob("/sys/bus/pci/devices/*/vendor"):
        try:
            with open(vendor) as f:
                if f.read().strip() == GOOGLE_PCI_VENDOR:
                    return True
        except OSError:
            continue
    return False


def nvidia_gpu_present() -> bool:
    """An NVIDIA GPU (or WSL's GPU device) visible to this process."""
    return any(os.path.exists(d) for d in _NVIDIA_DEVICES)


def use_cpu_without_accelerators() -> bool:
    """With libtpu installed (the ``tpu`` extra) on a machine without TPU chips or NVIDIA GPUs, JAX would
    start the TPU runtime when it initialises its backends (the first ``jax.devices()``, array or
    computation), and libtpu prints five lines of warnings and errors (TPU_ACCELERATOR_TYPE,
    TPU_WORKER_HOSTNAMES) before JAX falls back to the CPU. Then, and only when ``JAX_PLATFORMS`` is unset,
    select the CPU: the same devices, no noise. Returns True when it did (docs/tpu.md).

    It sets ``JAX_PLATFORMS=cpu`` (read by a JAX imported later, and by child processes) and, when JAX is
    already imported, its ``jax_platforms`` option, which JAX reads at backend initialisation: so
    ``import jax`` before ``import ict_jax`` is quiet too, as long as JAX has not started its backends yet
    and ``jax_platforms`` was not set. The command line and ``import ict_jax`` call it. Compiling for a
    TPU topology works either way."""
    import importlib.util

    if "JAX_PLATFORMS" in os.environ or importlib.util.find_spec("libtpu") is None:
        return False
    if tpu_chips_present() or nvidia_gpu_present():
        return False
    os.environ["JAX_PLATFORMS"] = "cpu"
    _select_cpu_in_imported_jax()
    return True


def _select_cpu_in_imported_jax() -> bool:
    """``jax_platforms = "cpu"`` in a JAX that is already imported (JAX reads the environment variable once,
    at its import), unless its backends have started or the option is set: True when it set it. It never
    imports JAX itself."""
    jax = sys.modules.get("jax")
    if jax is None:
        return False
    bridge = sys.modules.get("jax._src.xla_bridge")
    try:
        if bridge is not None and bridge.backends_are_initialized():
            return False  # the backends exist: the option would change nothing (and the noise was printed)
        if jax.config.jax_platforms:
            return False  # the user's choice
        jax.config.update("jax_platforms", "cpu")
    except AttributeError:  # a JAX still being imported, or one without these names
        return False
    return True


def accelerator_type(generation: str, chips: int) -> str:
    """The Cloud TPU accelerator name of a slice (``v5e``, 8 chips -> ``v5litepod-8``; v4 and v5p
    names count TensorCores, two a chip: ``v5p``, 4 chips -> ``v5p-8``)."""
    if generation == "v5e":
        return f"v5litepod-{chips}"
    if generation in ("v4", "v5p"):
        return f"{generation}-{2 * chips}"
    return f"{generation}-{chips}"
