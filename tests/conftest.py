"""Test set-up. XLA_FLAGS must be set before JAX is imported anywhere: 8 fake CPU devices let the
sharding tests build a (data 2, fsdp 2, tensor 2) mesh on a laptop or CI box."""

import os
import pathlib

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# subprocess tests (python -m ict_jax.cli ...) import the checkout under test, not whatever is installed
_REPO = str(pathlib.Path(__file__).resolve().parent.parent)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [_REPO, os.environ.get("PYTHONPATH")]))

import jax  # noqa: E402
import pytest  # noqa: E402

# A persistent compilation cache shared by this process and the subprocess tests it starts.
_CACHE = pathlib.Path(os.environ.get("ICT_JAX_TEST_CACHE", pathlib.Path(__file__).resolve().parent.parent / ".jax_cache"))
os.environ["ICT_JAX_TEST_CACHE"] = str(_CACHE)
jax.config.update("jax_compilation_cache_dir", str(_CACHE))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
jax.config.update("jax_enable_x64", False)


@pytest.fixture(scope="session")
def devices8():
    devs = jax.devices()
    assert len(devs) == 8, f"expected 8 fake CPU devices, got {len(devs)}: XLA_FLAGS set too late?"
    return devs
