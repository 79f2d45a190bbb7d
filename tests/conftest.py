"""Test set-up. XLA_FLAGS must be set before JAX is imported anywhere: 8 fake CPU devices let the
sharding tests build a (data 2, fsdp 2, tensor 2) mesh on a laptop or CI box."""

import os
import pathlib

# Compile for compile time, not run time: the tests' programs are tiny and run for milliseconds, while XLA's
# CPU backend spends most of a test's seconds optimising their machine code (the tiny model's init: ~6 s at
# XLA's default level, ~1 s at level 0; a train step: ~40 % less) and emitting its fusions through MLIR: the
# older elemental emitters (``--xla_cpu_use_fusion_emitters=false``) compile a train step in about a third
# of the time (one test's compile 27.5 s -> 9.5 s; the default suite, cold, 10 min 45 s -> 6 min 42 s).
# Same programs, same semantics; the numbers may differ in the last bits from the defaults (a random init
# too), and two different programs that compute the same values (ICT at rho 1 and dense) may order their
# float32 sums differently, so no test asks them for equal bits. A subprocess whose bits are compared with
# this process's keeps these flags (test_checkpoint's child); subprocess tests on one device that spend
# their time compiling (resume after SIGKILL, two processes, the notebook build, the CLI runs, the default
# suite's runnable docs) take them too (ICT_JAX_TEST_SUBPROCESS_XLA_FLAGS, below) and compare only among
# themselves.
# ICT_JAX_TEST_XLA_OPT=default runs everything at XLA's defaults.
_OPT = ("" if os.environ.get("ICT_JAX_TEST_XLA_OPT") == "default"
        else " --xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false")
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8" + _OPT
).strip()
# A subprocess test on one CPU device, like a user's machine, compiles with the same flags: XLA_FLAGS set to
# this. The demo's README command, the slow runnable docs, the SFT Ctrl-C resume and the real-model tests
# compile as a user's run does (XLA_FLAGS=""): they run for minutes, or sampled what they check at the
# defaults.
os.environ["ICT_JAX_TEST_SUBPROCESS_XLA_FLAGS"] = _OPT.strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Implicit rank promotion ([B, T] + [B] broadcasting on the trailing axis) is an error, here and in the
# subprocess tests: the package broadcasts explicitly (adv[:, None]), so a silent shape bug cannot pass.
os.environ["JAX_NUMPY_RANK_PROMOTION"] = "raise"
# The memory pre-flight (docs/memory.md) reads a fixed budget in the tests: their runs are tiny, and what
# other processes hold must not decide whether they run (with a real model training beside the suite,
# MemAvailable left the 8 test devices 0 B each and tiny runs were refused). tests/test_memory.py and
# tests/train/test_preflight.py set and remove it to test the detection itself. Export it to override.
os.environ.setdefault("ICT_JAX_MEMORY_BUDGET", "20GiB")
# The heartbeat (a "still running" line every 30 s of a long phase, ict_jax.heartbeat) is a line on stderr
# whenever a compile passes 30 s, which a loaded machine makes of any tiny run, so a test of a one-line error
# would count it: the tests' heartbeat is hourly unless a test sets its own interval (the heartbeat's tests
# do: 0.05-0.5 s). Export it to override.
os.environ.setdefault("ICT_JAX_HEARTBEAT_S", "3600")
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
# the subprocesses read JAX's options from their environment: a run started again (resumed, or the
# uninterrupted twin of an interrupted one) loads the programs its first start compiled
os.environ["JAX_COMPILATION_CACHE_DIR"] = str(_CACHE)
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.5"
jax.config.update("jax_enable_x64", False)
jax.config.update("jax_numpy_rank_promotion", "raise")


# A real Qwen2.5 (a name of KNOWN_MODELS) is several GB in memory: only tests marked ``real_model`` may
# resolve one, because CI runs those one at a time beside the rest (.ci/run). Every way to a real model goes
# through packaged.packaged_model_path (resolve_path, the CLI's --model in this process, the notebooks):
# the guard fails the test there, before anything loads, naming the marker it lacks. It is installed once,
# not as a fixture, so a module- or session-scoped fixture that resolves the model is guarded too.
_RUNNING: list = []  # the test item being set up, run or torn down
_REAL_MODELS: list = []  # the package's KNOWN_MODELS.values(), read once


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _RUNNING.append(item)
    try:
        yield
    finally:
        _RUNNING.pop()


def real_model_guard(spec, *, item=None):
    """Refuse ``spec`` when it names a real model and the running test (``item``) lacks ``real_model``.
    The real models are the package's KNOWN_MODELS as declared (tests add fake ones to the table)."""
    from ict_jax.model import packaged

    item = item if item is not None else (_RUNNING[-1] if _RUNNING else None)
    model = packaged.split_model_for(spec)
    if item is not None and model in _REAL_MODELS and not item.get_closest_marker("real_model"):
        pytest.fail(f"{item.nodeid} resolves the real model {model.name!r} without the real_model marker: mark it "
                    "@pytest.mark.real_model (and slow), so CI runs it one real model at a time", pytrace=False)


def _install_real_model_guard():
    from ict_jax.model import packaged

    _REAL_MODELS.extend(packaged.KNOWN_MODELS.values())
    unguarded = packaged.packaged_model_path

    def packaged_model_path(spec):
        real_model_guard(spec)
        return unguarded(spec)

    packaged_model_path.__doc__ = unguarded.__doc__
    packaged.packaged_model_path = packaged_model_path


_install_real_model_guard()


# An xdist worker (`-n 2`) must end quickly once it has reported its results: execnet gives it 5 s after the
# controller says stop, then sends it SIGINT (and the controller kills it after 10 s). What it still does
# then is pytest's unraisable-exception check, a full garbage collection at unconfigure and another at
# cleanup; after a share of this suite a worker holds ~0.5 M+ objects, and on a loaded 2-core machine each
# collection took 4-6 s. The SIGINT then lands inside the collection, in the first Python code it runs:
# hypothesis's gc callback (it times gc, registered first), which prints a stray KeyboardInterrupt
# traceback after a passing run. So a worker collects once here, before it reports (nothing waits on it),
# and freezes what survives (gc.freeze: later collections skip those objects): its last collections
# and its exit take milliseconds.
@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session):
    if hasattr(session.config, "workerinput"):
        import gc

        gc.collect()
        gc.freeze()


# A test marked ``libtpu`` compiles with the TPU compiler (the tpu extra): skipped where libtpu is not installed,
# except where ICT_JAX_REQUIRE_LIBTPU is set (CI, .ci/run), where it runs and fails without it.
def pytest_collection_modifyitems(config, items):
    import importlib.util

    if importlib.util.find_spec("libtpu") is not None or os.environ.get("ICT_JAX_REQUIRE_LIBTPU"):
        return
    skip = pytest.mark.skip(reason="the tpu extra: pip install -e '.[tpu]' (.ci/run installs it)")
    for item in items:
        if item.get_closest_marker("libtpu"):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def devices8():
    devs = jax.devices()
    assert len(devs) == 8, f"expected 8 fake CPU devices, got {len(devs)}: XLA_FLAGS set too late?"
    return devs


# ------------------------------------------------------------------------------------------------
# One tiny model for the whole session (built and compiled once). It is the `tiny` preset as the
# trainer builds it for the CharTokenizer (vocabulary 100), seed 0: the model of `ict-jax train
# model.preset=tiny`, the token inspector's tests and notebook 01. Tests that need another shape, dtype
# or seed build their own.
# READ-ONLY: never hand these to a train step (the step donates its state, which would delete the
# shared arrays) nor change them; build a fresh model with `ict_jax.init_model(tiny_config, seed=...)`.
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def char_tokenizer():
    from ict_jax import CharTokenizer

    return CharTokenizer()


@pytest.fixture(scope="session")
def tiny_config(char_tokenizer):
    from ict_jax import ModelConfig

    return ModelConfig.tiny(vocab_size=char_tokenizer.vocab_size)


@pytest.fixture(scope="session")
def tiny_model(tiny_config):
    from ict_jax import init_model

    return init_model(tiny_config, seed=0)


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory, tiny_model):
    """`tiny_model` saved as a Hugging Face directory (config.json + model.safetensors, no tokenizer
    files: pass `--tokenizer char`). Read-only."""
    from ict_jax import save_hf

    return save_hf(tiny_model, tmp_path_factory.mktemp("tiny_hf") / "model")
