"""The macOS readers against real command output published by others.

Every sample is a file in tests/macos_samples/ whose header names its source. A fake runner plays the
Mac: it answers exactly the commands the readers run, with a sample's text, and None (the command
failed) for anything else, so a reader that asks for something the sample lacks says "unknown".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pytest

from macos_samples import header, names, sample
from memory import MemorySnapshot
from memory.policy import GiB
from protocol import ThermalState
from provider.hardware import cpu_cores, detect_hardware, memory_bandwidth_gbs, parse_chip, parse_gpu_cores
from provider.hostcmd import sysctl_values
from provider.session.posture import (
    MEMORY_ISOLATION,
    Hardening,
    Posture,
    has_secure_enclave,
    parse_authenticated_root,
    parse_csrutil,
    parse_secure_boot,
    parse_vmm_present,
    read_host_posture,
)
from provider.session.thermal import (
    ThermalSampler,
    parse_pmset_therm,
    parse_thermal_pressure,
    read_thermal_state,
)


class FakeMac:
    """Answers ``argv`` from recorded outputs: ``sysctl NAME`` from a pool of ``name: value`` lines
    (one line, as sysctl prints it), anything else by its full command line."""

    def __init__(self, sysctl: str = "", commands: Mapping[str, str | None] | None = None) -> None:
        self.sysctl = sysctl_values(sysctl)
        self.outputs = dict(commands or {})  # "csrutil status" -> its output
        self.calls: list[tuple[str, ...]] = []

    def __call__(self, argv: Sequence[str]) -> str | None:
        self.calls.append(tuple(argv))
        if argv[0] == "sysctl" and len(argv) == 2:
            value = self.sysctl.get(argv[1])
            return None if value is None else f"{argv[1]}: {value}\n"  # unknown oid: sysctl fails
        return self.outputs.get(" ".join(argv))


def test_every_sample_names_its_source_and_provenance():
    assert len(names()) >= 25
    for name in names():
        head = header(name)
        assert "# command:" in head and "# source:" in head and "# provenance:" in head, name
        assert sample(name).strip(), name


# --- 18.1 Secure Boot, and SIP ----------------------------------------------------------------------


@pytest.mark.parametrize(("name", "expected"), [
    ("spibridge_m4max_full_security.json", True),
    ("spibridge_m4max_reduced_security_derived.json", False),
    ("spibridge_m4max_permissive_security_derived.json", False),
    ("spibridge_m4max_localized_derived.json", None),  # a translated level is unknown, not a downgrade
    ("spibridge_empty_report.json", None),
])
def test_secure_boot_from_the_ibridge_report(name, expected):
    assert parse_secure_boot(sample(name)) is expected


@pytest.mark.parametrize(("name", "enabled"), [
    ("csrutil_enabled_10_11.txt", True),
    ("csrutil_enabled_10_15.txt", True),
    ("csrutil_custom_apple_silicon_12_5.txt", False),  # "unknown (Custom Configuration)"
    ("csrutil_custom_enabled_10_11.txt", False),  # "enabled (Custom Configuration)" is not enabled
    ("csrutil_custom_vm.txt", False),
    ("csrutil_disabled_apple_internal.txt", False),
])
def test_sip_only_when_fully_enabled(name, enabled):
    assert parse_csrutil(sample(name)) is enabled


def posture_mac(csrutil: str, spibridge: str | None = None, sysctl: str = "") -> FakeMac:
    commands = {"csrutil status": sample(csrutil)}
    if spibridge is not None:
        commands["system_profiler SPiBridgeDataType -json"] = sample(spibridge)
    return FakeMac(sample(sysctl) if sysctl else "", commands)


def test_a_mac_in_full_security_reports_secure_boot_true_on_the_wire():
    mac = posture_mac("csrutil_enabled_10_15.txt", "spibridge_m4max_full_security.json",
                      "sysctl_hv_vmm_present_patched_vm.txt")
    host = read_host_posture(platform="darwin", run=mac)
    assert (host.sip_enabled, host.secure_boot_enabled, host.rdma_disabled) == (True, True, True)
    assert ("system_profiler", "SPiBridgeDataType", "-json") in mac.calls
    assert not any(call[0] == "nvram" for call in mac.calls)  # the T2-only variable is not read
    security = Posture(host, Hardening(True, True, True)).security()
    assert security.secure_boot_enabled is True


def test_an_unreadable_secure_boot_is_left_out_of_the_challenge_answer():
    from protocol.attest import ChallengeSigner, answer_challenge
    from protocol.to_provider import AttestationChallenge

    mac = posture_mac("csrutil_enabled_10_11.txt", "spibridge_m4max_localized_derived.json")
    host = read_host_posture(platform="darwin", run=mac)
    assert host.secure_boot_enabled is None
    posture = Posture(host, Hardening(True, True, True))
    answer = answer_challenge(AttestationChallenge(type="attestation_challenge", nonce="nonce-123456",
                                                   timestamp="2026-05-01T00:00:00Z"),
                              public_key_b64="pk", signer=ChallengeSigner.generate(), posture=posture.security())
    wire = answer.model_dump(exclude_none=True)
    assert "secure_boot_enabled" not in wire  # [A] acts only on a present false
    assert wire["sip_enabled"] is True


def test_a_lowered_boot_policy_is_reported_false():
    mac = posture_mac("csrutil_enabled_10_11.txt", "spibridge_m4max_reduced_security_derived.json")
    assert read_host_posture(platform="darwin", run=mac).secure_boot_enabled is False


# --- 18.6 hypervisor_active is our memory isolation, not "inside a VM" ------------------------------


def test_a_virtual_machine_is_known_but_is_not_memory_isolation():
    mac = posture_mac("csrutil_custom_vm.txt", sysctl="sysctl_hv_vmm_present_vm_derived.txt")
    mac.outputs["rdma_ctl status"] = "disabled"
    host = read_host_posture(platform="darwin", run=mac)
    assert host.virtual_machine is True and host.sip_enabled is False
    posture = Posture(host, Hardening(True, True, True))
    assert posture.security().hypervisor_active is False is MEMORY_ISOLATION
    assert posture.privacy_capabilities().hypervisor_active is False


def test_vm_flag_readings():
    assert parse_vmm_present(sysctl_values(sample("sysctl_hv_vmm_present_vm_derived.txt"))) is True
    # A patched VM reads 0 like a real Mac: the flag is a hint for doctor, never a security claim.
    assert parse_vmm_present(sysctl_values(sample("sysctl_hv_vmm_present_patched_vm.txt"))) is False
    assert parse_vmm_present({}) is None  # before macOS 11.3 the name does not exist


# --- the sealed system volume and the Secure Enclave (the registration attestation) -----------------------


@pytest.mark.parametrize(("name", "enabled"), [
    ("csrutil_authenticated_root_enabled.txt", True),
    ("csrutil_authenticated_root_disabled.txt", False),
    # "Authenticated Root Requirement: enabled" (a csrutil status line) is not the status: unknown.
    ("csrutil_authenticated_root_custom_sip.txt", None),
])
def test_authenticated_root_from_csrutil(name, enabled):
    assert parse_authenticated_root(sample(name)) is enabled


def test_an_unread_authenticated_root_is_unknown():
    assert parse_authenticated_root(None) is None and parse_authenticated_root("") is None
    assert parse_authenticated_root("Authenticated Root status: maybe") is None


def test_a_secure_enclave_only_on_apple_silicon_that_is_not_a_vm():
    assert has_secure_enclave({"machdep.cpu.brand_string": "Apple M5 Max"}) is True
    assert has_secure_enclave({"machdep.cpu.brand_string": "Apple M1"}) is True
    vm = sysctl_values(sample("sysctl_vm_github_runner_macos26.txt"))  # "Apple M1 (Virtual)"
    assert has_secure_enclave(vm) is False
    assert has_secure_enclave({"machdep.cpu.brand_string": "Intel(R) Core(TM) i9-9880H CPU @ 2.30GHz"}) is False
    assert has_secure_enclave({}) is False


def test_an_apple_silicon_mac_reads_its_sealed_volume_and_enclave_once_at_startup():
    mac = posture_mac("csrutil_enabled_10_15.txt", "spibridge_m4max_full_security.json",
                      "sysctl_hv_vmm_present_patched_vm.txt")
    mac.sysctl["machdep.cpu.brand_string"] = "Apple M4 Max"
    mac.outputs["csrutil authenticated-root status"] = sample("csrutil_authenticated_root_enabled.txt")
    host = read_host_posture(platform="darwin", run=mac)
    assert (host.authenticated_root_enabled, host.secure_enclave) == (True, True)
    assert mac.calls.count(("csrutil", "authenticated-root", "status")) == 1
    mac.outputs.pop("csrutil authenticated-root status")  # the command failed
    assert read_host_posture(platform="darwin", run=mac).authenticated_root_enabled is None


# --- 18.2 thermal state ------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "state"), [
    ("notifyutil_thermalpressure_nominal_m2.txt", ThermalState.NOMINAL),
    ("notifyutil_thermalpressure_level1.txt", ThermalState.FAIR),
    ("notifyutil_thermalpressure_level2.txt", ThermalState.SERIOUS),
    ("notifyutil_thermalpressure_level3.txt", ThermalState.CRITICAL),
    ("notifyutil_thermalpressure_level4.txt", ThermalState.CRITICAL),
    ("notifyutil_thermalpressure_failed.txt", None),
])
def test_thermal_pressure_levels(name, state):
    assert parse_thermal_pressure(sample(name)) is state


@pytest.mark.parametrize(("name", "state"), [
    ("pmset_therm_m1pro_12_1.txt", None),  # Apple silicon: "No CPU power status has been recorded"
    ("pmset_therm_intel_full_speed.txt", ThermalState.NOMINAL),
    ("pmset_therm_intel_throttled.txt", ThermalState.CRITICAL),  # CPU_Speed_Limit 28
])
def test_pmset_cpu_speed_limit(name, state):
    assert parse_pmset_therm(sample(name)) is state


def mac_thermals(notifyutil: str | None, pmset: str | None) -> FakeMac:
    return FakeMac(commands={"notifyutil -g com.apple.system.thermalpressurelevel": notifyutil, "pmset -g therm": pmset})


def test_apple_silicon_under_heavy_pressure_is_serious_not_nominal():
    mac = mac_thermals(sample("notifyutil_thermalpressure_level2.txt"), sample("pmset_therm_m1pro_12_1.txt"))
    assert read_thermal_state(mac) is ThermalState.SERIOUS


def test_the_intel_path_still_counts_and_the_worse_source_wins():
    mac = mac_thermals(sample("notifyutil_thermalpressure_nominal_m2.txt"), sample("pmset_therm_intel_throttled.txt"))
    assert read_thermal_state(mac) is ThermalState.CRITICAL
    assert read_thermal_state(mac_thermals(None, None)) is None


async def test_the_sampler_keeps_its_last_reading_when_nothing_can_be_read():
    mac = mac_thermals(sample("notifyutil_thermalpressure_level1.txt"), sample("pmset_therm_m1pro_12_1.txt"))
    sampler = ThermalSampler(platform="darwin", run=mac, ttl_s=0.0)
    assert await sampler.refresh() is ThermalState.FAIR
    mac.outputs.clear()
    assert await sampler.refresh() is ThermalState.FAIR
    assert await ThermalSampler(platform="linux", run=mac).refresh() is ThermalState.NOMINAL


# --- 18.5 hardware facts -----------------------------------------------------------------------------


SNAP = MemorySnapshot(physical_bytes=128 * GiB, available_bytes=100 * GiB)


def mac_hardware(sysctl_sample: str, *, extra: Mapping[str, str] = (), gpu: str | None = None) -> FakeMac:
    lines = sample(sysctl_sample) + "".join(f"{k}: {v}\n" for k, v in dict(extra).items())
    return FakeMac(lines, {"ioreg -rc AGXAccelerator -d 1": gpu})


def ioreg(cores: int) -> str:
    # The shape of `ioreg -rc AGXAccelerator -d 1` (the node and its "gpu-core-count" property).
    return ("+-o AGXAcceleratorG17X  <class AGXAcceleratorG17X, id 0x1000006f7, registered>\n  {\n"
            f'    "gpu-core-count" = {cores}\n    "model" = "Apple M5 Max"\n  }}\n')


def test_m5_max_super_cores_are_performance_cores_and_the_bandwidth_is_known():
    # Brand and total from the same report (macmon#47: "Apple M5 Max (Mac17,6)", "proc 18:6:0:12").
    mac = mac_hardware("sysctl_m5max_perflevels.txt", gpu=ioreg(40), extra={
        "hw.model": "Mac17,6", "machdep.cpu.brand_string": "Apple M5 Max", "hw.physicalcpu": "18"})
    hw = detect_hardware(SNAP, platform="darwin", run=mac)
    assert (hw.cpu_cores.total, hw.cpu_cores.performance, hw.cpu_cores.efficiency) == (18, 18, 0)
    assert (hw.chip_family, hw.chip_tier, hw.gpu_cores, hw.machine_model) == ("M5", "Max", 40, "Mac17,6")
    assert hw.memory_bandwidth_gbs == 614
    mac32 = mac_hardware("sysctl_m5max_perflevels.txt", gpu=ioreg(32),
                         extra={"machdep.cpu.brand_string": "Apple M5 Max", "hw.physicalcpu": "18"})
    assert detect_hardware(SNAP, platform="darwin", run=mac32).memory_bandwidth_gbs == 460


def test_m5_pro_has_no_efficiency_cores():
    cores = cpu_cores(sysctl_values(sample("sysctl_m5pro_perflevels.txt")))
    assert (cores.total, cores.performance, cores.efficiency) == (15, 15, 0)


def test_base_m5_super_plus_efficiency():
    cores = cpu_cores(sysctl_values(sample("sysctl_m5_base_derived.txt")))
    assert (cores.total, cores.performance, cores.efficiency) == (10, 4, 6)


def test_macos_12_levels_without_names_are_performance_then_efficiency():
    mac = mac_hardware("sysctl_m1pro_macos12.txt", extra={"machdep.cpu.brand_string": "Apple M1 Pro"})
    hw = detect_hardware(SNAP, platform="darwin", run=mac)
    assert (hw.cpu_cores.total, hw.cpu_cores.performance, hw.cpu_cores.efficiency) == (10, 8, 2)
    assert (hw.gpu_cores, hw.memory_bandwidth_gbs) == (0, 200)  # one figure for every M1 Pro


def test_a_virtual_mac_claims_no_chip_bandwidth():
    mac = mac_hardware("sysctl_vm_github_runner_macos26.txt")
    hw = detect_hardware(SNAP, platform="darwin", run=mac)
    assert (hw.machine_model, hw.chip_name, hw.chip_family) == ("VirtualMac2,1", "Apple M1 (Virtual)", "Unknown")
    assert (hw.cpu_cores.total, hw.cpu_cores.performance, hw.cpu_cores.efficiency) == (3, 3, 0)
    assert (hw.gpu_cores, hw.memory_bandwidth_gbs) == (0, 0)


@pytest.mark.parametrize(("brand", "gpu", "gbs"), [
    ("Apple M3 Max", 30, 300), ("Apple M3 Max", 40, 400), ("Apple M3 Max", 0, 0),  # binned, cores unknown
    ("Apple M4 Max", 32, 410), ("Apple M4 Max", 40, 546), ("Apple M4 Pro", 20, 273),
    ("Apple M1 Max", 24, 400), ("Apple M2 Max", 30, 400), ("Apple M1", 8, 68.25), ("Apple M5", 10, 153),
    ("Apple M5 Pro", 20, 307), ("Apple M3 Ultra", 80, 819), ("Apple M9", 10, 0),
])
def test_bandwidth_is_keyed_by_chip_and_gpu_cores(brand, gpu, gbs):
    assert memory_bandwidth_gbs(parse_chip(brand), gpu) == gbs


def test_gpu_core_count_from_ioreg():
    assert parse_gpu_cores(ioreg(38)) == 38
    assert parse_gpu_cores(None) == 0 and parse_gpu_cores("ioreg: no such class") == 0
