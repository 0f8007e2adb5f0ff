"""Host posture (what the machine is) and process hardening (what we make of our own process).

Honesty rules: a posture flag is true only when it was read from the host and said so; a hardening
flag is true only when the step was carried out and verified; a fact that cannot be read is
unknown (``None``), never a guessed ``false`` or ``true``.

macOS (each reader is tested on real output published by others: ``tests/macos_samples/``):

* SIP: ``csrutil status``; only ``status: enabled.`` is enabled. A custom configuration
  (``enabled (Custom Configuration)`` on older macOS, ``unknown (Custom Configuration)`` on Apple
  silicon) has protections switched off, so it is not.
* Secure Boot: ``system_profiler SPiBridgeDataType -json``, key ``ibridge_secure_boot`` (as osquery's
  ``secureboot`` table and Darkbloom's Swift provider read it; the same report exists on Intel Macs
  with a T2 chip). The coordinator means Full Security by ``secure_boot_enabled`` (its MDM cross-check
  compares it with ``SecureBootLevel == "full"``), so ``Full Security`` is true, a lowered level
  (``Reduced``/``Permissive``, T2: ``Medium``/``No Security``) is false, and anything else — no
  report, an empty one, a value ``system_profiler`` translated on a non-English Mac — is unknown: the
  field is left out of the challenge answer (the coordinator only acts on a present ``false``) and
  the agent logs ``secure_boot_unknown``. (The ``nvram …:AppleSecureBootPolicy`` variable exists on T2
  Macs only, not on Apple silicon.)
* RDMA: ``rdma_ctl status`` absent or ``disabled`` → disabled.
* Authenticated Root Volume (the sealed system volume; the registration attestation's
  ``authenticatedRootEnabled``): ``csrutil authenticated-root status``; a line ``Authenticated Root
  status: enabled`` is true, ``... disabled`` false, anything else (no such line, the command failed)
  unknown (``None``), and no attestation is sent while it is (``provider.session.attestation``).
* Secure Enclave (the attestation's ``secureEnclaveAvailable``: "this machine has a Secure Enclave", as
  Darkbloom's Swift provider sets it from ``SecureEnclave.isAvailable``): true on a Mac with Apple
  silicon (``sysctl machdep.cpu.brand_string`` is an ``Apple M…`` chip, as ``provider.hardware`` reads
  it), false in a virtual machine (``Apple M1 (Virtual)``), on Intel and elsewhere, where we have no
  proof. It says nothing about our signing key, which is a software key in a file (``identity``).
* Virtual machine: ``sysctl kern.hv_vmm_present`` (``1`` inside a VM; the name exists from macOS
  11.3). Reported in the log, not on the wire: see ``hypervisor_active`` below.

Elsewhere SIP, Secure Boot, the sealed system volume and the Secure Enclave are false (they do not
exist), ``rdma_disabled`` is true when ``/sys/class/infiniband`` is empty, and the cpuinfo
``hypervisor`` flag says "virtual machine".

``hypervisor_active`` is Darkbloom's name for the provider's own memory isolation: its Rust provider
maps model weights, activations and KV into a Hypervisor.framework VM's stage-2 page tables so RDMA
cannot read them, and the coordinator accepts ``rdma_disabled: false`` only with it. This agent has
no such isolation, so it reports ``false`` everywhere; running *inside* a VM isolates nothing.

Hardening (``harden_process``, re-exported from ``provider.hardening``): core dumps off, not
dumpable / no debugger attach, the environment scrubbed of injection hooks and secrets.

``dev_posture``: a self-hosted development coordinator only routes to providers that
report SIP, Secure Boot and every privacy capability true. ``dev_posture = true`` reports exactly that
(and, in the registration attestation, a sealed system volume and a Secure Enclave: the harness
posture a coordinator at ``EIGENINFERENCE_MIN_TRUST=self_signed`` needs, see
``provider.session.attestation``); it is refused unless the coordinator URL is a loopback address, and
the session warns at every connect.
"""

from __future__ import annotations

import ipaddress
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from protocol import PrivacyCapabilities
from protocol.attest import SecurityPosture
from provider.hardening import NO_HARDENING, SCRUBBED_NAMES, Hardening, harden_process, scrub_environment
from provider.hardware import parse_chip
from provider.hostcmd import Runner, read_sysctl, run_command

MEMORY_ISOLATION = False  # `hypervisor_active`: we do not isolate model memory in a hypervisor (see above)


class DevPostureRefused(ValueError):
    """``dev_posture`` was set for a coordinator that is not on this machine."""


@dataclass(frozen=True, slots=True)
class HostPosture:
    sip_enabled: bool
    secure_boot_enabled: bool | None  # None: could not be read (left out of the challenge answer)
    rdma_disabled: bool
    virtual_machine: bool | None = None  # this host is a VM guest (None: unknown); not a wire field
    authenticated_root_enabled: bool | None = None  # sealed system volume (None: not read); attestation only
    secure_enclave: bool = False  # the host has a Secure Enclave (Apple silicon); attestation only


DEV_HOST_POSTURE = HostPosture(sip_enabled=True, secure_boot_enabled=True, rdma_disabled=True,
                               virtual_machine=False, authenticated_root_enabled=True,
                               secure_enclave=True)


# --- dev posture ---------------------------------------------------------------------------------------


def is_loopback_url(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_dev_posture(coordinator_url: str, dev_posture: bool) -> None:
    """Raise ``DevPostureRefused`` when ``dev_posture`` is on for a non-loopback coordinator."""
    if dev_posture and not is_loopback_url(coordinator_url):
        raise DevPostureRefused(
            "dev_posture reports the posture a self-hosted coordinator requires (SIP, Secure Boot, every "
            "privacy capability), which this host may not have; it is only allowed with a coordinator on a "
            "loopback address (ws://127.0.0.1, ws://[::1] or ws://localhost). For any other coordinator "
            "set dev_posture = false (and use a wss:// URL)"
        )


# --- reading the host ----------------------------------------------------------------------------------


def read_host_posture(*, platform: str = sys.platform, run: Runner = run_command,
                      sys_root: Path = Path("/")) -> HostPosture:
    """What the host says about itself. Blocking (runs commands): call it off the event loop."""
    if platform == "darwin":
        return _darwin_posture(run)
    return HostPosture(
        sip_enabled=False,
        secure_boot_enabled=False,
        rdma_disabled=not _has_entries(sys_root / "sys" / "class" / "infiniband"),
        virtual_machine=_cpuinfo_has_hypervisor(sys_root / "proc" / "cpuinfo"),
        authenticated_root_enabled=False,
    )


def parse_csrutil(output: str | None) -> bool:
    """``System Integrity Protection status: enabled.`` exactly; a custom configuration is not enabled."""
    return output is not None and re.search(r"status:\s*enabled\.\s*$", output.strip(), re.IGNORECASE) is not None


# `ibridge_secure_boot` values (osquery's secureboot table; Darkbloom's BootPolicyDiagnostic).
_FULL_SECURITY = "fullsecurity"
_LOWERED_SECURITY = frozenset({"reducedsecurity", "permissivesecurity", "mediumsecurity", "nosecurity"})


def parse_secure_boot(output: str | None) -> bool | None:
    """``system_profiler SPiBridgeDataType -json``: True for Full Security, False for a lowered level,
    None when there is no readable English level (no report, an empty one, a translated value)."""
    try:
        items = json.loads(output or "").get("SPiBridgeDataType")
    except (ValueError, AttributeError):
        return None
    levels = [item.get("ibridge_secure_boot") for item in items or () if isinstance(item, dict)]
    for level in levels:
        if isinstance(level, str):
            normalized = "".join(level.split()).lower()
            if normalized == _FULL_SECURITY:
                return True
            if normalized in _LOWERED_SECURITY:
                return False
    return None


_AUTH_ROOT_LINE = re.compile(r"^Authenticated Root status: (enabled|disabled)$")


def parse_authenticated_root(output: str | None) -> bool | None:
    """``csrutil authenticated-root status``: a line ``Authenticated Root status: enabled`` → True,
    ``... disabled`` → False; no such line (or no output) → None."""
    for line in (output or "").splitlines():
        match = _AUTH_ROOT_LINE.match(line.strip())
        if match:
            return match.group(1) == "enabled"
    return None


def has_secure_enclave(values: dict[str, str]) -> bool:
    """An ``Apple M…`` chip in ``machdep.cpu.brand_string`` (every Apple silicon chip has a Secure Enclave);
    a VM's CPU, an Intel CPU or no brand: False (no proof)."""
    chip = parse_chip(values.get("machdep.cpu.brand_string", ""))
    return chip.family.startswith("M") and not chip.virtual


def parse_vmm_present(values: dict[str, str]) -> bool | None:
    """``kern.hv_vmm_present: 1`` inside a virtual machine, ``0`` on a real Mac; absent: unknown."""
    value = values.get("kern.hv_vmm_present")
    return None if value not in ("0", "1") else value == "1"


def _darwin_posture(run: Runner) -> HostPosture:
    rdma = run(["rdma_ctl", "status"])
    sysctl = read_sysctl(run, "kern.hv_vmm_present", "machdep.cpu.brand_string")
    return HostPosture(
        sip_enabled=parse_csrutil(run(["csrutil", "status"])),
        secure_boot_enabled=parse_secure_boot(run(["system_profiler", "SPiBridgeDataType", "-json"])),
        rdma_disabled=rdma is None or "disabled" in rdma.lower(),
        virtual_machine=parse_vmm_present(sysctl),
        authenticated_root_enabled=parse_authenticated_root(run(["csrutil", "authenticated-root", "status"])),
        secure_enclave=has_secure_enclave(sysctl),
    )


def _has_entries(directory: Path) -> bool:
    try:
        return any(directory.iterdir())
    except OSError:
        return False


def _cpuinfo_has_hypervisor(path: Path) -> bool:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return False
    return any(line.startswith("flags") and " hypervisor" in line for line in text.splitlines())


# --- what goes on the wire -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Posture:
    """Everything the session reports about security: host facts, our hardening, and the dev override."""

    host: HostPosture
    hardening: Hardening
    dev: bool = False

    @property
    def reported_host(self) -> HostPosture:
        return DEV_HOST_POSTURE if self.dev else self.host

    def security(self) -> SecurityPosture:
        """The posture fields of every ``attestation_response``."""
        host = self.reported_host
        return SecurityPosture(sip_enabled=host.sip_enabled, secure_boot_enabled=host.secure_boot_enabled,
                               rdma_disabled=host.rdma_disabled, hypervisor_active=MEMORY_ISOLATION)

    def privacy_capabilities(self) -> PrivacyCapabilities:
        """``register.privacy_capabilities``. In-process MLX with no text proxy is what we are; we do not
        lock the Python runtime nor block modules, so those two are true only under ``dev_posture``."""
        host, hard, dev = self.reported_host, self.hardening, self.dev
        return PrivacyCapabilities(
            text_backend_inprocess=True,
            text_proxy_disabled=True,
            python_runtime_locked=dev,
            dangerous_modules_blocked=dev,
            sip_enabled=host.sip_enabled,
            anti_debug_enabled=dev or hard.anti_debug_enabled,
            core_dumps_disabled=dev or hard.core_dumps_disabled,
            env_scrubbed=dev or hard.env_scrubbed,
            hypervisor_active=MEMORY_ISOLATION,
        )


__all__ = [
    "DEV_HOST_POSTURE",
    "MEMORY_ISOLATION",
    "NO_HARDENING",
    "SCRUBBED_NAMES",
    "DevPostureRefused",
    "Hardening",
    "HostPosture",
    "Posture",
    "check_dev_posture",
    "harden_process",
    "is_loopback_url",
    "has_secure_enclave",
    "parse_authenticated_root",
    "parse_csrutil",
    "parse_secure_boot",
    "parse_vmm_present",
    "read_host_posture",
    "scrub_environment",
]
