"""ict_jax.install: the one install line of an optional extra, from the checkout (ict_jax is on no index);
the messages that name an extra give it (the data sources' in tests/data/test_extras.py, W&B's in
tests/train/test_record.py, a known model's in tests/model/test_packaged.py)."""

from __future__ import annotations

from ict_jax.install import install_line


def test_the_install_line_installs_from_the_checkout():
    assert install_line("gym") == "pip install -e '.[gym]' in the ict_jax checkout"
    assert install_line("qwen2-5-coder-0-5b,gym") == "pip install -e '.[qwen2-5-coder-0-5b,gym]' in the ict_jax checkout"


def test_the_tpu_hint_is_the_install_line():
    from ict_jax.aot.compile import TPU_EXTRA

    assert TPU_EXTRA == install_line("tpu")
