"""ict_jax.model.weights.written_aside: a weight directory appears whole at its path or not at all."""

from __future__ import annotations

import os

import pytest

from ict_jax.model.weights import written_aside


def _entries(folder):
    return sorted(p.name for p in folder.iterdir())


@pytest.mark.parametrize("exists_empty", [False, True])
def test_a_finished_block_puts_the_folder_at_its_path_with_the_users_umask(tmp_path, exists_empty):
    path = tmp_path / "out" / "model"
    if exists_empty:
        path.mkdir(parents=True)
    old = os.umask(0o027)
    try:
        with written_aside(path, "save_x") as tmp:
            assert tmp.parent == path.parent and tmp != path and not path.is_file()
            (tmp / "config.json").write_text("{}")
            (tmp / "sub").mkdir()
    finally:
        os.umask(old)
    assert _entries(path) == ["config.json", "sub"]
    assert _entries(path.parent) == ["model"]  # no temporary folder left beside it
    assert path.stat().st_mode & 0o777 == 0o750 and (path / "sub").stat().st_mode & 0o777 == 0o750
    assert (path / "config.json").stat().st_mode & 0o777 == 0o640


@pytest.mark.parametrize("error", [RuntimeError("disk full"), KeyboardInterrupt()])
def test_an_error_in_the_block_leaves_nothing_at_the_path_and_no_temporary_folder(tmp_path, error):
    path = tmp_path / "model"
    with pytest.raises(type(error)):
        with written_aside(path, "save_x") as tmp:
            (tmp / "model.safetensors").write_bytes(b"half")
            raise error
    assert not path.exists() and _entries(tmp_path) == []


def test_a_non_empty_path_is_refused_before_the_block_runs_and_kept_as_it_was(tmp_path):
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text("mine")
    ran = []
    with pytest.raises(FileExistsError, match=r"save_x: .*model.* exists and is not empty"):
        with written_aside(path, "save_x"):
            ran.append(1)
    assert ran == [] and _entries(tmp_path) == ["model"] and (path / "config.json").read_text() == "mine"
