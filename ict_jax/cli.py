"""``ict-jax``: a thin command-line front end. Parses arguments and dispatches; the work lives in the
library modules. User errors (bad config, missing files, bad shapes) print one line and exit with 2."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Callable, Sequence

# subcommand -> (module, add_args function, main function, one-line help). Modules import lazily so
# `ict-jax info` does not pay for the trainer's imports.
COMMANDS: dict[str, tuple[str, str, str, str]] = {
    "info": ("ict_jax.cli", "add_info_args", "info_main", "print devices, the mesh and the model presets"),
    "export": ("ict_jax.checkpoint", "add_export_args", "export_main", "checkpoint -> Hugging Face safetensors"),
    "eval": ("ict_jax.eval_cli", "add_eval_args", "eval_main", "pass@k of a model on benchmarks (METHOD §6)"),
    "train": ("ict_jax.train_cli", "add_train_args", "train_main", "RL training (SFT warm start first if configured)"),
    "sample": ("ict_jax.cli_sample", "add_sample_args", "sample_main", "sample G responses to a prompt"),
    "sft": ("ict_jax.train_cli", "add_sft_args", "sft_main", "supervised warm start only; writes <run_dir>/sft_model"),
    "compare": ("ict_jax.compare", "add_compare_args", "compare_main", "every method x seed from one warm start: table + plots"),
    "inspect": ("ict_jax.inspect_tokens", "add_inspect_args", "inspect_main", "HTML page of a group's tokens: JS/H1/H2, ICT/entropy/STAPO masks"),
}


class UserError(Exception):
    """An error caused by the user's input: reported as one line, exit code 2."""


def add_info_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mesh", default="-1,1,1", metavar="DATA,FSDP,TENSOR",
                   help="mesh shape to build and show (-1 = the rest of the devices); default -1,1,1")


def info_main(args: argparse.Namespace) -> int:
    import jax

    from ict_jax import ModelConfig, __version__, make_mesh, param_count

    try:
        sizes = [int(x) for x in args.mesh.split(",")]
    except ValueError:
        raise UserError(f"--mesh {args.mesh!r}: expected three integers DATA,FSDP,TENSOR") from None
    if len(sizes) != 3:
        raise UserError(f"--mesh {args.mesh!r}: expected three integers DATA,FSDP,TENSOR")
    mesh = make_mesh(*sizes)
    devs = jax.devices()
    print(f"ict_jax {__version__}  jax {jax.__version__}  backend {jax.default_backend()}  "
          f"processes {jax.process_count()}")
    print(f"devices ({len(devs)}): " + ", ".join(f"{d.platform}:{d.id}" for d in devs[:16])
          + (" ..." if len(devs) > 16 else ""))
    print("mesh: " + " x ".join(f"{k}={v}" for k, v in mesh.shape.items()))
    print("model presets:")
    print(f"  {'name':<14}{'params':>16}{'layers':>8}{'width':>7}{'heads':>7}{'kv':>4}{'vocab':>9}  head")
    for name in ("tiny", "qwen2p5_0p5b", "qwen2p5_1p5b", "qwen2p5_7b"):
        c = ModelConfig.preset(name)
        print(f"  {name:<14}{param_count(c):>16,}{c.num_layers:>8}{c.hidden_size:>7}{c.num_heads:>7}"
              f"{c.num_kv_heads:>4}{c.vocab_size:>9}  {'tied' if c.tie_word_embeddings else 'untied'}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ict-jax", description="RLVR on Qwen2.5 in JAX: ICT and its baselines (GRPO, 20-Entropy, STAPO, random).")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, add_fn, _main, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        getattr(importlib.import_module(module), add_fn)(p)
    return parser


def _user_error_types() -> tuple[type[BaseException], ...]:
    from ict_jax.config import ConfigError

    # ValueError covers the library's input checks (mesh shapes, configs, checkpoints); set
    # ICT_JAX_DEBUG=1 to get the traceback instead.
    types: list[type[BaseException]] = [UserError, ConfigError, FileNotFoundError, FileExistsError, ValueError]
    for module, name in (("ict_jax.data", "DataError"), ("ict_jax.model.weights", "WeightError")):
        try:
            types.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            pass
    return tuple(types)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
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
    module, _add, main_fn, _help = COMMANDS[args.command]
    fn: Callable[[argparse.Namespace], int] = getattr(importlib.import_module(module), main_fn)
    if os.environ.get("ICT_JAX_DEBUG"):
        return int(fn(args) or 0)
    try:
        return int(fn(args) or 0)
    except _user_error_types() as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"ict-jax {args.command}: error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"ict-jax {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
