"""Cost of one memory `probe` snapshot and of one admission decision (reserve + release).

Run: `.venv/bin/python benchmarks/memory_bench.py [--n 5000]`

Prints one table (µs per call, median and p99) with each row's median as a ratio of the baseline
measured in the same run: `psutil.virtual_memory()` alone, the one OS call a snapshot cannot avoid.
"""

from __future__ import annotations

import argparse
import itertools
import tempfile
from pathlib import Path

import mlx.core as mx
import psutil

from memory import probe
from memory.fit import fit
from memory.ledger import Ledger, ReservationKind
from memory.policy import GiB, figures
from memory.probe import Probe
from timing import measure


def cgroup_v2_sample(base: Path) -> tuple[Path, Path]:
    """A v2 tree with a 16 GiB limit on the service, as under systemd or in a container."""
    root = base / "cgroup"
    leaf = root / "app.slice" / "agent.service"
    leaf.mkdir(parents=True)
    (root / "cgroup.controllers").write_text("memory\n")
    (leaf / "memory.max").write_text(f"{16 * GiB}\n")
    (leaf / "memory.current").write_text(f"{2 * GiB}\n")
    stat = "\n".join(f"key{i} {i}" for i in range(40)) + f"\ninactive_file {GiB}\n"
    (leaf / "memory.stat").write_text(stat)
    proc = base / "proc_self_cgroup"
    proc.write_text("0::/app.slice/agent.service\n")
    return root, proc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=5000)
    n = parser.parse_args().n

    keep = mx.ones((1 << 20,))  # something resident, so the MLX counters are non-trivial
    mx.eval(keep)
    host = Probe()
    snap = host.snapshot()
    figs = figures(snap.physical_bytes, env={})
    ids = (f"r{i}" for i in itertools.count())

    given = Ledger(figs)

    def admit_given_snapshot() -> None:
        rid = next(ids)
        assert given.reserve(rid, ReservationKind.REQUEST_KV, 64 << 20, snapshot=snap).granted
        given.release(rid)

    sampling = Ledger(figs, sample=host.snapshot)

    def admit_fresh_snapshot() -> None:
        rid = next(ids)
        assert sampling.reserve(rid, ReservationKind.REQUEST_KV, 64 << 20).granted
        sampling.release(rid)

    with tempfile.TemporaryDirectory() as tmp:
        root, proc = cgroup_v2_sample(Path(tmp))
        limited = Probe(cgroup_root=root, proc_cgroup=proc)
        assert limited.snapshot().cgroup_limit_bytes == 16 * GiB
        rows = [
            ("baseline: psutil.virtual_memory()", psutil.virtual_memory),
            ("probe: Probe.snapshot() (this host, no cgroup limit)", host.snapshot),
            ("probe: Probe.snapshot() (cgroup v2 limit, 3 files)", limited.snapshot),
            ("probe: memory.probe.snapshot() (cached Probe)", probe.snapshot),
            ("admission: reserve + release, snapshot given", admit_given_snapshot),
            ("admission: reserve + release, fresh snapshot", admit_fresh_snapshot),
            ("fit(): one verdict", lambda: fit(figs, snap, 4 * GiB, evictable_bytes=[GiB])),
        ]
        results = [(name, *measure(fn, n)) for name, fn in rows]

    base = results[0][1]
    width = max(len(name) for name, *_ in results)
    print(f"memory bench: n={n} per row, µs per call (host: {psutil.cpu_count()} cpus, "
          f"{snap.machine_bytes / GiB:.1f} GiB, cgroup limit {snap.cgroup_limit_bytes})")
    print(f"{'operation':<{width}}  {'median µs':>10}  {'p99 µs':>9}  {'× baseline':>10}")
    for name, median, p99 in results:
        print(f"{name:<{width}}  {median:>10.2f}  {p99:>9.2f}  {median / base:>10.2f}")
    del keep


if __name__ == "__main__":
    main()
