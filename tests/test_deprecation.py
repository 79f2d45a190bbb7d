"""ict_jax/deprecation.py: the one way an old name or form keeps working, on hand cases (a warning's
category, text and version; an old name is the object at its new home; unknown names still raise), and
that every deprecation of the package goes through it. (Each former name of the package, resolved:
tests/test_foundation.py, tests/rl/test_quantile.py, tests/train/test_programs.py, tests/train/test_warm_start.py,
tests/tools/test_compare.py, tests/sampling/test_draw.py, and the former model-loading names: tests/model/test_loading.py,
tests/train/test_model_source.py.)"""

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
    import ict_jax.train.model_source
    import ict_jax.train.run

    for name in ("model_overrides", "build_model_and_tokenizer"):  # the package's two such names
        with pytest.warns(DeprecationWarning) as caught:
            fn = getattr(ict_jax.train.run, name)
        assert fn is getattr(ict_jax.train.model_source, name)
        assert len(caught) == 1 and ": use ict_jax.resolve_model(config)" in str(caught[0].message)


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


def test_the_packages_old_names_go_through_the_one_mechanism():
    """The package's former names and paths are declared with REMOVED_IN, and no module of the package
    but this one makes a DeprecationWarning itself."""
    import ict_jax
    import ict_jax.aot.hlo
    import ict_jax.config
    import ict_jax.model.loading
    import ict_jax.model.qwen2
    import ict_jax.sampling.sampler
    import ict_jax.train.checkpoints
    import ict_jax.train.model_source
    import ict_jax.train.resume
    import ict_jax.train.run

    for tables in (ict_jax._FORMER, ict_jax.config._FORMER, ict_jax.train.run._FORMER, ict_jax.model.loading._FORMER,
                   ict_jax.train.checkpoints._FORMER, ict_jax.train.model_source._FORMER, ict_jax.aot.hlo._FORMER,
                   ict_jax.model.qwen2._FORMER, ict_jax.sampling.sampler._FORMER, ict_jax.train.resume._FORMER):
        assert tables.removed_in == REMOVED_IN and tables.homes
    assert [f for f in sys.meta_path if isinstance(f, MovedModules) and f.homes == ict_jax._MOVED_MODULES]
    makers = [f"{path.relative_to(PACKAGE)}:{node.lineno}"
              for path in PACKAGE.rglob("*.py") if path.name != "deprecation.py"
              for node in ast.walk(ast.parse(path.read_text()))
              if isinstance(node, ast.Name) and node.id in ("DeprecationWarning", "PendingDeprecationWarning")]
    assert not makers, f"deprecations outside ict_jax.deprecation: {makers}"


def test_importing_the_package_warns_nothing():
    out = subprocess.run([sys.executable, "-W", "error", "-c", "import ict_jax; import ict_jax.deprecation"],
                         capture_output=True, text=True, cwd=PACKAGE.parent)
    assert out.returncode == 0 and out.stderr == "", out.stderr


def test_the_former_chip_table_of_aot_compile_still_reads_with_a_warning():
    import ict_jax.aot.compile as compile_module
    from ict_jax.aot.chips import CHIPS

    with pytest.warns(DeprecationWarning, match=r"ict_jax\.aot\.compile\.CHIP_SPECS is deprecated .* use ict_jax\.aot\.chips\.CHIPS"):
        specs = compile_module.CHIP_SPECS
    assert specs == {"v5e": {"peak_flops": 197e12, "ici_bytes": 400e9, "hbm_bw": 819e9},
                     "v6e": {"peak_flops": 918e12, "ici_bytes": 800e9, "hbm_bw": 1640e9},
                     "v5p": {"peak_flops": 459e12, "ici_bytes": 1200e9, "hbm_bw": 2765e9},
                     "v4": {"peak_flops": 275e12, "ici_bytes": 300e9, "hbm_bw": 1200e9}}  # the former values
    assert specs["v5e"]["peak_flops"] == CHIPS["v5e"].peak_flops
    with pytest.raises(AttributeError, match="has no attribute 'CHIP_SPEC'"):
        compile_module.CHIP_SPEC  # noqa: B018


def test_the_cost_counters_former_names_in_aot_hlo_are_its_names_in_aot_cost():
    import ict_jax.aot.cost as cost_module
    import ict_jax.aot.hlo as hlo_module

    for name in ("Cost", "cost", "dot_flops", "instruction_bytes", "computation_roles", "NO_TRAFFIC", "SLICING"):
        with pytest.warns(DeprecationWarning, match=rf"ict_jax\.aot\.hlo\.{name} is deprecated .* use ict_jax\.aot\.cost\.{name}"):
            assert getattr(hlo_module, name) is getattr(cost_module, name)
    with pytest.raises(AttributeError):
        _ = hlo_module.no_such_name


def test_the_attention_mask_value_read_from_qwen2_is_the_attention_modules():
    import ict_jax.model.attention as attention
    import ict_jax.model.qwen2 as qwen2

    with pytest.warns(DeprecationWarning, match=r"ict_jax\.model\.qwen2\.MASKED is deprecated .* use ict_jax\.model\.attention\.MASKED"):
        assert qwen2.MASKED == attention.MASKED
    assert qwen2.attend is attention.attend  # still used by the model itself: no warning


def test_eval_results_former_suffix_parameter_still_gives_the_samples_path_with_a_warning(tmp_path):
    from ict_jax.train.evaluation import eval_results

    results = eval_results(tmp_path, 3)
    assert results == tmp_path / "eval" / "step_000003.json"
    with pytest.warns(DeprecationWarning, match=r"eval_results\(\.\.\., suffix\) is deprecated .* use "
                                                r"eval_results\(\.\.\.\)\.with_suffix\(suffix\)"):
        assert eval_results(tmp_path, 3, ".jsonl") == tmp_path / "eval" / "step_000003.jsonl"
