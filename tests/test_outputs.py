"""ict_jax.outputs.hold_output_dir: one process at a time holds an output folder; a second is refused at
once naming the holder; the kernel releases the hold when the holder dies, so a lock file left behind by a
killed process is never in the way."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from ict_jax.outputs import OutputInUse, OutputLocationError, held_by, hold_output_dir

HOLDER = """
import sys, time
from ict_jax.outputs import hold_output_dir
with hold_output_dir(sys.argv[1], "out"):
    print("held", flush=True)
    time.sleep(120)
"""


def test_a_second_holder_is_refused_naming_the_first(tmp_path):
    folder = tmp_path / "exp"
    with hold_output_dir(folder, "out") as held:
        assert held == folder and folder.is_dir()
        with pytest.raises(OutputInUse, match=rf"out '.*exp' is in use by process {os.getpid()} on .* since "):
            with hold_output_dir(folder, "out"):
                pass
    with hold_output_dir(folder, "out"):  # released at the end of the block
        pass


def test_a_killed_holder_leaves_nothing_in_the_way(tmp_path):
    folder = tmp_path / "exp"
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder)], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "held"
        with pytest.raises(OutputInUse, match=rf"process {p.pid} "):
            with hold_output_dir(folder, "out"):
                pass
        assert held_by(folder).startswith(f"process {p.pid} on ")  # read without the lock
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    deadline = time.time() + 10
    while True:  # the lock file is still there, with the dead holder's description: no matter
        try:
            with hold_output_dir(folder, "out"):
                break
        except OutputInUse:
            assert time.time() < deadline
            time.sleep(0.1)
    assert (folder / ".lock").is_file()
    assert held_by(folder) is None  # the file still names the dead holder: the kernel's table decides


@pytest.mark.parametrize("proc_locks", [True, False])
def test_who_holds_a_folder_is_read_without_the_lock(tmp_path, monkeypatch, proc_locks):
    from pathlib import Path

    if not proc_locks:  # elsewhere than Linux: the lock file's process, when it is alive on this host
        real = Path.read_text
        monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: (_ for _ in ()).throw(OSError("no /proc"))
                            if str(self) == "/proc/locks" else real(self, *a, **k))
    folder = tmp_path / "exp"
    assert held_by(folder) is None and not folder.exists()  # nothing there, nothing made
    folder.mkdir()
    (folder / "result.json").write_text("{}")  # a folder with content keeps its lock file after the hold
    with hold_output_dir(folder, "out"):
        assert held_by(folder).startswith(f"process {os.getpid()} on ")
    if proc_locks:
        assert held_by(folder) is None  # released; the lock file still names this process
    (folder / ".lock").write_text('{"pid": 999999999, "host": "elsewhere"}')
    assert held_by(folder) is None


def test_a_folder_that_cannot_be_created_is_an_output_error(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputLocationError, match="is a file, not a folder"):
        with hold_output_dir(tmp_path / "file" / "exp", "out"):
            pass


def test_a_folder_the_hold_created_and_left_empty_is_removed_and_the_lock_file_holds_nothing(tmp_path):
    from ict_jax.outputs import has_entries

    folder = tmp_path / "a" / "run"
    with hold_output_dir(folder, "run_dir"):
        assert folder.is_dir() and not has_entries(folder)  # the lock file alone is no content
    assert not folder.exists() and (tmp_path / "a").is_dir()  # only the folder it created, nothing written
    with hold_output_dir(folder, "run_dir"):
        (folder / "metrics.jsonl").write_text("{}\n")
        assert has_entries(folder)
    assert sorted(p.name for p in folder.iterdir()) == [".lock", "metrics.jsonl"]
    (folder / "metrics.jsonl").unlink()
    with hold_output_dir(folder, "run_dir"):  # it existed before this hold: kept
        pass
    assert folder.is_dir() and not has_entries(folder) and not has_entries(tmp_path / "missing")


def test_a_lock_table_that_shows_another_device_matches_by_inode_and_holder(tmp_path, monkeypatch):
    """/proc/locks names a file by device and inode; on a layered file system (overlayfs) its device is not
    the one stat gives, so the inode held by the process the lock file names decides."""
    from pathlib import Path

    folder = tmp_path / "exp"
    folder.mkdir()
    lock = folder / ".lock"
    lock.write_text('{"pid": 4242, "host": "h"}')
    ino = lock.stat().st_ino
    real = Path.read_text
    table = {"text": ""}
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: table["text"] if str(self) == "/proc/locks"
                        else real(self, *a, **k))
    for text, held in ((f"1: FLOCK  ADVISORY  WRITE 4242 ff:07:{ino} 0 EOF\n", True),
                       (f"1: FLOCK  ADVISORY  WRITE 999 ff:07:{ino} 0 EOF\n", False),  # another process
                       (f"1: FLOCK  ADVISORY  WRITE 4242 ff:07:{ino + 1} 0 EOF\n", False),  # another file
                       (f"1: -> FLOCK  ADVISORY  WRITE 4242 ff:07:{ino} 0 EOF\n", False),  # a waiter
                       (f"1: POSIX  ADVISORY  WRITE 4242 ff:07:{ino} 0 EOF\n", False),  # not a flock
                       ("garbage\n2: FLOCK\n", False)):
        table["text"] = text
        assert (held_by(folder) is not None) == held, text
    table["text"] = "1: FLOCK  ADVISORY  WRITE 4242 ff:07:{} 0 EOF\n".format(ino)
    assert held_by(folder) == "process 4242 on h since ?"
