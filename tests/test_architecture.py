"""The layer rule of docs/architecture.md, checked on the import graph of the package (static: every
``import`` and ``from ... import`` in the source, function-local ones included)."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent / "ict_jax"

# package -> what it may import (packages or single modules of ict_jax). docs/architecture.md, "The layer rule".
ALLOWED: dict[str, set[str]] = {
    "deprecation": set(),
    "config_coerce": set(),
    "config": {"config_coerce"},
    "config_overrides": {"config"},
    "config_load": {"config", "config_overrides"},
    "sharding": set(),
    "platform": set(),
    "outputs": set(),
    "memory": set(),
    "rng": set(),
    "buckets": set(),
    "heartbeat": set(),
    "interrupts": set(),
    "install": set(),
    "rewards": set(),
    "data": {"rewards", "model.tokenizers", "rng", "buckets", "install"},
    "model": {"config", "sharding", "rng", "deprecation", "install"},
    "rl": {"config", "sharding", "rng", "buckets"},
    "sampling": {"config", "sharding", "rng", "buckets", "model", "data", "rewards", "outputs", "heartbeat",
                 "deprecation"},
    "train": {"config", "config_load", "sharding", "rng", "buckets", "model", "data", "rewards", "rl", "sampling", "outputs",
              "memory", "heartbeat", "interrupts", "deprecation", "install"},
    "aot": {"config", "config_load", "sharding", "rng", "buckets", "platform", "outputs", "memory", "model", "data", "rewards", "rl",
            "sampling", "train", "heartbeat", "deprecation", "install"},
    "experiments": {"config", "config_load", "sharding", "rng", "buckets", "platform", "outputs", "memory", "model", "data",
                    "rewards", "rl", "sampling", "train", "aot", "heartbeat", "deprecation", "install"},
    "diagnostics": {"config", "config_load", "sharding", "rng", "buckets", "platform", "outputs", "memory", "model", "data",
                    "rewards", "rl", "sampling", "train", "aot", "heartbeat", "deprecation", "install",
                    "experiments.stats"},
    "cli": {"config", "config_coerce", "config_load", "config_overrides", "sharding", "rng", "buckets", "platform", "outputs", "memory", "model", "data", "rewards",
            "rl", "sampling", "train", "experiments", "diagnostics", "aot", "cli", "heartbeat", "interrupts", "deprecation", "install", ""},
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


#: the library's core and the lab on top of it (docs/architecture.md, "The layer rule")
CORE = ("model", "data", "rewards", "rl", "sampling", "train")
LAB = ("experiments", "diagnostics")


def test_the_core_never_imports_the_lab():
    """The core (model, data, rewards, rl, sampling, train) never imports ``experiments`` or ``diagnostics``:
    the lab builds on the library, never the other way round."""
    assert set(CORE) | set(LAB) <= set(ALLOWED) and all(_package(m) in LAB for m in ("experiments.runner",
                                                                                     "diagnostics.diagnose"))
    assert not [p for p in CORE if set(LAB) & {r.split(".")[0] for r in ALLOWED[p]}], "ALLOWED lets the core import the lab"
    bad = [f"ict_jax.{src} imports ict_jax.{dst} (line {line})" for src, imps in GRAPH.items() if _package(src) in CORE
           for dst, _n, line in imps if _package(dst) in LAB]
    assert not bad, "\n".join(bad)
    assert not list((ROOT / "tools").glob("*.py")), "ict_jax/tools/ was split into experiments/ and diagnostics/"


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


#: calls that change a container in place
_MUTATORS = {"add", "update", "append", "extend", "insert", "setdefault", "pop", "popitem", "clear", "remove", "discard"}


def _writes_into(tree: ast.AST, names: set[str], modules: set[str]) -> list[int]:
    """Lines of ``tree`` that write into ``names`` (objects imported from config) or an attribute of
    ``modules`` (config imported as a module): an assignment to an attribute or an item, a mutating call,
    ``setattr``."""
    def target(node: ast.AST) -> bool:
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            return node.value.id in modules or node.value.id in names
        if isinstance(node, ast.Subscript):
            return isinstance(node.value, ast.Name) and node.value.id in names or target(node.value)
        return False

    lines = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            lines += [node.lineno for t in targets if target(t)]
        elif isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Attribute) and f.attr in _MUTATORS and (
                    isinstance(f.value, ast.Name) and f.value.id in names or target(f.value)):
                lines.append(node.lineno)
            if isinstance(f, ast.Name) and f.id in ("setattr", "delattr") and node.args and (
                    isinstance(node.args[0], ast.Name) and node.args[0].id in names | modules):
                lines.append(node.lineno)
    return lines


def test_nothing_below_train_writes_into_config():
    """docs/architecture.md: model, data, rewards and rl never write into ``ict_jax.config`` (a registry lives
    at its home; the config holds no list a registration extends), and no function of config changes one of
    config's module-level objects."""
    bad = []
    for name, path in MODULES.items():
        if _package(name) not in ("model", "data", "rewards", "rl"):
            continue
        tree = ast.parse(path.read_text())
        names, modules = set(), set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "ict_jax.config":
                names |= {a.asname or a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module == "ict_jax":
                modules |= {a.asname or a.name for a in node.names if a.name == "config"}
            elif isinstance(node, ast.Import):
                modules |= {a.asname for a in node.names if a.name == "ict_jax.config" and a.asname}
        bad += [f"ict_jax.{name} line {line}" for line in _writes_into(tree, names, modules)]
    config = ast.parse(MODULES["config"].read_text())
    top = {t.id for node in config.body if isinstance(node, (ast.Assign, ast.AnnAssign))
           for t in (node.targets if isinstance(node, ast.Assign) else [node.target]) if isinstance(t, ast.Name)}
    for fn in (n for n in ast.walk(config) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
        bad += [f"ict_jax.config line {line} (in {fn.name})" for line in _writes_into(fn, top, set())]
        bad += [f"ict_jax.config line {n.lineno} (global in {fn.name})" for n in ast.walk(fn) if isinstance(n, ast.Global)]
    assert not bad, "writes into ict_jax.config from below train/:\n" + "\n".join(bad)


def test_the_write_check_finds_a_registration_into_config():
    tree = ast.parse("from ict_jax.config import EXTRA\ndef allow(n):\n    EXTRA.add(n)\n    EXTRA['a'] = 1\n")
    assert _writes_into(tree, {"EXTRA"}, set()) == [3, 4] or sorted(_writes_into(tree, {"EXTRA"}, set())) == [3, 4]
    assert _writes_into(ast.parse("import ict_jax.config as c\nc.X = 1\n"), set(), {"c"}) == [2]


def test_every_command_resolves_its_model_through_one_function():
    """docs/architecture.md "One model resolver": the commands that take a model (and the run's parts, and
    compile) import ``train.model_source.resolve_model``."""
    for module in ("cli.eval", "cli.sample", "cli.inspect", "cli.diagnose", "cli.export", "aot.compile",
                   "train.parts", "train.export"):
        assert ("train.model_source", "resolve_model") in {(d, n) for d, n, _ in GRAPH[module]}, module


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


# ------------------------------------------------------------------------------------------------
# docs/architecture.md stays true: its layer table is this file's, the modules it names exist
# ------------------------------------------------------------------------------------------------
DOC = ROOT.parent / "docs" / "architecture.md"


def _top_level_names(cell: str) -> list[str]:
    """The backticked names of a table cell outside parentheses (``a`` (about `x`), ``b``: a, b)."""
    names, depth, i = [], 0, 0
    while i < len(cell):
        c = cell[i]
        if c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
        elif c == "`":
            j = cell.index("`", i + 1)
            if depth == 0:
                names.append(cell[i + 1:j])
            i = j
        i += 1
    return names


def _doc_table(header: str) -> list[list[str]]:
    """The rows (cells) of the Markdown table of docs/architecture.md whose header row starts with ``header``."""
    lines = DOC.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    assert rows, f"no rows under {header!r} in {DOC}"
    return rows


def test_the_layer_table_of_the_docs_is_the_one_checked_here():
    doc: dict[str, set[str]] = {}
    for who, may in _doc_table("| package | may import |"):
        allowed = set(ALLOWED) | {""} if may.startswith("everything") else set(_top_level_names(may))
        for package in _top_level_names(who):
            doc[package] = allowed
    assert doc == ALLOWED


def test_every_module_the_package_map_names_exists_and_every_module_is_named():
    named = set()
    for row in _doc_table("| package | concept |"):
        package = _top_level_names(row[0])[0].rstrip("/")
        prefix = "" if package == "ict_jax" else f"{package}."
        for name in _top_level_names(row[2]):
            named.add(prefix.rstrip(".") if name == "__init__" else prefix + name)
    assert len(named) > 50
    assert not named - set(MODULES), f"named in docs/architecture.md but missing: {sorted(named - set(MODULES))}"
    # every module file (package __init__ files and ``python -m ict_jax.cli``'s __main__ aside) is on the map
    files = {m for m, path in MODULES.items() if path.name not in ("__init__.py", "__main__.py")}
    assert not files - named, f"modules the package map of docs/architecture.md does not name: {sorted(files - named)}"


def test_every_name_on_the_data_path_resolves():
    """Each dotted name in the data-path diagram (``train.rollout.collect_rollout``) is a module of
    ict_jax and an attribute chain on it."""
    import importlib
    import re

    text = DOC.read_text()
    block = text[text.index("## The data path"):]
    block = block[block.index("```") + 3:]
    block = block[:block.index("```")]
    packages = {p for p in ALLOWED if p}
    names = {m for m in re.findall(r"\b[a-z_]+(?:\.[A-Za-z_]+)+\b", block) if m.split(".")[0] in packages}
    assert len(names) > 20, names
    bad = []
    for name in sorted(names):
        parts = name.split(".")
        k = max(i for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in MODULES)
        obj = importlib.import_module("ict_jax." + ".".join(parts[:k]))
        for attr in parts[k:]:
            if not hasattr(obj, attr):
                bad.append(name)
                break
            obj = getattr(obj, attr)
    assert not bad, f"docs/architecture.md's data path names what does not exist: {bad}"


def test_no_function_is_over_80_lines():
    """One idea per function: none in the package is longer than 80 lines, its docstring included."""
    long = [f"ict_jax/{path.relative_to(ROOT)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for path in MODULES.values() for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 80]
    assert not long, "functions over 80 lines:\n" + "\n".join(long)


def test_the_trainer_keeps_the_loop_only():
    """``Trainer`` stays a loop with hooks (under 200 lines; the parts live in train/'s modules)."""
    tree = ast.parse(MODULES["train.trainer"].read_text())
    trainer = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Trainer")
    assert trainer.end_lineno - trainer.lineno + 1 < 200


# ------------------------------------------------------------------------------------------------
# The tests mirror the package: tests/<subpackage>/test_<module>.py
# ------------------------------------------------------------------------------------------------
TESTS = ROOT.parent / "tests"
#: test files of a subpackage's folder that test more than one of its modules (or a real model), each with why
ACROSS_MODULES = {
    "cli/test_inputs.py": "bad input to every command: one line and the exit code (cli.main and each command)",
    "cli/test_compare_plan_cli.py": "cli.compare's --plan front end (experiments/test_compare.py holds the module "
                                    "name test_compare: pytest collects one module of a base name)",
    "model/test_real_qwen.py": "the real Qwen2.5 weights through loading, the model and the tokenizer",
    "rewards/test_rewards.py": "the answer checks and the worker pool that runs them",
    "rl/test_lora_train_step.py": "rl.train_step on a model with LoRA adapters (model.lora)",
    "train/test_lora_run.py": "a LoRA run end to end: the trainer, its checkpoints and base (train.lora_base), "
                              "resume, compile and the commands that read it",
    "train/test_lora_real.py": "the real Qwen2.5-0.5B through a LoRA run, its resume and its PEFT export (slow)",
    "sampling/test_decode_bytes.py": "the compiled sampler's decode step (sampling.sampler) read through the "
                                     "HLO byte count of aot.roofline",
    "model/test_matmul_dtype.py": "the matmuls' result dtype (model.qwen2, rl.token_stats' head) read through the "
                                  "bf16 train step's HLO (aot.hlo.upcast_matmuls)",
    "rl/test_stats_bytes.py": "the statistics pass (rl.token_stats) read through the TPU compiler's HLO byte "
                              "count (aot.cost)",
}
#: test files at the top of tests/: the project as a whole, a top-level module of ict_jax, or a test-support
#: module at the top of tests/ (test_covering.py: covering.py, the slow matrices' covering designs), or a
#: benchmark the default suite runs (test_accelerator_benchmark.py: benchmarks/accelerator.py --smoke)
TOP_LEVEL = {"test_architecture.py", "test_docs.py", "test_notebooks.py", "test_configs.py", "test_demo.py",
             "test_foundation.py", "test_covering.py", "test_accelerator_benchmark.py", "test_real_model_guard.py"}
DATA_FOLDERS = {"rl/golden"}  # reference data, not tests


def test_the_tests_mirror_the_package():
    """Every test folder is a subpackage of ict_jax and every test file in it is named after one of its
    modules (or listed in ACROSS_MODULES with why); the top holds the project-wide tests and those of
    ict_jax's top-level modules."""
    files = sorted(p.relative_to(TESTS).as_posix() for p in TESTS.rglob("test_*.py")
                   if not any(p.relative_to(TESTS).as_posix().startswith(d + "/") for d in DATA_FOLDERS))
    assert len(files) >= 35, files  # the glob found the tests (an empty glob would pass everything below)
    wrong = []
    for rel in files:
        folder, _, name = rel.rpartition("/")
        module = name[len("test_"):-len(".py")]
        if not folder:
            ok = name in TOP_LEVEL or (ROOT / f"{module}.py").is_file()
        else:
            ok = (ROOT / folder / "__init__.py").is_file() and (
                (ROOT / folder / f"{module}.py").is_file() or rel in ACROSS_MODULES)
        if not ok:
            wrong.append(rel)
    assert not wrong, f"test files that name no module of their folder's subpackage: {wrong}"
    assert set(ACROSS_MODULES) <= set(files), set(ACROSS_MODULES) - set(files)
    # a test one folder down finds the repository at parents[2]; parent.parent is tests/ there
    stale = [rel for rel in files if "/" in rel and ".parent.parent" in (TESTS / rel).read_text()]
    assert not stale, f"tests that look for the repository in tests/: {stale}"
