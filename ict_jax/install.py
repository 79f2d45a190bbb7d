"""How to install an optional extra of ict_jax, the one line every message gives: ict_jax is on no package
index, so an extra comes from the checkout (``pip install -e '.[gym]'`` in it), never from
``pip install 'ict_jax[gym]'``, which pip would look up on an index. The extras are pyproject.toml's
``[project.optional-dependencies]``.

Imports nothing of ict_jax: every layer may use it.
"""

from __future__ import annotations

__all__ = ["install_line"]


def install_line(extra: str) -> str:
    """``pip install -e '.[gym]' in the ict_jax checkout``: the command that installs the extra ``extra``
    (a name of pyproject.toml's optional dependencies, or several joined by commas)."""
    return f"pip install -e '.[{extra}]' in the ict_jax checkout"
