"""`doctor` explains routing from the code the agent runs — what a coordinator sees (posture,
privacy capabilities, backend, runtime hash), whether it trusts the machine, and per advertised model
whether the coordinator's free-memory gate lets a cold request through, with the fix in one line.

The end-to-end tests run the real CLI (`python -m provider.cli doctor --json`) in a subprocess against the
coordinator double serving a model catalog; an 8 GiB machine is emulated with `memory_limit_gb`.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

from cli_runner import clean_env
from coordinator_double import CoordinatorDouble, DoubleConfig
from protocol import PrivacyCapabilities
from protocol.attest import SecurityPosture
from provider.config import Settings
from provider.doctor import ProblemCode, run_doctor
from provider.hardening import Hardening
from provider.session.gates import (
    KV_BYTES_PER_TOKEN,
    GateVerdict,
    TrustIssue,
    catalog_url,
    memory_gate,
    parse_catalog,
    trust_problems,
)
from provider.session.posture import HostPosture, Posture

GIB = 1 << 30
LINUX_HOST = HostPosture(sip_enabled=False, secure_boot_enabled=False, rdma_disabled=True, virtual_machine=False)
HARDENED = Hardening(core_dumps_disabled=True, anti_debug_enabled=True, env_scrubbed=True)


# --- the coordinator's rules, pure ----------------------------------------------------------------------


def test_a_linux_host_without_dev_posture_is_untrusted_and_with_it_is_trusted():
    honest = Posture(LINUX_HOST, HARDENED, dev=False)
    problems = trust_problems(backend="inprocess-mlx", privacy=honest.privacy_capabilities(),
                              security=honest.security())
    assert {(p.issue, p.subject) for p in problems} == {
        (TrustIssue.PRIVACY_CAPABILITY, "python_runtime_locked"),
        (TrustIssue.PRIVACY_CAPABILITY, "dangerous_modules_blocked"),
        (TrustIssue.SIP_DISABLED, "sip_enabled"),
        (TrustIssue.SECURE_BOOT_DISABLED, "secure_boot_enabled"),
    }
    dev = Posture(LINUX_HOST, HARDENED, dev=True)
    assert trust_problems(backend="inprocess-mlx", privacy=dev.privacy_capabilities(), security=dev.security()) == ()
    assert [p.issue for p in trust_problems(backend="mlx-swift", privacy=dev.privacy_capabilities(),
                                            security=dev.security())] == [TrustIssue.BACKEND]


def test_rdma_on_bare_metal_is_untrusted_but_under_a_hypervisor_it_is_not():
    privacy = Posture(LINUX_HOST, HARDENED, dev=True).privacy_capabilities()
    bare = SecurityPosture(sip_enabled=True, secure_boot_enabled=True, rdma_disabled=False, hypervisor_active=False)
    vm = SecurityPosture(sip_enabled=True, secure_boot_enabled=True, rdma_disabled=False, hypervisor_active=True)
    assert [p.issue for p in trust_problems(backend="inprocess-mlx", privacy=privacy, security=bare)] == [
        TrustIssue.RDMA_ENABLED]
    assert trust_problems(backend="inprocess-mlx", privacy=privacy, security=vm) == ()
    assert isinstance(privacy, PrivacyCapabilities)


@pytest.mark.parametrize("size_gib, resident_gib, preloaded, verdict", [
    (1.0, 1.2, False, GateVerdict.PASSES),  # 1 + 3.05 KV ≤ 8
    (6.0, 0.1, False, GateVerdict.BLOCKED_COLD),  # 6 + 3.05 > 8, but loaded: 3.05 ≤ 8 − 0.1
    (6.0, 0.1, True, GateVerdict.PASSES_PRELOADED),
    (12.0, 6.0, False, GateVerdict.BLOCKED),  # larger than the machine; even loaded 3.05 > 8 − 6
    (12.0, 6.0, True, GateVerdict.BLOCKED),
    (None, 6.0, False, GateVerdict.NOT_GATED),  # no catalog size: the gate is off
])
def test_the_free_memory_gate_on_an_8_gib_provider(size_gib, resident_gib, preloaded, verdict):
    gate = memory_gate(total_bytes=8 * GIB, size_bytes=None if size_gib is None else int(size_gib * GIB),
                       resident_bytes=int(resident_gib * GIB), preloaded=preloaded)
    assert gate.verdict is verdict
    assert gate.kv_estimate_bytes == 8192 * KV_BYTES_PER_TOKEN
    assert memory_gate(total_bytes=8 * GIB, size_bytes=GIB, resident_bytes=GIB,
                       in_catalog=False).verdict is GateVerdict.NOT_IN_CATALOG


def test_the_catalog_is_read_from_the_coordinators_http_origin():
    assert catalog_url("wss://user:pw@api.example:8443/ws/provider?x=1") == "https://api.example:8443/v1/models/catalog"
    assert catalog_url("ws://127.0.0.1:8080/ws/provider") == "http://127.0.0.1:8080/v1/models/catalog"
    doc = {"models": [{"id": "a", "size_gb": 4.5}, {"id": "b"}, {"id": "c", "size_gb": True}, {"size_gb": 1}, "x"]}
    assert parse_catalog(doc) == {"a": int(4.5 * GIB), "b": None, "c": None}
    assert parse_catalog({"data": [{"id": "a", "size_gb": 1}]}) == parse_catalog([{"id": "a", "size_gb": 1}])
    with pytest.raises(ValueError):
        parse_catalog({"object": "list"})


def test_dev_posture_for_a_remote_coordinator_is_an_error(tmp_path, tiny_model_path):
    settings = Settings(coordinator_url="wss://coord.example/ws/provider", dev_posture=True,
                        state_dir=tmp_path / "state", hf_cache_dir=tmp_path / "hub",
                        model_aliases={"tiny": tiny_model_path})
    report = run_doctor(settings, check_coordinator_url=False, env={}, hardening=HARDENED)
    [problem] = [p for p in report.problems if p.code is ProblemCode.DEV_POSTURE_REFUSED]
    assert problem.severity.value == "error" and not report.ok and "wss://" in problem.detail


# --- doctor --json against the coordinator double's catalog --------------------------------------------------


CATALOG = (("tiny", 0.005), ("warmable", 6.0), ("big", 12.0))


async def doctor_json(home: Path, url: str, models: dict[str, Path], *extra: str) -> dict:
    env = clean_env()
    env.update(HOME=str(home), XDG_CONFIG_HOME=str(home / ".config"), XDG_DATA_HOME=str(home / ".local/share"))
    aliases = [arg for model_id, path in models.items() for arg in ("--model-aliases", f"{model_id}={path}")]
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "provider.cli", "doctor", "--json", "--timeout", "10", "--coordinator-url", url,
        "--hf-cache-dir", str(home / "hub"), "--memory-limit-gb", "8", "--memory-reserve-gb", "0.5", *aliases, *extra,
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(process.communicate(), 120)
    assert process.returncode in (0, 1), err.decode()[-2000:]
    return json.loads(out)


@pytest.fixture
async def catalog_double() -> CoordinatorDouble:
    async with CoordinatorDouble(DoubleConfig(catalog=CATALOG)) as double:
        yield double


async def test_doctor_json_gates_each_model_by_the_coordinators_catalog(catalog_double, tmp_path, tiny_model_path,
                                                                        small_model_path):
    """On an (emulated) 8 GiB machine: a catalog size far smaller passes; one larger than the machine is
    blocked even when loaded; one that fits only when loaded gets "preload it"; an id the catalog does not
    list is dropped at register. Without dev_posture, on Linux, the machine is plainly untrusted."""
    (tmp_path / "hub").mkdir()
    models = {"tiny": tiny_model_path, "warmable": small_model_path, "big": small_model_path,
              "unlisted": tiny_model_path}
    doc = await doctor_json(tmp_path, catalog_double.ws_url, models)
    routing = doc["routing"]
    assert routing["catalog"] == {"url": catalog_double.ws_url.replace("ws://", "http://").replace("/ws/provider", "/v1/models/catalog"), "checked": True,
                                  "reachable": True, "detail": "ok", "models": 3}
    gates = {m["id"]: m for m in routing["models"]}
    assert gates["tiny"]["verdict"] == "passes" and gates["tiny"]["fix"] is None
    assert gates["tiny"]["size_source"] == "catalog" and gates["tiny"]["size_bytes"] == round(0.005 * GIB)
    # Larger than the machine: no cold request gets through. (Its weights here are the small model's, so
    # loaded it would pass: the fix is to preload it.)
    assert gates["big"]["size_bytes"] > gates["big"]["total_bytes"] and gates["big"]["cold"]["passes"] is False
    assert gates["big"]["verdict"] == "blocked_cold" and "12.0 GiB + 3.1 GiB KV against 8.0 GiB" in gates["big"]["fix"]
    assert gates["warmable"]["verdict"] == "blocked_cold" and gates["warmable"]["warm"]["passes"] is True
    assert gates["warmable"]["fix"].startswith('preload it: preload_models = ["warmable"]')
    assert gates["unlisted"]["verdict"] == "not_in_catalog" and "model_aliases" in gates["unlisted"]["fix"]
    assert gates["tiny"]["total_bytes"] == 8 * GIB and routing["coordinator_sees"]["total_memory_gb"] == 8.0
    problems = {(p["code"], p["subject"]) for p in doc["problems"]}
    assert {("memory_gate_blocks", "big"), ("memory_gate_blocks", "warmable"), ("not_in_catalog", "unlisted")} <= problems

    # What the coordinator sees, and what its operator must set.
    sees = routing["coordinator_sees"]
    assert sees["backend"] == "inprocess-mlx" and sees["runtime_hash"] == doc["runtime_hash"]
    assert any(doc["runtime_hash"] in need and "KNOWN_RUNTIME_HASHES" in need for need in routing["coordinator_must"])
    if sys.platform != "darwin":  # Linux without dev_posture: plainly untrusted
        assert routing["trusted"] is False and sees["posture"]["sip_enabled"] is False
        assert {"code": "sip_disabled", "subject": "sip_enabled"} in routing["untrusted_reasons"]
        assert sees["privacy_capabilities"]["python_runtime_locked"] is False
        [untrusted] = [p for p in doc["problems"] if p["code"] == "coordinator_untrusted"]
        assert "dev_posture = true" in untrusted["detail"] and "not a Mac" in untrusted["detail"]

    # Preloading the one that only fits warm clears it; dev_posture (loopback coordinator) makes it trusted.
    doc = await doctor_json(tmp_path, catalog_double.ws_url, models, "--preload-models", "warmable",
                            "--dev-posture", "true")
    routing = doc["routing"]
    gates = {m["id"]: m for m in routing["models"]}
    assert gates["warmable"]["verdict"] == "passes_preloaded" and gates["warmable"]["preloaded"] is True
    assert routing["trusted"] is True and routing["untrusted_reasons"] == []
    assert routing["coordinator_sees"]["posture"] == {"sip_enabled": True, "secure_boot_enabled": True,
                                                      "rdma_disabled": True, "hypervisor_active": False}
    assert all(routing["coordinator_sees"]["privacy_capabilities"][f] for f in routing["required_privacy_capabilities"])
    assert not [p for p in doc["problems"] if p["code"] in ("coordinator_untrusted", "dev_posture_refused")]


async def test_without_a_reachable_catalog_the_weight_size_stands_in(tmp_path, tiny_model_path):
    (tmp_path / "hub").mkdir()
    doc = await doctor_json(tmp_path, "ws://127.0.0.1:9/ws/provider", {"tiny": tiny_model_path}, "--no-coordinator")
    routing = doc["routing"]
    assert routing["catalog"]["checked"] is False and routing["catalog"]["detail"] == "not_checked"
    [tiny] = routing["models"]
    assert tiny["size_source"] == "weights" and tiny["size_bytes"] == doc["models"][0]["weight_bytes"]
    assert tiny["verdict"] == "passes"
