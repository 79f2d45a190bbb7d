"""The suite's guard on real models (tests/conftest.py): a test that resolves a real Qwen2.5 must carry
the ``real_model`` marker, because CI runs those tests one at a time (.ci/run)."""

import pytest

from conftest import real_model_guard  # tests/ is on sys.path under pytest
from ict_jax.model.packaged import KNOWN_MODELS, resolve_path


class _Item:
    def __init__(self, nodeid: str, markers: set[str]):
        self.nodeid, self.markers = nodeid, markers

    def get_closest_marker(self, name: str):
        return object() if name in self.markers else None


def test_an_unmarked_test_that_resolves_a_real_model_fails_before_it_loads():
    # this test itself is unmarked: the guard installed by conftest refuses, whether or not the parts exist
    for name in KNOWN_MODELS:
        with pytest.raises(pytest.fail.Exception, match=r"without the real_model marker: mark it @pytest\.mark\.real_model"):
            resolve_path(name)
    spec = "pkg:" + next(iter(KNOWN_MODELS.values())).prefix  # the same model by its part packages' prefix
    with pytest.raises(pytest.fail.Exception, match="real_model"):
        resolve_path(spec)


def test_the_guard_lets_marked_tests_and_other_models_through():
    name = next(iter(KNOWN_MODELS))
    assert real_model_guard(name, item=_Item("t::marked", {"real_model", "slow"})) is None
    with pytest.raises(pytest.fail.Exception, match=r"t::unmarked resolves the real model"):
        real_model_guard(name, item=_Item("t::unmarked", {"slow"}))
    # parts of any other prefix (the packaging tests' fake split models) are not real models
    assert real_model_guard("pkg:fakesplit-guard", item=_Item("t::unmarked", set())) is None
