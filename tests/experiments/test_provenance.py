"""ict_jax.experiments.provenance: the machine a result names, and the environment an experiment records."""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

import pytest

from ict_jax.experiments import provenance


def test_the_machine_names_its_cpu_model_cores_and_memory():
    m = provenance.machine()
    assert list(m) == ["host", "cpu", "cores", "memory_gib", "os", "python"]
    assert m["host"] == platform.node() and m["python"] == sys.version.split()[0]
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():  # Linux: the model's name, not the architecture ("x86_64") platform gives
        names = {line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                 if line.startswith("model name")}
        if names:
            assert m["cpu"] in names and m["cpu"] != platform.machine()
    if hasattr(os, "sched_getaffinity"):
        assert m["cores"] == len(os.sched_getaffinity(0))
    if hasattr(os, "sysconf") and "SC_PHYS_PAGES" in os.sysconf_names:  # the kernel's total, another way
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
        assert m["memory_gib"] == pytest.approx(total, abs=0.06)


def test_without_cpuinfo_the_cpu_is_what_platform_knows(monkeypatch):
    real = Path.read_text

    def no_cpuinfo(self, *a, **k):
        if str(self) == "/proc/cpuinfo":
            raise OSError("no such file")
        return real(self, *a, **k)

    monkeypatch.setattr(Path, "read_text", no_cpuinfo)
    assert provenance.machine()["cpu"] == (platform.processor() or platform.machine())


def test_the_environment_is_the_machine_then_the_software():
    env = provenance.environment()
    m = provenance.machine()
    assert {k: env[k] for k in m} == m and list(env)[:len(m)] == list(m)
    assert env["backend"] == "cpu" and env["devices"].endswith("x cpu")
    assert set(env["versions"]) == set(provenance.PACKAGES) and env["versions"]["jax"]
    assert {"commit", "dirty"} <= set(env)


def test_a_file_is_named_relative_to_its_repository_or_by_its_bare_name(tmp_path, monkeypatch):
    import subprocess

    repo = tmp_path / "repo"
    (repo / "configs" / "experiments").mkdir(parents=True)
    plan = repo / "configs" / "experiments" / "p.yaml"
    plan.write_text("name: p\n")
    if subprocess.run(["git", "init", "-q", str(repo)], capture_output=True).returncode != 0:
        pytest.skip("git is not available")
    monkeypatch.chdir(tmp_path)  # wherever the command runs, absolute or relative paths name it alike
    assert provenance.file_name(plan) == "configs/experiments/p.yaml"
    assert provenance.file_name(Path("repo/configs/experiments/p.yaml")) == "configs/experiments/p.yaml"
    monkeypatch.chdir(repo / "configs")
    assert provenance.file_name(Path("experiments/p.yaml")) == "configs/experiments/p.yaml"
    loose = tmp_path / "elsewhere" / "q.yaml"
    loose.parent.mkdir()
    loose.write_text("name: q\n")
    assert provenance.file_name(loose) == "q.yaml"  # outside a repository: the bare name
