"""memory.probe and memory.cgroup: sample cgroup trees (v2 `max`, numbers, v1), the real machine."""

from __future__ import annotations

import gc
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import psutil
import pytest

from memory import cgroup, probe
from memory.policy import GiB
from memory.probe import Probe
from memory.snapshot import MlxCounters

MiB = 2**20
V1_UNLIMITED = "9223372036854771712"


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def v2_tree(tmp_path: Path, proc_line: str = "0::/app.slice/agent.service\n") -> tuple[Path, Path]:
    root = tmp_path / "cgroup"
    write(root / "cgroup.controllers", "cpu io memory pids\n")
    proc = tmp_path / "proc_self_cgroup"
    write(proc, proc_line)
    return root, proc


def v2_level(directory: Path, maximum: str, current: int = 0, inactive_file: int = 0) -> None:
    write(directory / "memory.max", maximum + "\n")
    write(directory / "memory.current", f"{current}\n")
    write(directory / "memory.stat", f"anon 1000\nfile 5000\ninactive_file {inactive_file}\nactive_file 7\n")


def v1_tree(tmp_path: Path, limit: str, *, usage: int = 0, inactive: int = 0,
            hierarchical: str = V1_UNLIMITED, path: str = "/docker/abc") -> tuple[Path, Path]:
    root = tmp_path / "cgroup"
    proc = tmp_path / "proc_self_cgroup"
    write(proc, f"12:pids:{path}\n4:memory:{path}\n1:name=systemd:{path}\n0::/\n")
    leaf = root / "memory" / path.lstrip("/")
    write(leaf / "memory.limit_in_bytes", limit + "\n")
    write(leaf / "memory.usage_in_bytes", f"{usage}\n")
    write(leaf / "memory.stat", f"cache 10\nrss 20\nhierarchical_memory_limit {hierarchical}\n"
                                f"total_inactive_file {inactive}\ninactive_file 1\n")
    (root / "unified").mkdir(parents=True, exist_ok=True)  # hybrid layout, like this machine
    return root, proc


# -- parsing --------------------------------------------------------------------------------------

def test_parse_limit() -> None:
    assert cgroup.parse_limit("max\n") is None
    assert cgroup.parse_limit("8589934592\n") == 8 * GiB
    assert cgroup.parse_limit(V1_UNLIMITED) is None
    assert cgroup.parse_limit("") is None and cgroup.parse_limit("lots") is None


def test_parse_proc_cgroup() -> None:
    assert cgroup.parse_proc_cgroup("0::/user.slice/app\n") == (None, "/user.slice/app")
    hybrid = "5:cpu,cpuacct:/x\n4:memory:/process_api/abc\n0::/\n"
    assert cgroup.parse_proc_cgroup(hybrid) == ("/process_api/abc", "/")
    assert cgroup.parse_proc_cgroup("7:blkio,memory:/y\n") == ("/y", None)
    assert cgroup.parse_proc_cgroup("garbage\n") == (None, None)


def test_parse_stat() -> None:
    text = "anon 5\ninactive_file 123\nactive_file 9\nbogus x\n"
    assert cgroup.parse_stat(text, "inactive_file", "bogus", "missing") == {"inactive_file": 123}


# -- v2 -------------------------------------------------------------------------------------------

def test_v2_max_everywhere_means_no_limit(tmp_path: Path) -> None:
    root, proc = v2_tree(tmp_path)
    v2_level(root / "app.slice", "max")
    v2_level(root / "app.slice" / "agent.service", "max")
    assert cgroup.locate(root, proc) == ()
    assert cgroup.read(()) == cgroup.CgroupReading(None, None)


def test_v2_number_on_an_ancestor_binds(tmp_path: Path) -> None:
    root, proc = v2_tree(tmp_path)
    v2_level(root / "app.slice", str(8 * GiB), current=3 * GiB, inactive_file=GiB)
    v2_level(root / "app.slice" / "agent.service", "max", current=GiB)
    levels = cgroup.locate(root, proc)
    assert [lv.path.name for lv in levels] == ["app.slice"]
    assert all(lv.version is cgroup.CgroupVersion.V2 for lv in levels)
    reading = cgroup.read(levels)
    assert reading.limit_bytes == 8 * GiB
    assert reading.available_bytes == 8 * GiB - (3 * GiB - GiB)  # limit − working set


def test_v2_tightest_level_wins(tmp_path: Path) -> None:
    root, proc = v2_tree(tmp_path)
    v2_level(root / "app.slice", str(8 * GiB), current=7 * GiB)  # 1 GiB left up here
    v2_level(root / "app.slice" / "agent.service", str(4 * GiB), current=GiB)  # 3 GiB left here
    reading = cgroup.read(cgroup.locate(root, proc))
    assert reading.limit_bytes == 4 * GiB
    assert reading.available_bytes == GiB
    # Limits are re-read on every call: the operator lowers the leaf limit.
    write(root / "app.slice" / "agent.service" / "memory.max", f"{2 * GiB}\n")
    assert cgroup.read(cgroup.locate(root, proc)).limit_bytes == 2 * GiB


def test_v2_container_root_and_invisible_namespace_path(tmp_path: Path) -> None:
    root, proc = v2_tree(tmp_path, "0::/\n")
    v2_level(root, str(6 * GiB), current=GiB)
    assert cgroup.read(cgroup.locate(root, proc)).limit_bytes == 6 * GiB
    # A path from the host's view that does not exist inside the namespace: use the mount root.
    write(proc, "0::/kubepods/burstable/pod1/abc\n")
    assert cgroup.read(cgroup.locate(root, proc)).limit_bytes == 6 * GiB
    write(proc, "0::/../../escape\n")
    assert cgroup.read(cgroup.locate(root, proc)).limit_bytes == 6 * GiB


def test_no_cgroup_files(tmp_path: Path) -> None:
    assert cgroup.locate(tmp_path / "absent", tmp_path / "absent_proc") == ()
    proc = tmp_path / "proc"
    write(proc, "0::/\n")
    (tmp_path / "empty").mkdir()
    assert cgroup.locate(tmp_path / "empty", proc) == ()  # neither v1 memory nor a v2 mount


# -- v1 -------------------------------------------------------------------------------------------

def test_v1_limit(tmp_path: Path) -> None:
    root, proc = v1_tree(tmp_path, str(2 * GiB), usage=GiB + 100 * MiB, inactive=100 * MiB)
    levels = cgroup.locate(root, proc)
    assert len(levels) == 1 and levels[0].version is cgroup.CgroupVersion.V1
    assert levels[0].path == (root / "memory" / "docker" / "abc").resolve()
    assert cgroup.read(levels) == cgroup.CgroupReading(2 * GiB, GiB)


def test_v1_unlimited_and_hierarchical(tmp_path: Path) -> None:
    root, proc = v1_tree(tmp_path, V1_UNLIMITED)
    assert cgroup.locate(root, proc) == ()
    root, proc = v1_tree(tmp_path / "h", V1_UNLIMITED, hierarchical=str(3 * GiB), usage=GiB)
    assert cgroup.read(cgroup.locate(root, proc)) == cgroup.CgroupReading(3 * GiB, 2 * GiB)


# -- Probe ----------------------------------------------------------------------------------------

def fake_vm(total: int, available: int):
    return lambda: SimpleNamespace(total=total, available=available)


def test_probe_applies_cgroup_and_operator_limits(tmp_path: Path) -> None:
    root, proc = v2_tree(tmp_path)
    v2_level(root / "app.slice" / "agent.service", str(12 * GiB), current=4 * GiB)
    counters = MlxCounters(active_bytes=3 * GiB, cache_bytes=GiB, peak_bytes=5 * GiB)
    p = Probe(cgroup_root=root, proc_cgroup=proc, mlx_counters=lambda: counters,
              virtual_memory=fake_vm(64 * GiB, 40 * GiB), clock=lambda: 42.0)
    s = p.snapshot()
    assert s.machine_bytes == 64 * GiB and s.cgroup_limit_bytes == 12 * GiB
    assert s.physical_bytes == 12 * GiB
    assert s.available_bytes == 8 * GiB  # the cgroup's room, tighter than the OS's 40
    assert (s.mlx_active_bytes, s.mlx_cache_bytes, s.mlx_peak_bytes) == (3 * GiB, GiB, 5 * GiB)
    assert s.mlx_used_bytes == 4 * GiB and s.taken_at == 42.0 and s.rss_bytes > 0

    limited = Probe(8, cgroup_root=root, proc_cgroup=proc, mlx_counters=lambda: counters,
                    virtual_memory=fake_vm(64 * GiB, 40 * GiB))
    s = limited.snapshot()
    assert s.physical_bytes == 8 * GiB and s.memory_limit_bytes == 8 * GiB

    # No cgroup limit: P is the machine, available is the OS's.
    free = Probe(cgroup_root=tmp_path / "none", proc_cgroup=proc, mlx_counters=lambda: counters,
                 virtual_memory=fake_vm(64 * GiB, 40 * GiB)).snapshot()
    assert (free.physical_bytes, free.available_bytes, free.cgroup_limit_bytes) == (64 * GiB, 40 * GiB, None)


def test_refresh_picks_up_a_new_limit(tmp_path: Path) -> None:
    root, proc = v2_tree(tmp_path)
    v2_level(root / "app.slice" / "agent.service", "max")
    p = Probe(cgroup_root=root, proc_cgroup=proc, mlx_counters=MlxCounters,
              virtual_memory=fake_vm(64 * GiB, 60 * GiB))
    assert p.snapshot().physical_bytes == 64 * GiB
    v2_level(root / "app.slice" / "agent.service", str(16 * GiB))
    p.refresh()
    assert p.snapshot().physical_bytes == 16 * GiB


class _Machine:
    """MLX counters that count their reads and can run something in the middle of one (to play a
    second thread's call landing while a reading is under way), and a clock the test moves."""

    def __init__(self) -> None:
        self.now = 100.0
        self.reads = 0
        self.active = GiB
        self.during_read = None

    def counters(self) -> MlxCounters:
        self.reads += 1
        active = self.active
        if self.during_read is not None:
            during, self.during_read = self.during_read, None
            during()
        return MlxCounters(active_bytes=active)

    def probe(self, tmp_path: Path, **kw) -> Probe:
        return Probe(cgroup_root=tmp_path / "none", proc_cgroup=tmp_path / "none", mlx_counters=self.counters,
                     virtual_memory=fake_vm(64 * GiB, 40 * GiB), clock=lambda: self.now, **kw)


def test_recent_shares_one_reading_for_its_max_age(tmp_path: Path) -> None:
    m = _Machine()
    p = m.probe(tmp_path, max_age_s=0.005)
    first = p.recent()
    assert m.reads == 1
    m.active = 2 * GiB
    m.now += 0.004
    assert p.recent() is first and m.reads == 1  # requests arriving together share it
    m.now += 0.002  # 6 ms old: sampled afresh
    second = p.recent()
    assert m.reads == 2 and second.mlx_active_bytes == 2 * GiB
    # snapshot() always samples, and its reading is the one shared from then on.
    m.active = 3 * GiB
    fresh = p.snapshot()
    assert m.reads == 3 and fresh.mlx_active_bytes == 3 * GiB and p.recent() is fresh


def test_invalidate_makes_the_next_recent_sample(tmp_path: Path) -> None:
    m = _Machine()
    p = m.probe(tmp_path)
    p.recent()
    m.active = 5 * GiB
    p.invalidate()
    assert p.recent().mlx_active_bytes == 5 * GiB and m.reads == 2
    # An invalidate that lands while a reading is under way: that reading is returned to its caller
    # but never shared (it may predate the change the invalidate announced).
    m.now += 1.0
    m.during_read = p.invalidate
    m.active = 6 * GiB
    p.snapshot()
    m.active = 7 * GiB
    assert p.recent().mlx_active_bytes == 7 * GiB and m.reads == 4
    # refresh() re-reads the limits: a reading of the old ones is not shared.
    p.refresh()
    assert p.recent() is not None and m.reads == 5


def test_a_reading_never_replaces_a_later_one(tmp_path: Path) -> None:
    m = _Machine()
    p = m.probe(tmp_path)
    later: list = []

    def second_caller() -> None:  # begins after the first reading began, and finishes first
        m.now += 0.001
        m.active = 9 * GiB
        later.append(p.snapshot())

    m.during_read = second_caller
    earlier = p.snapshot()
    assert earlier.mlx_active_bytes == GiB and later[0].mlx_active_bytes == 9 * GiB
    assert p.recent() is later[0] and m.reads == 2


def test_real_read_of_this_machine() -> None:
    """No fakes: psutil, /proc, the real cgroup files and MLX's counters on this host."""
    p = Probe()
    s = p.snapshot()
    vm = psutil.virtual_memory()
    assert s.machine_bytes == vm.total == p.machine_bytes
    reading = cgroup.read(p.cgroup_levels)
    assert s.cgroup_limit_bytes == reading.limit_bytes
    expected_p = vm.total if reading.limit_bytes is None else min(vm.total, reading.limit_bytes)
    assert s.physical_bytes == expected_p
    assert 0 < s.available_bytes <= vm.total
    assert abs(s.rss_bytes - psutil.Process().memory_info().rss) < 256 * MiB
    # /proc/self/cgroup names a v1 memory controller or a v2 path on any Linux host.
    v1, v2 = cgroup.parse_proc_cgroup(Path("/proc/self/cgroup").read_text())
    assert v1 is not None or v2 is not None
    if v1 is not None and Path("/sys/fs/cgroup/memory").is_dir():
        leaf = cgroup._inside(Path("/sys/fs/cgroup/memory"), v1)
        own = cgroup.parse_limit((leaf / "memory.limit_in_bytes").read_text())
        assert own is None or reading.limit_bytes is not None and reading.limit_bytes <= own


def test_real_mlx_counters_follow_an_allocation() -> None:
    mx.clear_cache()
    before = probe.snapshot()
    a = mx.zeros((64 * MiB // 4,), dtype=mx.float32)
    mx.eval(a)
    during = probe.snapshot()
    assert during.mlx_active_bytes - before.mlx_active_bytes >= 64 * MiB
    assert during.mlx_peak_bytes >= during.mlx_active_bytes
    del a
    gc.collect()
    mx.clear_cache()
    after = probe.snapshot()
    assert after.mlx_active_bytes <= before.mlx_active_bytes and after.mlx_cache_bytes == 0


def test_module_snapshot_reuses_one_probe() -> None:
    probe.snapshot(memory_limit_gb=3)
    hits = probe._probe_for.cache_info().hits
    s = probe.snapshot(memory_limit_gb=3)
    assert probe._probe_for.cache_info().hits == hits + 1
    assert s.physical_bytes == min(3 * GiB, s.machine_bytes) and s.memory_limit_bytes == 3 * GiB


@pytest.mark.parametrize("bad", [None, 0, -1, float("nan"), float("inf")])
def test_probe_ignores_unusable_limits(bad: float | None) -> None:
    s = Probe(bad, mlx_counters=MlxCounters).snapshot()
    assert s.memory_limit_bytes is None and s.physical_bytes == (s.cgroup_limit_bytes or s.machine_bytes)


# -- a discrete GPU (MLX's CUDA backend) ------------------------------------------------------------


def test_on_a_discrete_gpu_the_cap_is_taken_of_the_gpus_memory_and_host_ram_is_counted_apart(tmp_path: Path) -> None:
    """As measured on an H200 host: MLX CUDA allocates from the GPU's 140 GiB, the host has
    126 GiB under a 113 GiB cgroup. The device budget is the GPU's (a cgroup bounds host RAM only), what
    MLX holds is set against it, pressure is GPU bytes over GPU memory, and the host's RAM is read apart."""
    from memory import DeviceMemory, compute_figures, pressure

    root, proc = v2_tree(tmp_path)
    v2_level(root / "app.slice" / "agent.service", str(113 * GiB), current=20 * GiB)
    gpu = 140 * GiB
    host = SimpleNamespace(total=126 * GiB, available=100 * GiB)
    counters = MlxCounters(active_bytes=20 * GiB, cache_bytes=2 * GiB, peak_bytes=21 * GiB)
    p = Probe(None, cgroup_root=root, proc_cgroup=proc, mlx_counters=lambda: counters,
              virtual_memory=lambda: host, device_memory=lambda: gpu)
    snap = p.snapshot()
    assert snap.device_memory is DeviceMemory.DISCRETE and p.machine_bytes == gpu
    assert (snap.physical_bytes, snap.available_bytes) == (gpu, gpu - 22 * GiB)
    assert snap.cgroup_limit_bytes is None  # the cgroup does not bound the GPU
    assert (snap.host_physical_bytes, snap.host_available_bytes) == (113 * GiB, 93 * GiB)
    assert compute_figures(snap.physical_bytes).hard_cap_bytes == int(0.9 * gpu)
    assert pressure(snap).utilization == pytest.approx(22 / 140)
    # memory_limit_gb still lowers the device budget (an operator emulating a smaller card).
    small = Probe(24.0, cgroup_root=root, proc_cgroup=proc, mlx_counters=lambda: counters,
                  virtual_memory=lambda: host, device_memory=lambda: gpu).snapshot()
    assert small.physical_bytes == 24 * GiB and small.host_physical_bytes == 113 * GiB


def test_with_unified_memory_nothing_changes(tmp_path: Path) -> None:
    from memory import DeviceMemory

    host = SimpleNamespace(total=64 * GiB, available=40 * GiB)
    snap = Probe(None, cgroup_root=tmp_path / "none", proc_cgroup=tmp_path / "none", mlx_counters=MlxCounters,
                 virtual_memory=lambda: host, device_memory=probe.unified_memory).snapshot()
    assert snap.device_memory is DeviceMemory.UNIFIED
    assert (snap.physical_bytes, snap.available_bytes, snap.host_physical_bytes) == (64 * GiB, 40 * GiB, None)


def test_this_machine_is_read_as_it_is() -> None:
    """On MLX's CPU device (this machine, CI) MLX allocates from the machine's RAM: unified."""
    from memory import DeviceMemory

    assert probe.read_device_memory() is None
    assert Probe().snapshot().device_memory is DeviceMemory.UNIFIED
