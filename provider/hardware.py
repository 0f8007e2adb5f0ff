"""What machine this is, for ``register.hardware``: chip, memory, cores, bandwidth.

macOS: ``sysctl`` (``hw.model``, ``machdep.cpu.brand_string``, ``hw.physicalcpu`` and the performance
levels ``hw.nperflevels`` / ``hw.perflevelN.name`` / ``hw.perflevelN.physicalcpu``) and the GPU core
count from ``ioreg -rc AGXAccelerator -d 1`` (``"gpu-core-count" = 40``). Elsewhere: ``/proc/cpuinfo``
/ ``platform`` for a name, psutil for cores, the DMI product name for the machine model; chip family and
tier are ``Unknown``, GPU cores 0.

Cores: the wire has two kinds, performance and efficiency. macOS names its levels (fastest first):
``Performance`` + ``Efficiency`` on M1–M4, ``Super`` + ``Efficiency`` on the M5, ``Super`` +
``Performance`` and no efficiency cores on the M5 Pro and Max, ``Standard`` in a virtual machine. So
efficiency = the cores of levels named ``Efficiency``, performance = every other core. macOS 12 had
the levels but not their names; there level 0 is the performance cores and the others efficiency
(``sys/sysctl.h``: "perflevel 0 always refers to the highest performance core type").

Memory is the policy's ``P`` (machine RAM lowered to the cgroup limit and ``memory_limit_gb``), so a
provider told to act as a 16 GiB machine tells the coordinator it is one. Integer fields are ints
(Go decodes them into int: a 64.0 would drop the whole frame).

``os_version`` (the registration attestation's ``osVersion``): on macOS the product version with three
parts, as Darkbloom's Swift provider writes it (``15.3.0``); elsewhere the system and kernel release
(``Linux 6.8.0-45-generic``), so it is never mistaken for a macOS version.

``memory_bandwidth_gbs`` comes from ``BANDWIDTH_GBS``: Apple's published figure per chip *and GPU core
count*, because binned parts have fewer memory channels (the 30-core M3 Max has 300 GB/s, the 40-core
400); never another chip's figure. Where the table has none (a chip not in it, a binned chip whose GPU
core count could not be read, a virtual machine, any machine that is not a Mac) the agent measures it
once at start (``measure_memory_bandwidth_gbs``: a short copy on the device MLX computes on, before
the engine runs anything): an older coordinator prices a provider whose decode rate it has not been
told by the square root of this figure, and by a 1 tok/s fallback when it is 0.
"""

from __future__ import annotations

import platform as _platform
import re
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import psutil

from memory import MemorySnapshot
from memory.policy import GiB
from protocol import CpuCores, Hardware
from provider.hostcmd import Runner, read_sysctl, run_command

UNKNOWN = "Unknown"
EFFICIENCY_LEVEL = "Efficiency"
_MAX_LEVELS = 8  # hw.nperflevels is 1–3 on every Mac so far; never trust it to size a loop

# (family, tier) -> ((least GPU cores of the variant, GB/s), ...): the variant with the most cores that
# is <= the Mac's count applies. Least 0 = one figure for every variant. Sources: Apple's newsroom
# and technical specifications pages for each chip (M1 Nov 2020 — 68.25 GB/s is AnandTech's figure for
# its 128-bit LPDDR4X-4266; M1 Pro/Max Oct 2021; M1 Ultra Mar 2022; M2 Jun 2022; M2 Pro/Max Jan 2023;
# M2 Ultra Jun 2023; M3 family Oct 2023, the 14-core-CPU/30-core-GPU M3 Max at 300 GB/s; M3 Ultra
# Mar 2025; M4 May 2024; M4 Pro/Max Oct 2024, the 32-core-GPU M4 Max at 410 GB/s; M5 Oct 2025; M5
# Pro/Max 2026, the 32-core-GPU M5 Max at 460 GB/s, the 40-core at 614), cross-checked with
# Darkbloom's provider (provider/src/hardware.rs, lookup_bandwidth, Layr-Labs/d-inference) and
# 0xBakeer/inference-atlas#194 (M5 Max: 614 GB/s for the 40-core GPU, 460 for the 32-core).
BANDWIDTH_GBS: dict[tuple[str, str], tuple[tuple[int, float], ...]] = {
    ("M1", "Base"): ((0, 68.25),), ("M1", "Pro"): ((0, 200),), ("M1", "Max"): ((0, 400),),
    ("M1", "Ultra"): ((0, 800),),
    ("M2", "Base"): ((0, 100),), ("M2", "Pro"): ((0, 200),), ("M2", "Max"): ((0, 400),),
    ("M2", "Ultra"): ((0, 800),),
    ("M3", "Base"): ((0, 100),), ("M3", "Pro"): ((0, 150),), ("M3", "Max"): ((30, 300), (40, 400)),
    ("M3", "Ultra"): ((0, 819),),
    ("M4", "Base"): ((0, 120),), ("M4", "Pro"): ((0, 273),), ("M4", "Max"): ((32, 410), (40, 546)),
    ("M5", "Base"): ((0, 153),), ("M5", "Pro"): ((0, 307),), ("M5", "Max"): ((32, 460), (40, 614)),
}


@dataclass(frozen=True, slots=True)
class Chip:
    name: str
    family: str  # M1 … M6 or Unknown
    tier: str  # Base, Pro, Max, Ultra or Unknown
    virtual: bool = False  # a virtual machine's CPU ("Apple M1 (Virtual)")


def parse_chip(brand: str) -> Chip:
    """``Apple M3 Max`` → (M3, Max); ``Apple M2`` → (M2, Base); a VM's or anything else → Unknown."""
    name = brand.strip() or UNKNOWN
    if "(Virtual)" in name:
        return Chip(name, UNKNOWN, UNKNOWN, virtual=True)
    match = re.search(r"\bApple (M\d+)(?: (Pro|Max|Ultra))?\b", name)
    if match is None:
        return Chip(name, UNKNOWN, UNKNOWN)
    return Chip(name, match.group(1), match.group(2) or "Base")


def memory_bandwidth_gbs(chip: Chip, gpu_cores: int = 0) -> float:
    """Apple's figure for this chip with this many GPU cores; 0 when it is not known."""
    variants = BANDWIDTH_GBS.get((chip.family, chip.tier), ())
    figures = [gbs for least, gbs in variants if least <= gpu_cores]
    return float(figures[-1]) if figures else 0.0


def parse_gpu_cores(output: str | None) -> int:
    """``"gpu-core-count" = 40`` in ``ioreg -rc AGXAccelerator -d 1``; 0 when absent (Intel, a VM)."""
    match = re.search(r'"gpu-core-count"\s*=\s*(\d+)', output or "")
    return int(match.group(1)) if match else 0


def _int(text: str | None, default: int = 0) -> int:
    try:
        return int((text or "").strip())
    except ValueError:
        return default


def cpu_cores(values: Mapping[str, str], fallback_total: int = 0) -> CpuCores:
    """Performance and efficiency cores from ``hw.physicalcpu`` and the named performance levels."""
    levels = []
    for i in range(_MAX_LEVELS):
        if f"hw.perflevel{i}.physicalcpu" not in values:
            break
        levels.append((values.get(f"hw.perflevel{i}.name"), _int(values[f"hw.perflevel{i}.physicalcpu"])))
    total = _int(values.get("hw.physicalcpu"), sum(count for _, count in levels) or fallback_total)
    efficiency = sum(count for i, (name, count) in enumerate(levels)
                     if name == EFFICIENCY_LEVEL or (name is None and i > 0))
    efficiency = min(efficiency, total)
    return CpuCores(total=total, performance=total - efficiency, efficiency=efficiency)


def read_darwin_sysctl(run: Runner) -> dict[str, str]:
    """Every sysctl the hardware report reads: the performance levels until one is missing (at most
    ``hw.nperflevels``, when macOS says it)."""
    values = read_sysctl(run, "hw.model", "machdep.cpu.brand_string", "hw.physicalcpu", "hw.nperflevels")
    for i in range(min(_int(values.get("hw.nperflevels"), _MAX_LEVELS), _MAX_LEVELS)):
        level = read_sysctl(run, f"hw.perflevel{i}.physicalcpu", f"hw.perflevel{i}.name")
        if f"hw.perflevel{i}.physicalcpu" not in level:
            break
        values.update(level)
    return values


# The bandwidth probe: one buffer, copied a few times on MLX's default device (read + write counted);
# grown while a copy takes less than MIN_PASS_S (a fast device: the launch would dominate), never past
# MAX_PROBE_BYTES nor an eighth of the memory free, and stopped after PROBE_BUDGET_S.
PROBE_BYTES = 64 << 20  # above any CPU's last-level cache
MAX_PROBE_BYTES = 1 << 30
MIN_PASS_S = 0.004
PROBE_PASSES = 3
PROBE_BUDGET_S = 0.5
MAX_BANDWIDTH_GBS = 2000.0  # the coordinator clamps to this


@dataclass(frozen=True, slots=True)
class Machine:
    """What does not change while the agent runs: everything of ``register.hardware`` but the memory."""

    machine_model: str
    chip: Chip
    cpu_cores: CpuCores
    gpu_cores: int
    memory_bandwidth_gbs: float
    bandwidth_measured: bool = False  # measured here rather than Apple's figure


def detect_machine(*, platform: str = sys.platform, run: Runner = run_command, sys_root: Path = Path("/"),
                   measure: Callable[[], float] | None = None) -> Machine:
    """The machine; its memory bandwidth from Apple's table, else from `measure` when given (the agent
    passes `measure_memory_bandwidth_gbs`), else 0. Blocking: call it off the loop."""
    if platform == "darwin":
        machine, brand, cores, gpu = _darwin(run)
    else:
        machine, brand, cores, gpu = _generic(sys_root)
    chip = parse_chip(brand)
    bandwidth = memory_bandwidth_gbs(chip, gpu)
    if bandwidth == 0 and measure is not None:
        return Machine(machine, chip, cores, gpu, measure(), bandwidth_measured=True)
    return Machine(machine, chip, cores, gpu, bandwidth)


def hardware_of(machine: Machine, snapshot: MemorySnapshot) -> Hardware:
    """The ``register.hardware`` object: the machine and the memory of this snapshot."""
    return Hardware(
        machine_model=machine.machine_model,
        chip_name=machine.chip.name,
        chip_family=machine.chip.family,
        chip_tier=machine.chip.tier,
        memory_gb=int(round(snapshot.physical_bytes / GiB)),
        memory_available_gb=available_gb(snapshot),
        cpu_cores=machine.cpu_cores,
        gpu_cores=machine.gpu_cores,
        memory_bandwidth_gbs=machine.memory_bandwidth_gbs,
    )


def detect_hardware(snapshot: MemorySnapshot, *, platform: str = sys.platform, run: Runner = run_command,
                    sys_root: Path = Path("/"), measure: Callable[[], float] | None = None) -> Hardware:
    """The ``register.hardware`` object. Blocking (runs commands, reads files): call it off the loop."""
    return hardware_of(detect_machine(platform=platform, run=run, sys_root=sys_root, measure=measure), snapshot)


def measure_memory_bandwidth_gbs(*, start_bytes: int = PROBE_BYTES, max_bytes: int = MAX_PROBE_BYTES,
                                 passes: int = PROBE_PASSES, budget_s: float = PROBE_BUDGET_S) -> float:
    """GB/s (10⁹ bytes) of a copy on the device MLX computes on: the best of a few passes over one buffer,
    reads and writes counted; 0.0 when MLX cannot run it. Blocking, for at most about `budget_s`; on a
    stream of its own, and its buffers are given back before it returns. Call it before the engine runs
    anything (all other MLX work is the engine thread's)."""
    try:
        import mlx.core as mx
    except ImportError:
        return 0.0
    ceiling = max(start_bytes, min(max_bytes, psutil.virtual_memory().available // 8))
    nbytes, best = start_bytes, float("inf")
    deadline = time.monotonic() + budget_s
    try:
        with mx.stream(mx.new_stream(mx.default_device())):
            while True:
                source = mx.ones((nbytes // 4,), dtype=mx.float32)
                mx.eval(source)
                mx.eval(source * 1.0)  # a first pass: the destination's pages are allocated once, untimed
                best = float("inf")
                for _ in range(passes):
                    started = time.perf_counter()
                    mx.eval(source * 1.0)
                    best = min(best, time.perf_counter() - started)
                    if time.monotonic() > deadline:
                        break
                del source
                if best >= MIN_PASS_S or nbytes * 2 > ceiling or time.monotonic() > deadline:
                    break
                nbytes *= 2
    except (RuntimeError, ValueError, MemoryError):
        return 0.0
    finally:
        mx.clear_cache()
    if not 0 < best < float("inf"):
        return 0.0
    return round(min(2 * nbytes / best / 1e9, MAX_BANDWIDTH_GBS), 1)


def os_version(*, platform: str = sys.platform, mac_ver: str | None = None) -> str:
    """``15.3.0`` on macOS (``platform.mac_ver``, which reads SystemVersion.plist), ``Linux 6.8.0-…`` elsewhere;
    ``Unknown`` when nothing can be read."""
    if platform == "darwin":
        version = (_platform.mac_ver()[0] if mac_ver is None else mac_ver).strip()
        parts = version.split(".") if version else []
        return ".".join((parts + ["0", "0"])[:max(3, len(parts))]) if parts else UNKNOWN
    text = f"{_platform.system()} {_platform.release()}".strip()
    return text or UNKNOWN


def available_gb(snapshot: MemorySnapshot) -> float:
    """``memory_available_gb``: what the OS has free, never more than the memory we say we have."""
    return round(min(snapshot.available_bytes, snapshot.physical_bytes) / GiB, 2)


def _darwin(run: Runner) -> tuple[str, str, CpuCores, int]:
    values = read_darwin_sysctl(run)
    cores = cpu_cores(values, psutil.cpu_count(logical=False) or 0)
    gpu = parse_gpu_cores(run(["ioreg", "-rc", "AGXAccelerator", "-d", "1"]))
    return values.get("hw.model", ""), values.get("machdep.cpu.brand_string", ""), cores, gpu


def _generic(sys_root: Path) -> tuple[str, str, CpuCores, int]:
    brand = ""
    try:
        for line in (sys_root / "proc" / "cpuinfo").read_text(errors="replace").splitlines():
            if line.lower().startswith(("model name", "hardware")):
                brand = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        machine = (sys_root / "sys" / "devices" / "virtual" / "dmi" / "id" / "product_name").read_text().strip()
    except OSError:
        machine = ""
    total = psutil.cpu_count(logical=False) or psutil.cpu_count() or 0
    return machine or _platform.machine(), brand or _platform.processor() or UNKNOWN, \
        CpuCores(total=total, performance=total, efficiency=0), 0


__all__ = ["BANDWIDTH_GBS", "EFFICIENCY_LEVEL", "UNKNOWN", "Chip", "Machine", "available_gb", "cpu_cores",
           "detect_hardware", "detect_machine", "hardware_of", "measure_memory_bandwidth_gbs", "memory_bandwidth_gbs",
           "os_version", "parse_chip", "parse_gpu_cores", "read_darwin_sysctl"]
