"""ict_jax/deprecation.py: the one way an old name or form keeps working, on hand cases (a warning's
category, text and version; an old name is the object at its new home; unknown names still raise), and
that no other module of the package makes a deprecation warning itself."""

from __future__ import annotations

import ast
import importlib
import json
import os.path
import pathlib
import subprocess
import sys
import types
import warnings

import pytest

from ict_jax import deprecation
from ict_jax.deprecation import REMOVED_IN, MovedModules, MovedNames, message, warn

PACKAGE = pathlib.Path(deprecation.__file__).resolve().parent


def test_the_one_text_names_the_old_name_its_replacement_and_the_version():
    assert REMOVED_IN == "0.3.0"
    assert message("ict_jax.pad_left", "ict_jax.data.prompts.pad_left", "0.3.0") == (
        "ict_jax.pad_left is deprecated and will be removed in ict_jax 0.3.0: use ict_jax.data.prompts.pad_left")


def test_warn_is_a_deprecation_warning_pointed_at_the_caller_of_the_deprecated_function():
    def old_function():
        warn("ict_jax.old_function", "ict_jax.new_function", removed_in="0.4.0")

    with pytest.warns(DeprecationWarning) as caught:
        old_function()
    assert len(caught) == 1 and caught[0].category is DeprecationWarning
    assert str(caught[0].message) == (
        "ict_jax.old_function is deprecated and will be removed in ict_jax 0.4.0: use ict_jax.new_function")
    assert caught[0].filename == __file__  # this line's file, not deprecation.py or old_function's body
    with pytest.raises(TypeError):
        warn("a", "b")  # the version is always declared


def test_moved_names_resolve_to_the_same_object_with_a_warning():
    former = MovedNames("pkg.old", {"dumps": "json.dumps", "join_paths": "os.path.join"}, removed_in="0.3.0")
    assert "dumps" in former and "loads" not in former
    with pytest.warns(DeprecationWarning, match=r"^pkg\.old\.dumps is deprecated and will be removed in ict_jax "
                                                r"0\.3\.0: use json\.dumps$"):
        assert former.resolve("dumps") is json.dumps
    with pytest.warns(DeprecationWarning, match="pkg.old.join_paths .* use os.path.join"):  # renamed
        assert former.resolve("join_paths") is os.path.join


def test_a_moved_name_whose_new_home_is_deprecated_names_the_replacement_in_its_warning():
    former = MovedNames("pkg.old", {"dumps": "json.dumps"}, removed_in="0.3.0", use={"dumps": "json.dump(obj, f)"})
    with pytest.warns(DeprecationWarning) as caught:
        assert former.resolve("dumps") is json.dumps  # still the object at the (deprecated) new home
    assert [str(w.message) for w in caught] == [
        "pkg.old.dumps is deprecated and will be removed in ict_jax 0.3.0: use json.dump(obj, f)"]


def test_a_modules_getattr_through_moved_names_warns_at_the_reader_and_unknown_names_raise():
    module = types.ModuleType("pkg.old")
    former = MovedNames(module.__name__, {"dumps": "json.dumps"}, removed_in="0.3.0")
    module.__getattr__ = lambda name: former.resolve(name)  # PEP 562, as the package's modules do
    with pytest.warns(DeprecationWarning, match="pkg.old.dumps is deprecated") as caught:
        assert module.dumps is json.dumps
    assert caught[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an unknown name warns nothing
        with pytest.raises(AttributeError, match=r"^module 'pkg.old' has no attribute 'loads'$"):
            module.loads  # noqa: B018
        assert not hasattr(module, "loads")


def test_moved_modules_import_the_module_at_its_new_home_with_a_warning():
    finder = MovedModules({"ict_jax_old_json_home": "json"}, removed_in="0.3.0")
    try:
        finder.install()
        finder.install()  # once per table
        assert sum(f is finder for f in sys.meta_path) == 1
        with pytest.warns(DeprecationWarning, match=r"^ict_jax_old_json_home is deprecated and will be removed in "
                                                    r"ict_jax 0\.3\.0: use json$"):
            assert importlib.import_module("ict_jax_old_json_home") is json
        assert finder.find_spec("ict_jax_other_name", None) is None
    finally:
        sys.meta_path.remove(finder)
        sys.modules.pop("ict_jax_old_json_home", None)


def test_no_module_but_deprecation_makes_a_deprecation_warning():
    """A deprecation goes through ict_jax.deprecation: no other module of the package names the warning."""
    makers = [f"{path.relative_to(PACKAGE)}:{node.lineno}"
              for path in PACKAGE.rglob("*.py") if path.name != "deprecation.py"
              for node in ast.walk(ast.parse(path.read_text()))
              if isinstance(node, ast.Name) and node.id in ("DeprecationWarning", "PendingDeprecationWarning")]
    assert not makers, f"deprecations outside ict_jax.deprecation: {makers}"


def test_importing_the_package_warns_nothing():
    out = subprocess.run([sys.executable, "-W", "error", "-c", "import ict_jax; import ict_jax.deprecation"],
                         capture_output=True, text=True, cwd=PACKAGE.parent)
    assert out.returncode == 0 and out.stderr == "", out.stderr
