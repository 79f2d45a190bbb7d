"""ict_jax.memory: the machine's memory budget, from fake /proc and cgroup files (hand-made cases)."""

import resource

import pytest

from ict_jax import memory

GIB = 1024 ** 3


def _meminfo(tmp_path, available_kb):
    p = tmp_path / "meminfo"
    p.write_text(f"MemTotal:       25165824 kB\nMemFree:         1000 kB\nMemAvailable:   {available_kb} kB\n")
    return p


@pytest.mark.parametrize("text,n", [("123", 123), ("20GiB", 20 * GIB), ("512MB", 512 * 10 ** 6), ("1.5e10", 15 * 10 ** 9),
                                    (" 2 gib ", 2 * GIB), ("0.5KiB", 512)])
def test_parse_size(text, n):
    assert memory.parse_size(text) == n


@pytest.mark.parametrize("text", ["", "lots", "20 parsecs", "-3GiB", "0", "GiB"])
def test_parse_size_refuses_with_one_line(text):
    with pytest.raises(ValueError, match=r"^ICT_JAX_MEMORY_BUDGET: .* (is not a size|must be more than 0)") as e:
        memory.parse_size(text)
    assert "\n" not in str(e.value)


def test_host_budget_is_what_the_process_holds_plus_memavailable(tmp_path, monkeypatch):
    monkeypatch.delenv(memory.BUDGET_ENV, raising=False)
    monkeypatch.setattr(resource, "getrlimit", lambda _: (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    b = memory.host_budget(cgroup_root=tmp_path / "none", meminfo_path=_meminfo(tmp_path, 8 * 1024 ** 2), rss=GIB)
    assert (b.total, b.held, b.free) == (9 * GIB, GIB, 8 * GIB) and "MemAvailable" in b.source


@pytest.mark.parametrize("version", ["v2", "v1"])
def test_a_cgroup_limit_below_memavailable_wins(tmp_path, monkeypatch, version):
    monkeypatch.delenv(memory.BUDGET_ENV, raising=False)
    monkeypatch.setattr(resource, "getrlimit", lambda _: (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    root = tmp_path / "cg"
    d = root if version == "v2" else root / "memory"
    d.mkdir(parents=True)
    limit, usage = ("memory.max", "memory.current") if version == "v2" else ("memory.limit_in_bytes",
                                                                             "memory.usage_in_bytes")
    (d / limit).write_text(f"{6 * GIB}\n")
    (d / usage).write_text(f"{2 * GIB}\n")
    b = memory.host_budget(cgroup_root=root, meminfo_path=_meminfo(tmp_path, 20 * 1024 ** 2), rss=GIB)
    assert b.total == GIB + 4 * GIB and "cgroup memory limit 6.00 GiB" in b.source
    assert memory.cgroup_headroom(root) == (6 * GIB, 4 * GIB)


@pytest.mark.parametrize("text", ["max\n", f"{(1 << 63) - 4096}\n"])
def test_an_unlimited_cgroup_is_no_limit(tmp_path, text):
    (tmp_path / "memory.max").write_text(text)
    (tmp_path / "memory.current").write_text("100\n")
    assert memory.cgroup_headroom(tmp_path) is None


def test_ulimit_bounds_the_budget(tmp_path, monkeypatch):
    monkeypatch.delenv(memory.BUDGET_ENV, raising=False)
    monkeypatch.setattr(resource, "getrlimit", lambda _: (3 * GIB, resource.RLIM_INFINITY))
    b = memory.host_budget(cgroup_root=tmp_path / "none", meminfo_path=_meminfo(tmp_path, 20 * 1024 ** 2), rss=GIB)
    assert (b.total, b.source) == (3 * GIB, "ulimit -v")


def test_the_environment_variable_sets_the_budget(tmp_path, monkeypatch):
    monkeypatch.setenv(memory.BUDGET_ENV, "3GiB")
    b = memory.host_budget(meminfo_path=_meminfo(tmp_path, 20 * 1024 ** 2), rss=GIB)
    assert (b.total, b.source, b.held) == (3 * GIB, memory.BUDGET_ENV, GIB)

    class Dev:
        platform = "gpu"

        def memory_stats(self):
            return {"bytes_limit": 80 * GIB}

    assert memory.device_budget(Dev()).total == 3 * GIB
    monkeypatch.delenv(memory.BUDGET_ENV)
    assert memory.device_budget(Dev()) == memory.Budget(80 * GIB, "gpu device bytes_limit", 0)


def test_devices_without_an_allocator_have_no_budget(monkeypatch):
    monkeypatch.delenv(memory.BUDGET_ENV, raising=False)

    class NoStats:
        def memory_stats(self):
            return None

    class Raises:
        def memory_stats(self):
            raise RuntimeError("compile-only device")

    assert memory.device_budget(NoStats()) is None and memory.device_budget(Raises()) is None


def test_this_process_has_a_resident_set():
    assert 0 < memory.process_rss() <= memory.peak_rss()
