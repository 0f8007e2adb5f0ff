"""Host posture (what the machine is) and process hardening (what we make of our own process).

Honesty rules: a posture flag is true only when it was read from the host and said so; a hardening
flag is true only when the step was carried out and verified. On macOS SIP comes from ``csrutil
status`` and Secure Boot from the ``AppleSecureBootPolicy`` NVRAM variable (Full Security = ``%02``;
when the variable cannot be read — e.g. Apple silicon without privileges — it is reported false, never
guessed). Elsewhere SIP and Secure Boot are false: they do not exist. ``rdma_disabled`` is true when
the host has no RDMA device (Linux: ``/sys/class/infiniband`` is empty; macOS: ``rdma_ctl status`` is
absent or says disabled). ``hypervisor_active`` comes from ``kern.hv_vmm_present`` / the cpuinfo
``hypervisor`` flag.

Hardening (``harden_process``, re-exported from ``provider.hardening``): core dumps off, not
dumpable / no debugger attach, the environment scrubbed of injection hooks and secrets.

``dev_posture``: a self-hosted development coordinator (protocol.md §13) only routes to providers that
report SIP, Secure Boot and every privacy capability true. ``dev_posture = true`` reports exactly that;
it is refused unless the coordinator URL is a loopback address, and the session warns at every connect.
"""

from __future__ import annotations

import ipaddress
import re
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from protocol import PrivacyCapabilities
from protocol.attest import SecurityPosture
from provider.hardening import NO_HARDENING, SCRUBBED_NAMES, Hardening, harden_process, scrub_environment

_COMMAND_TIMEOUT_S = 5.0

Runner = Callable[[Sequence[str]], str | None]  # argv -> stdout, None when it cannot run


class DevPostureRefused(ValueError):
    """``dev_posture`` was set for a coordinator that is not on this machine."""


@dataclass(frozen=True, slots=True)
class HostPosture:
    sip_enabled: bool
    secure_boot_enabled: bool
    rdma_disabled: bool
    hypervisor_active: bool


DEV_HOST_POSTURE = HostPosture(sip_enabled=True, secure_boot_enabled=True, rdma_disabled=True,
                               hypervisor_active=False)


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


def run_command(argv: Sequence[str]) -> str | None:
    """stdout of a short system command, or None if it is missing, fails or hangs."""
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=_COMMAND_TIMEOUT_S,
                              check=False, env={"PATH": "/usr/bin:/bin:/usr/sbin:/sbin", "LANG": "C"})
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def read_host_posture(*, platform: str = sys.platform, run: Runner = run_command,
                      sys_root: Path = Path("/")) -> HostPosture:
    """What the host says about itself. Blocking (runs commands): call it off the event loop."""
    if platform == "darwin":
        return _darwin_posture(run)
    return HostPosture(
        sip_enabled=False,
        secure_boot_enabled=False,
        rdma_disabled=not _has_entries(sys_root / "sys" / "class" / "infiniband"),
        hypervisor_active=_cpuinfo_has_hypervisor(sys_root / "proc" / "cpuinfo"),
    )


def parse_csrutil(output: str | None) -> bool:
    """``System Integrity Protection status: enabled.`` exactly; a custom configuration is not enabled."""
    return output is not None and re.search(r"status:\s*enabled\.\s*$", output.strip(), re.IGNORECASE) is not None


def parse_secure_boot_policy(output: str | None) -> bool:
    """``nvram …:AppleSecureBootPolicy`` prints ``…\\t%02`` for Full Security."""
    return output is not None and output.strip().endswith("%02")


def _darwin_posture(run: Runner) -> HostPosture:
    rdma = run(["rdma_ctl", "status"])
    return HostPosture(
        sip_enabled=parse_csrutil(run(["csrutil", "status"])),
        secure_boot_enabled=parse_secure_boot_policy(
            run(["nvram", "94b73556-2ba1-4f56-8cfd-1ad8d5c5bb7d:AppleSecureBootPolicy"])),
        rdma_disabled=rdma is None or "disabled" in rdma.lower(),
        hypervisor_active=(run(["sysctl", "-n", "kern.hv_vmm_present"]) or "").strip() == "1",
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
                               rdma_disabled=host.rdma_disabled, hypervisor_active=host.hypervisor_active)

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
            hypervisor_active=host.hypervisor_active,
        )


__all__ = [
    "DEV_HOST_POSTURE",
    "NO_HARDENING",
    "SCRUBBED_NAMES",
    "DevPostureRefused",
    "Hardening",
    "HostPosture",
    "Posture",
    "check_dev_posture",
    "harden_process",
    "is_loopback_url",
    "parse_csrutil",
    "parse_secure_boot_policy",
    "read_host_posture",
    "run_command",
    "scrub_environment",
]
