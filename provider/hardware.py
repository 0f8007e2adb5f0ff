"""What machine this is, for ``register.hardware`` (protocol.md §3.1): chip, memory, cores.

macOS: ``sysctl`` (``hw.model``, ``machdep.cpu.brand_string``, per-performance-level core counts) and
the GPU core count from ``ioreg``. Elsewhere: ``/proc/cpuinfo`` / ``platform`` for a name, psutil for
cores, the DMI product name for the machine model; chip family and tier are ``Unknown``, GPU cores 0.

Memory is the policy's ``P`` (machine RAM lowered to the cgroup limit and ``memory_limit_gb``), so a
provider told to act as a 16 GiB machine tells the coordinator it is one. Integer fields are ints
(Go decodes them into int: a 64.0 would drop the whole frame).

``memory_bandwidth_gbs`` comes from Apple's published figures per chip (the coordinator's fallback
decode-speed estimate is √bandwidth); unknown chips report 0. Binned variants with lower bandwidth
(e.g. the 14-core M3 Max, 300 GB/s) cannot be told apart from ``brand_string`` and report the full figure.
"""

from __future__ import annotations

import platform as _platform
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import psutil

from memory import MemorySnapshot
from memory.policy import GiB
from protocol import CpuCores, Hardware
from provider.session.posture import Runner, run_command

UNKNOWN = "Unknown"
_TIERS = ("Ultra", "Max", "Pro")
# Apple's published unified-memory bandwidth, GB/s.
_BANDWIDTH_GBS: dict[tuple[str, str], float] = {
    ("M1", "Base"): 68.25, ("M1", "Pro"): 200, ("M1", "Max"): 400, ("M1", "Ultra"): 800,
    ("M2", "Base"): 100, ("M2", "Pro"): 200, ("M2", "Max"): 400, ("M2", "Ultra"): 800,
    ("M3", "Base"): 100, ("M3", "Pro"): 150, ("M3", "Max"): 400, ("M3", "Ultra"): 819,
    ("M4", "Base"): 120, ("M4", "Pro"): 273, ("M4", "Max"): 546,
    ("M5", "Base"): 153,
}


@dataclass(frozen=True, slots=True)
class Chip:
    name: str
    family: str  # M1 … M6 or Unknown
    tier: str  # Base, Pro, Max, Ultra or Unknown


def parse_chip(brand: str) -> Chip:
    """``Apple M3 Max`` → (M3, Max); ``Apple M2`` → (M2, Base); anything else → Unknown."""
    name = brand.strip() or UNKNOWN
    match = re.search(r"\bApple (M\d+)(?: (Pro|Max|Ultra))?\b", name)
    if match is None:
        return Chip(name, UNKNOWN, UNKNOWN)
    return Chip(name, match.group(1), match.group(2) or "Base")


def memory_bandwidth_gbs(chip: Chip) -> float:
    return float(_BANDWIDTH_GBS.get((chip.family, chip.tier), 0.0))


def detect_hardware(snapshot: MemorySnapshot, *, platform: str = sys.platform, run: Runner = run_command,
                    sys_root: Path = Path("/")) -> Hardware:
    """The ``register.hardware`` object. Blocking (runs commands, reads files): call it off the loop."""
    if platform == "darwin":
        machine, brand, cores, gpu = _darwin(run)
    else:
        machine, brand, cores, gpu = _generic(sys_root)
    chip = parse_chip(brand)
    return Hardware(
        machine_model=machine,
        chip_name=chip.name,
        chip_family=chip.family,
        chip_tier=chip.tier,
        memory_gb=int(round(snapshot.physical_bytes / GiB)),
        memory_available_gb=available_gb(snapshot),
        cpu_cores=cores,
        gpu_cores=gpu,
        memory_bandwidth_gbs=memory_bandwidth_gbs(chip),
    )


def available_gb(snapshot: MemorySnapshot) -> float:
    """``memory_available_gb``: what the OS has free, never more than the memory we say we have."""
    return round(min(snapshot.available_bytes, snapshot.physical_bytes) / GiB, 2)


def _int(text: str | None, default: int = 0) -> int:
    try:
        return int((text or "").strip())
    except ValueError:
        return default


def _darwin(run: Runner) -> tuple[str, str, CpuCores, int]:
    machine = (run(["sysctl", "-n", "hw.model"]) or "").strip()
    brand = (run(["sysctl", "-n", "machdep.cpu.brand_string"]) or "").strip()
    total = _int(run(["sysctl", "-n", "hw.physicalcpu"]), psutil.cpu_count(logical=False) or 0)
    perf = _int(run(["sysctl", "-n", "hw.perflevel0.physicalcpu"]), total)
    eff = _int(run(["sysctl", "-n", "hw.perflevel1.physicalcpu"]), 0)
    gpu_match = re.search(r'"gpu-core-count"\s*=\s*(\d+)', run(["ioreg", "-rc", "AGXAccelerator", "-d", "1"]) or "")
    gpu = int(gpu_match.group(1)) if gpu_match else 0
    return machine, brand, CpuCores(total=total, performance=perf, efficiency=eff), gpu


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


__all__ = ["UNKNOWN", "Chip", "available_gb", "detect_hardware", "memory_bandwidth_gbs", "parse_chip"]
