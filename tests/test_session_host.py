"""Identity key files, posture reading, hardening, hardware detection, runtime hash."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from memory import MemorySnapshot
from memory.policy import GiB
from protocol.attest import challenge_message, verify_signature
from protocol.crypto import KeyFileError
from provider.hardware import detect_hardware, memory_bandwidth_gbs, parse_chip
from provider.runtime_hash import compute_runtime_hash, runtime_hash
from provider.session.identity import SIGNING_FILE, X25519_FILE, identity_dir, load_or_create_keys
from provider.session.posture import (
    DevPostureRefused,
    Hardening,
    HostPosture,
    Posture,
    check_dev_posture,
    parse_csrutil,
    parse_secure_boot,
    read_host_posture,
    scrub_environment,
)
from provider.session.thermal import parse_pmset_therm

# --- identity ------------------------------------------------------------------------------------------


def test_keys_are_created_0600_in_a_0700_dir_and_reused(tmp_path):
    keys = load_or_create_keys(tmp_path)
    directory = identity_dir(tmp_path)
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    for name in (X25519_FILE, SIGNING_FILE):
        assert stat.S_IMODE((directory / name).stat().st_mode) == 0o600
    again = load_or_create_keys(tmp_path)
    assert again.encryption.public_key_b64 == keys.encryption.public_key_b64
    assert again.signer.public_key_b64 == keys.signer.public_key_b64
    message = challenge_message("nonce", "2026-04-30T10:41:07Z")
    assert verify_signature(keys.signer.public_key_b64, message, again.signer.sign(message))


def test_a_key_readable_by_others_is_refused(tmp_path):
    load_or_create_keys(tmp_path)
    path = identity_dir(tmp_path) / SIGNING_FILE
    os.chmod(path, 0o644)
    with pytest.raises(KeyFileError):
        load_or_create_keys(tmp_path)


# --- posture -------------------------------------------------------------------------------------------


def test_csrutil_and_secure_boot_parsing():
    # Real outputs of every kind are in test_macos_readers.py; these are the edges.
    assert not parse_csrutil(None)
    assert parse_secure_boot(None) is None and parse_secure_boot("") is None
    assert parse_secure_boot("not json") is None and parse_secure_boot("[]") is None


def test_darwin_posture_reads_commands_and_never_guesses():
    outputs = {"csrutil": "System Integrity Protection status: enabled.", "system_profiler": None,
               "rdma_ctl": "disabled", "sysctl": "kern.hv_vmm_present: 0\n"}
    posture = read_host_posture(platform="darwin", run=lambda argv: outputs[argv[0]])
    # system_profiler could not run: Secure Boot is unknown, not false.
    assert posture == HostPosture(sip_enabled=True, secure_boot_enabled=None, rdma_disabled=True,
                                  virtual_machine=False, authenticated_root_enabled=None)  # no status line
    outputs["rdma_ctl"] = "enabled"
    assert not read_host_posture(platform="darwin", run=lambda argv: outputs[argv[0]]).rdma_disabled


def test_linux_posture_is_false_for_macos_only_states(tmp_path):
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc" / "cpuinfo").write_text("processor\t: 0\nflags\t\t: fpu vme hypervisor sse\n")
    posture = read_host_posture(platform="linux", sys_root=tmp_path)
    assert posture == HostPosture(sip_enabled=False, secure_boot_enabled=False, rdma_disabled=True,
                                  virtual_machine=True, authenticated_root_enabled=False)
    (tmp_path / "sys" / "class" / "infiniband" / "mlx5_0").mkdir(parents=True)
    assert not read_host_posture(platform="linux", sys_root=tmp_path).rdma_disabled


def test_honest_posture_reports_what_it_has():
    posture = Posture(HostPosture(False, False, True, False),
                      Hardening(core_dumps_disabled=True, anti_debug_enabled=False, env_scrubbed=True))
    caps = posture.privacy_capabilities()
    assert caps.text_backend_inprocess and caps.text_proxy_disabled and caps.core_dumps_disabled
    assert not caps.sip_enabled and not caps.anti_debug_enabled
    assert not caps.python_runtime_locked and not caps.dangerous_modules_blocked
    security = posture.security()
    assert security.sip_enabled is False and security.secure_boot_enabled is False


def test_dev_posture_reports_what_a_dev_coordinator_needs():
    posture = Posture(HostPosture(False, False, True, False),
                      Hardening(core_dumps_disabled=False, anti_debug_enabled=False, env_scrubbed=False), dev=True)
    caps = posture.privacy_capabilities()
    assert all(getattr(caps, name) for name in ("text_backend_inprocess", "text_proxy_disabled",
               "python_runtime_locked", "dangerous_modules_blocked", "sip_enabled", "anti_debug_enabled",
               "core_dumps_disabled", "env_scrubbed"))
    security = posture.security()
    assert security.sip_enabled and security.secure_boot_enabled and security.rdma_disabled


@pytest.mark.parametrize("url", ["ws://127.0.0.1:8080/ws/provider", "ws://localhost:1/x", "ws://[::1]:9/ws",
                                 "wss://127.0.0.2/ws"])
def test_dev_posture_allowed_on_loopback(url):
    check_dev_posture(url, True)


@pytest.mark.parametrize("url", ["wss://api.darkbloom.dev/ws/provider", "ws://10.0.0.5:8080/ws/provider",
                                 "ws://localhost.evil.com/ws"])
def test_dev_posture_refused_elsewhere(url):
    with pytest.raises(DevPostureRefused, match="loopback"):
        check_dev_posture(url, True)
    check_dev_posture(url, False)


def test_environment_scrub_removes_hooks_and_secrets_only():
    env = {"LD_PRELOAD": "/x.so", "DYLD_INSERT_LIBRARIES": "/y", "HF_TOKEN": "t", "DARKBLOOM_AUTH_TOKEN": "s",
           "AWS_SECRET_ACCESS_KEY": "k", "MY_API_KEY": "k", "PYTHONSTARTUP": "/s.py",
           "TOKENIZERS_PARALLELISM": "false", "HOME": "/home/u", "PATH": "/bin", "HF_HUB_OFFLINE": "1"}
    assert scrub_environment(env) == 7
    assert env == {"TOKENIZERS_PARALLELISM": "false", "HOME": "/home/u", "PATH": "/bin", "HF_HUB_OFFLINE": "1"}


def test_hardening_in_a_child_process_takes_effect():
    code = (
        "import os, resource, sys\n"
        "from provider.session.posture import harden_process\n"
        "h = harden_process()\n"
        "assert h.core_dumps_disabled and resource.getrlimit(resource.RLIMIT_CORE) == (0, 0)\n"
        "assert h.env_scrubbed and 'HF_TOKEN' not in os.environ and h.scrubbed_count >= 1\n"
        "if sys.platform.startswith('linux'):\n"
        "    assert h.anti_debug_enabled\n"
        "    assert 'TracerPid' in open('/proc/self/status').read()  # still readable by ourselves\n"
        "print('ok')\n"
    )
    env = {**os.environ, "HF_TOKEN": "secret-value"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "ok"


# --- hardware, thermal, runtime hash --------------------------------------------------------------------


def test_chip_parsing_and_bandwidth():
    assert parse_chip("Apple M3 Max") == parse_chip("Apple M3 Max ")
    chip = parse_chip("Apple M3 Max")
    assert (chip.family, chip.tier) == ("M3", "Max") and memory_bandwidth_gbs(chip, 40) == 400
    assert (parse_chip("Apple M2").family, parse_chip("Apple M2").tier) == ("M2", "Base")
    assert parse_chip("AMD EPYC 7B13").family == "Unknown" and memory_bandwidth_gbs(parse_chip("x")) == 0


def test_hardware_reports_ints_and_the_limited_memory():
    snap = MemorySnapshot(physical_bytes=16 * GiB, available_bytes=int(7.5 * GiB))
    hw = detect_hardware(snap)
    assert hw.memory_gb == 16 and type(hw.memory_gb) is int
    assert hw.memory_available_gb == 7.5
    assert type(hw.cpu_cores.total) is int and hw.cpu_cores.total >= 1 and type(hw.gpu_cores) is int
    # Real published outputs of every kind are in test_macos_readers.py; this checks the wiring.
    outputs = {("sysctl", "hw.model"): "hw.model: Mac15,8\n",
               ("sysctl", "machdep.cpu.brand_string"): "machdep.cpu.brand_string: Apple M3 Max\n",
               ("sysctl", "hw.physicalcpu"): "hw.physicalcpu: 16\n", ("sysctl", "hw.nperflevels"): "hw.nperflevels: 2\n",
               ("sysctl", "hw.perflevel0.physicalcpu"): "hw.perflevel0.physicalcpu: 12\n",
               ("sysctl", "hw.perflevel0.name"): "hw.perflevel0.name: Performance\n",
               ("sysctl", "hw.perflevel1.physicalcpu"): "hw.perflevel1.physicalcpu: 4\n",
               ("sysctl", "hw.perflevel1.name"): "hw.perflevel1.name: Efficiency\n"}
    mac = detect_hardware(snap, platform="darwin", run=lambda argv: outputs.get(tuple(argv),
                          '  "gpu-core-count" = 40\n' if argv[0] == "ioreg" else None))
    assert (mac.machine_model, mac.chip_family, mac.chip_tier, mac.gpu_cores) == ("Mac15,8", "M3", "Max", 40)
    assert (mac.cpu_cores.total, mac.cpu_cores.performance, mac.cpu_cores.efficiency) == (16, 12, 4)


def test_pmset_thermal_parsing():
    assert parse_pmset_therm("CPU_Scheduler_Limit = 100\nCPU_Speed_Limit = 100\n").value == "nominal"
    assert parse_pmset_therm("CPU_Speed_Limit = 85").value == "fair"
    assert parse_pmset_therm("CPU_Speed_Limit = 60").value == "serious"
    assert parse_pmset_therm("CPU_Speed_Limit = 20").value == "critical"
    assert parse_pmset_therm(None) is None  # nothing read is not "nominal": see test_macos_readers.py


def test_runtime_hash_is_deterministic_hex_and_overridable():
    first = compute_runtime_hash()
    assert first == compute_runtime_hash()
    assert len(first) == 64 and int(first, 16) >= 0
    assert runtime_hash(None) == first
    assert runtime_hash("operator-pinned") == "operator-pinned"


def test_runtime_hash_covers_the_provider_source(tmp_path, monkeypatch):
    import provider.runtime_hash as rh

    before = compute_runtime_hash()
    extra = Path(rh.__file__).parent / "_runtime_hash_probe_tmp.py"
    extra.write_text("X = 1\n")
    try:
        assert compute_runtime_hash() != before
    finally:
        extra.unlink()
    assert compute_runtime_hash() == before


def test_main_serve_refuses_dev_posture_for_a_remote_coordinator(tmp_path, capsys):
    from provider.agent import EXIT_CONFIG, main_serve
    from provider.config import Settings

    settings = Settings(coordinator_url="wss://api.darkbloom.dev/ws/provider", dev_posture=True,
                        state_dir=tmp_path / "state")
    assert main_serve(settings) == EXIT_CONFIG
    assert "loopback" in capsys.readouterr().err
    assert not (tmp_path / "state").exists()  # refused before creating keys or touching anything
