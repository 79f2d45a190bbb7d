"""What accelerators this machine has, read from the operating system without importing JAX (the
command line must decide ``JAX_PLATFORMS`` before JAX starts; docs/tpu.md)."""

from __future__ import annotations

import glob
import os

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
    start the TPU runtime, which prints several lines of warnings (TPU_ACCELERATOR_TYPE,
    TPU_WORKER_HOSTNAMES) before falling back to the CPU. Then, and only when ``JAX_PLATFORMS`` is unset,
    set ``JAX_PLATFORMS=cpu``: the same devices, no noise. It must run before JAX is imported (JAX reads the
    variable then); the command line and ``import ict_jax`` call it. Compiling for a TPU topology works
    either way. Returns True when it set the variable (docs/tpu.md)."""
    import importlib.util

    if "JAX_PLATFORMS" in os.environ or importlib.util.find_spec("libtpu") is None:
        return False
    if tpu_chips_present() or nvidia_gpu_present():
        return False
    os.environ["JAX_PLATFORMS"] = "cpu"
    return True


def accelerator_type(generation: str, chips: int) -> str:
    """The Cloud TPU accelerator name of a slice (``v5e``, 8 chips -> ``v5litepod-8``; v4 and v5p
    names count TensorCores, two a chip: ``v5p``, 4 chips -> ``v5p-8``)."""
    if generation == "v5e":
        return f"v5litepod-{chips}"
    if generation in ("v4", "v5p"):
        return f"{generation}-{2 * chips}"
    return f"{generation}-{chips}"
