"""``ict-jax``: a thin command-line front end. Parses arguments and dispatches; the work lives in the
library modules. User errors (bad config, missing files, bad shapes) print one line and exit with 2."""

from __future__ import annotations

import argparse
import errno
import importlib
import logging
import os
import re
import sys
from typing import Callable, Sequence

from ict_jax import __version__, interrupts
from ict_jax.cli.errors import EXIT_DOES_NOT_FIT, UserError
from ict_jax.config import ConfigError
from ict_jax.outputs import USER_PATH_ERRNOS, os_error_line
from ict_jax.platform import use_cpu_without_accelerators

# subcommand -> (module, add_args function, main function, one-line help). Modules import lazily so
# `ict-jax info` does not pay for the trainer's imports.
COMMANDS: dict[str, tuple[str, str, str, str]] = {
    "info": ("ict_jax.cli.info", "add_info_args", "info_main", "print devices, the mesh and the model presets"),
    "export": ("ict_jax.cli.export", "add_export_args", "export_main", "checkpoint -> Hugging Face safetensors"),
    "eval": ("ict_jax.cli.eval", "add_eval_args", "eval_main", "pass@k of a model on benchmarks (docs/method.md §6)"),
    "train": ("ict_jax.cli.train", "add_train_args", "train_main", "RL training (SFT warm start first if configured)"),
    "sample": ("ict_jax.cli.sample", "add_sample_args", "sample_main", "sample G responses to a prompt"),
    "sft": ("ict_jax.cli.train", "add_sft_args", "sft_main", "supervised warm start only; writes <run_dir>/sft_model"),
    "compare": ("ict_jax.cli.compare", "add_compare_args", "compare_main",
                "every method x seed from one warm start: table + plots"),
    "inspect": ("ict_jax.cli.inspect", "add_inspect_args", "inspect_main",
                "HTML page of a group's tokens: JS/H1/H2, ICT/entropy/STAPO masks"),
    "diagnose": ("ict_jax.cli.diagnose", "add_diagnose_args", "diagnose_main",
                 "the paper's token diagnostics of every reading of u and every selector on a real model"),
    "align": ("ict_jax.cli.align", "add_align_args", "align_main",
              "the gradient-alignment check: each selector's gradient against the dense gradient of other batches"),
    "compile": ("ict_jax.cli.compile", "add_compile_args", "compile_main",
                "compile a run's programs for a TPU slice (or the local devices) without running: memory, fit, "
                "collectives"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ict-jax", description="RLVR on Qwen2.5 in JAX: ICT and its baselines (GRPO, 20-Entropy, STAPO, random).")
    parser.add_argument("--version", action="version", version=f"ict-jax {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, add_fn, _main, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        getattr(importlib.import_module(module), add_fn)(p)
    return parser


def _user_error_types() -> tuple[type[BaseException], ...]:
    # ValueError covers the library's input checks (mesh shapes, configs, checkpoints); set
    # ICT_JAX_DEBUG=1 to get the traceback instead.
    # An error class can only have been raised if its module was imported: the ones not imported are not
    # looked for (importing ict_jax.model.weights would import JAX, which an error of the command's first
    # second, a run directory in use, must not wait for).
    types: list[type[BaseException]] = [UserError, ConfigError, FileNotFoundError, FileExistsError, ValueError]
    for module, name in (("ict_jax.data.example", "DataError"), ("ict_jax.data.extras", "MissingExtra"),
                         ("ict_jax.model.weights", "WeightError")):
        found = getattr(sys.modules.get(module), name, None)
        if found is not None:
            types.append(found)
    return tuple(types)


class _NotRaised(BaseException):
    """Raised by nothing: what an ``except`` clause names for an error whose module was never imported."""


def _does_not_fit_type() -> type[BaseException]:
    """The pre-flight's refusal type, only if its module was imported (a run that got as far as its
    pre-flight): importing it imports JAX, which an error of the command's first second (a run directory in
    use, a bad config) must not wait for."""
    module = sys.modules.get("ict_jax.train.preflight")
    return _NotRaised if module is None else module.DoesNotFit


def does_not_fit_line(e) -> str:
    """The pre-flight's refusal and the settings estimated to fit (``aot.fit.estimated_fit``, seconds, no
    compile; ``ict-jax compile --fit`` confirms)."""
    from ict_jax.aot.compile import get_target
    from ict_jax.aot.fit import changed, estimated_fit, no_fit_hint

    check = e.check
    measured = {n.name: n.device_bytes for n in check.needs}
    try:
        best = estimated_fit(e.config, get_target("local"), e.mesh, measured, check.machine.per_device)
    except Exception as err:  # noqa: BLE001 - the refusal stands; the hint is a courtesy
        return f"{e}; no estimate of settings that fit ({type(err).__name__}: {err})"
    if best is None:
        return (f"{e}; no setting of micro_batches, remat, stats.chunk, rollout.chunks or the mesh is estimated "
                f"to fit: {no_fit_hint(e.config.model.lora.enabled, 'sft' in measured)}")
    return (f"{e}; estimated to fit: {changed(best, e.config, e.mesh)} "
            "(an estimate: `ict-jax compile --fit` confirms it by compiling)")


_NEGATIVE_VALUE = re.compile(r"-\d[\d.,:-]*")


def join_negative_values(argv: Sequence[str]) -> list[str]:
    """``--mesh -1,1,1`` -> ``--mesh=-1,1,1``: argparse reads a value that starts with '-' and is not
    a plain negative number as an option; a long option followed by such a value gets it attached."""
    out: list[str] = []
    for tok in argv:
        if (out and out[-1].startswith("--") and "=" not in out[-1] and _NEGATIVE_VALUE.fullmatch(tok)):
            out[-1] = f"{out[-1]}={tok}"
        else:
            out.append(tok)
    return out


def quiet_library_logs() -> None:
    """absl (orbax, JAX) and JAX's own INFO/WARNING lines are noise on a command line: errors only."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    for name in ("absl", "jax._src.xla_bridge", "orbax", "jax._src.distributed"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        # absl: present with orbax; its handler prints "WARNING:absl:..." lines otherwise
        from absl import logging as absl_logging

        absl_logging.set_verbosity(absl_logging.ERROR)
    except ImportError:
        pass
def skip_absent_tpu() -> bool:
    """``ict_jax.platform.use_cpu_without_accelerators``: no libtpu warnings on a machine without a TPU."""
    return use_cpu_without_accelerators()


def silence_stderr(log_path: str | None = None) -> None:
    """After the one-line error of a full disk, what libraries print while the process exits (writers
    that flush into the full disk at exit, aborted background writes) goes to ``log_path`` (the details
    log), else nowhere: the error line stays the last line the user sees. Only for the process's own
    command line (``main()`` without ``argv``), never for a caller's process."""
    try:
        sys.stderr.flush()
        fd = os.open(log_path or os.devnull, os.O_WRONLY | os.O_APPEND)
    except OSError:
        try:
            fd = os.open(os.devnull, os.O_WRONLY)
        except OSError:
            return
    os.dup2(fd, 2)
    os.close(fd)


def main(argv: Sequence[str] | None = None) -> int:
    from_command_line = argv is None  # the process's own command (not a call from Python code)
    if from_command_line:
        interrupts.install()  # Ctrl-C raises KeyboardInterrupt even when it lands in JAX's gc callback
    skip_absent_tpu()
    parser = build_parser()
    argv = join_negative_values(sys.argv[1:] if argv is None else argv)
    # KEY=VALUE overrides may come anywhere, also after options (argparse alone stops at the first option)
    args, extra = parser.parse_known_args(argv)
    if extra:
        if hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extra):
            args.overrides = list(args.overrides or []) + extra
        else:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if not args.command:
        parser.print_help()
        return 2
    if not os.environ.get("ICT_JAX_DEBUG"):
        quiet_library_logs()
    module, _add, main_fn, _help = COMMANDS[args.command]
    fn: Callable[[argparse.Namespace], int] = getattr(importlib.import_module(module), main_fn)
    if os.environ.get("ICT_JAX_DEBUG"):
        return int(fn(args) or 0)
    try:
        return int(fn(args) or 0)
    except _does_not_fit_type() as e:  # the memory pre-flight refused the run: one line, exit 3
        print(f"ict-jax {args.command}: error: {does_not_fit_line(e)}", file=sys.stderr)
        return EXIT_DOES_NOT_FIT
    except _user_error_types() as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"ict-jax {args.command}: error: {msg}", file=sys.stderr)
        return 2
    except OSError as e:  # the user's paths or disk (a read-only folder, a full disk): one line, not a bug
        if e.errno not in USER_PATH_ERRNOS:
            raise
        print(f"ict-jax {args.command}: error: {os_error_line(e)}", file=sys.stderr, flush=True)
        if from_command_line and e.errno in (errno.ENOSPC, errno.EDQUOT):
            silence_stderr(getattr(e, "log_path", None))
        return 2
    except BrokenPipeError:  # the output went to a pipe that closed (`| head`): not an error of ours
        sys.stderr.close()
        return 0
    except KeyboardInterrupt as e:
        print(f"ict-jax {args.command}: {str(e) or 'interrupted'}", file=sys.stderr)
        return 130
