"""The layer rule of docs/architecture.md, checked on the import graph of the package (static: every
``import`` and ``from ... import`` in the source, function-local ones included)."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent / "ict_jax"

# package -> what it may import (packages or single modules of ict_jax). docs/architecture.md, "The layer rule".
ALLOWED: dict[str, set[str]] = {
    "config": set(),
    "sharding": set(),
    "platform": set(),
    "outputs": set(),
    "buckets": set(),
    "rewards": set(),
    "data": {"rewards", "model.tokenizers", "buckets"},
    "model": {"config", "sharding"},
    "rl": {"config", "sharding", "buckets"},
    "sampling": {"config", "sharding", "buckets", "model", "data", "rewards", "outputs"},
    "train": {"config", "sharding", "buckets", "model", "data", "rewards", "rl", "sampling", "outputs"},
    "aot": {"config", "sharding", "buckets", "platform", "outputs", "model", "data", "rewards", "rl", "sampling",
            "train"},
    "tools": {"config", "sharding", "buckets", "platform", "outputs", "model", "data", "rewards", "rl", "sampling",
              "train", "aot"},
    "cli": {"config", "sharding", "buckets", "platform", "outputs", "model", "data", "rewards", "rl", "sampling",
            "train", "tools", "aot", "cli", ""},
}


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for f in ROOT.rglob("*.py"):
        parts = f.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f  # "" is the package itself
    return out


MODULES = _modules()
# an empty or wrong glob would make every test below pass on nothing
assert len(MODULES) > 50 and {"", "config", "rl.selectors", "cli.main"} <= set(MODULES), sorted(MODULES)


def _imports(name: str, path: pathlib.Path) -> list[tuple[str, str | None, int]]:
    """(imported module relative to ict_jax, imported name or None, line) for every ict_jax import."""
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against the package
                up = pkg.split(".")[: max(0, len(pkg.split(".")) - node.level + 1)] if pkg else []
                base = ".".join(["ict_jax", *filter(None, up), *([base] if base else [])])
            if base != "ict_jax" and not base.startswith("ict_jax."):
                continue
            rel = base[len("ict_jax."):] if base != "ict_jax" else ""
            for a in node.names:
                sub = f"{rel}.{a.name}" if rel else a.name
                if sub in MODULES:  # `from ict_jax.data import prompts` imports a module
                    found.append((sub, None, node.lineno))
                else:
                    found.append((rel, a.name, node.lineno))
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "ict_jax" or a.name.startswith("ict_jax."):
                    found.append((a.name[len("ict_jax."):] if a.name != "ict_jax" else "", None, node.lineno))
    return found


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _package(module: str) -> str:
    return module.split(".")[0] if module else ""


def _allowed(src: str, dst: str) -> bool:
    sp, dp = _package(src), _package(dst)
    if sp == "":  # the top-level facade imports lazily by string, nothing statically
        return False
    if sp == dp:
        return True
    rules = ALLOWED[sp]
    return dp in rules or dst in rules


def test_every_module_is_in_a_layer():
    assert len(MODULES) > 50 and all(GRAPH[m] for m in ("rl.selectors", "train.trainer")), "the walk found no imports"
    assert {_package(m) for m in MODULES} - {""} <= set(ALLOWED), "a new package needs a row in ALLOWED"


def test_no_upward_import():
    bad = [f"ict_jax.{src} imports ict_jax.{dst or '(top level)'} (line {line})"
           for src, imps in GRAPH.items() for dst, _name, line in imps if dst != src and not _allowed(src, dst)]
    assert not bad, "imports that break the layer rule of docs/architecture.md:\n" + "\n".join(bad)


def test_nothing_imports_the_cli():
    bad = [f"ict_jax.{src} imports ict_jax.{dst}" for src, imps in GRAPH.items() if _package(src) != "cli"
           for dst, _n, _l in imps if _package(dst) == "cli"]
    assert not bad, "\n".join(bad)


def test_no_private_name_crosses_a_module_boundary():
    bad = [f"ict_jax.{src} imports {name} from ict_jax.{dst} (line {line})" for src, imps in GRAPH.items()
           for dst, name, line in imps if name and name.startswith("_") and not name.startswith("__") and dst != src]
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    edges = {src: {dst for dst, _n, _l in imps if dst in MODULES and dst != src and dst != ""}
             for src, imps in GRAPH.items()}
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[str] = []

    def visit(u: str) -> None:
        state[u] = 1
        stack.append(u)
        for v in sorted(edges.get(u, ())):
            if state.get(v) == 1:
                cycles.append(" -> ".join(stack[stack.index(v):] + [v]))
            elif v not in state:
                visit(v)
        stack.pop()
        state[u] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_library_modules_do_not_import_the_facade():
    """Library modules import from the defining module; ``ict_jax.X`` lazy names are for users (the CLI
    may read ``ict_jax.__version__``)."""
    bad = [f"ict_jax.{src} line {line}: from ict_jax import {n}" for src, imps in GRAPH.items()
           if _package(src) not in ("", "cli") for dst, n, line in imps if dst == "" and n]
    assert not bad, "\n".join(bad)


def test_every_import_names_a_module_that_exists():
    """``from .rewards import X`` in ``sampling/`` resolves to ``ict_jax.sampling.rewards``: a module
    that does not exist fails only on the path that runs it."""
    bad = [f"ict_jax.{src} line {line}: ict_jax.{dst} does not exist" for src, imps in GRAPH.items()
           for dst, _n, line in imps if dst not in MODULES]
    assert not bad, "\n".join(bad)


def test_the_cli_parser_builds_without_the_library():
    """``ict-jax --help`` and every subcommand's parser import neither JAX nor Flax (docs/architecture.md:
    the cli modules import the library lazily)."""
    import subprocess
    import sys

    code = ("import sys; from ict_jax.cli.main import build_parser; build_parser(); "
            "print(sorted(m for m in ('jax', 'flax', 'optax', 'orbax') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=ROOT.parent).stdout.strip()
    assert out == "[]", out
