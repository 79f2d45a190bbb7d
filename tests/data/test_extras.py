"""The optional extras of the data sources: which spec needs which, the check that imports nothing, and the
one-line error that names the extra (reasoning-gym's absence simulated with ``sys.modules[name] = None``,
which makes both ``importlib.util.find_spec`` and ``import`` report it missing)."""

from __future__ import annotations

import sys

import pytest

from ict_jax.data.datasets import load_dataset
from ict_jax.data.extras import EXTRAS, MissingExtra, check_extras, extra_of, require

GYM_LINE = ("'gym:chain_sum?size=4' needs the gym extra (reasoning-gym), which is not installed: "
            "pip install -e '.[gym]' in the ict_jax checkout (it builds a few packages from source and needs a C "
            "compiler)")


def test_each_source_names_its_extra():
    assert extra_of("gym:chain_sum?size=4").name == "gym"
    assert extra_of(" tfds:gsm8k").name == "tfds"
    assert [extra_of(s) for s in ("split", "arith?size=8", "gsm8k_test", "file:x.jsonl?reward=gsm8k")] == [None] * 4
    # every extra named here is an extra of pyproject.toml that installs the module's distribution
    import tomllib
    from pathlib import Path

    extras = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())[
        "project"]["optional-dependencies"]
    for extra in EXTRAS.values():
        assert any(req.startswith(extra.distribution) for req in extras[extra.name]), extra


def test_a_missing_extra_is_one_line_naming_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)
    with pytest.raises(MissingExtra) as e:
        check_extras(["split", "gym:chain_sum?size=4"])
    assert str(e.value) == GYM_LINE
    assert isinstance(e.value, ImportError)  # code that catches ImportError keeps working
    check_extras(["split", "arith", "file:tasks.jsonl"])  # the sources that need no extra pass
    with pytest.raises(MissingExtra, match=r"^reasoning-gym \(the gym extra\) is not installed: pip install -e "
                                           r"'\.\[gym\]' in the ict_jax checkout"):
        require("gym")
    with pytest.raises(MissingExtra, match=r"the gym extra"):
        load_dataset("gym:chain_sum?size=4")  # the library's own path says the same


def test_an_installed_extra_passes_and_is_imported():
    pytest.importorskip("reasoning_gym")
    check_extras(["gym:chain_sum?size=4"])
    assert require("gym").__name__ == "reasoning_gym"
    assert len(load_dataset("gym:chain_sum?size=4")) == 4
