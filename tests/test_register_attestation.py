"""``register.attestation`` — the self-signed trust a coordinator at ``EIGENINFERENCE_MIN_TRUST=
self_signed`` routes, only where every value is the machine's (or the loopback dev posture's), and
``doctor`` saying which trust level the coordinator will assign and why.

End to end: the real agent (tiny MLX model) against the coordinator double, which checks the attestation
as [A] does (``coordinator_double/attestation.py``): routed at a ``self_signed`` minimum; the same blob
altered in flight is refused and nothing is routed; without the dev posture no attestation is sent and the
log says why. ``doctor`` runs as the real CLI in a subprocess.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import openai
import pytest

from cli_runner import clean_env
from coordinator_double import (
    ATTESTED_HEADER,
    TRUST_LEVEL_HEADER,
    ChallengeResult,
    CoordinatorDouble,
    Dispatched,
    FrameReceived,
    Registered,
    SignatureCheck,
    TrustLevel,
    Unroutable,
)
from double_fixtures import consumer_for, quick_config
from protocol import AttestationResponse, Register
from protocol.attest import ChallengeSigner
from provider.agent import Agent
from provider.config import Settings
from provider.hardening import Hardening
from provider.session.attestation import AttestationGap, plan_attestation, signed_attestation
from provider.session.connection import websocket_connect
from provider.session.gates import TrustLevel as Level
from provider.session.gates import routing_minimums
from provider.session.posture import HostPosture, Posture
from provider.telemetry import capture_redacted_logs

NO_EOS = frozenset({10**9})
HARDENED = Hardening(core_dumps_disabled=True, anti_debug_enabled=True, env_scrubbed=True)
LINUX = HostPosture(sip_enabled=False, secure_boot_enabled=False, rdma_disabled=True, virtual_machine=False,
                    authenticated_root_enabled=False)
MAC_FULL_SECURITY = HostPosture(sip_enabled=True, secure_boot_enabled=True, rdma_disabled=True, virtual_machine=False,
                                authenticated_root_enabled=True, secure_enclave=True)  # Apple silicon


# --- what may be claimed -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("host", "dev", "gaps"), [
    (LINUX, False,
     [AttestationGap.NO_SECURE_ENCLAVE, AttestationGap.SIP_DISABLED, AttestationGap.SECURE_BOOT_DISABLED]),
    # A real Apple-silicon Mac with SIP, Full Security and a sealed volume: attested with its own values.
    (MAC_FULL_SECURITY, False, []),
    (replace(MAC_FULL_SECURITY, authenticated_root_enabled=None), False, [AttestationGap.AUTHENTICATED_ROOT_UNKNOWN]),
    (replace(MAC_FULL_SECURITY, secure_boot_enabled=None), False, [AttestationGap.SECURE_BOOT_UNKNOWN]),
    (replace(MAC_FULL_SECURITY, secure_enclave=False), False, [AttestationGap.NO_SECURE_ENCLAVE]),  # Intel, a VM
    (replace(MAC_FULL_SECURITY, authenticated_root_enabled=False), False, []),  # sent, and says false
    (LINUX, True, []),  # the dev posture on a loopback coordinator: the harness's values
])
def test_an_attestation_is_planned_only_when_every_value_is_known_and_accepted(host, dev, gaps):
    plan = plan_attestation(Posture(host, HARDENED, dev=dev))
    assert list(plan.gaps) == gaps
    assert plan.sendable is (not gaps)
    assert plan.trust_level is (Level.SELF_SIGNED if not gaps else Level.NONE)
    assert plan.secure_enclave_available is (host.secure_enclave or dev)  # the host has one, or the harness says so
    signer = ChallengeSigner.generate()
    signed = signed_attestation(plan, signer=signer, encryption_public_key="k", chip_name="c", hardware_model="m",
                                os_version="v")
    assert (signed is None) is bool(gaps)


def test_a_real_apple_silicon_mac_signs_its_own_posture():
    signer = ChallengeSigner.generate()
    host = replace(MAC_FULL_SECURITY, authenticated_root_enabled=False)
    plan = plan_attestation(Posture(host, HARDENED))
    signed = signed_attestation(plan, signer=signer, encryption_public_key="x25519-key", chip_name="Apple M4 Max",
                                hardware_model="Mac16,5", os_version="15.3.0")
    blob = json.loads(signed.text)["attestation"]
    assert (blob["secureEnclaveAvailable"], blob["sipEnabled"], blob["secureBootEnabled"]) == (True, True, True)
    assert blob["authenticatedRootEnabled"] is False and blob["rdmaDisabled"] is True  # the host's, not the dev's


def test_the_dev_posture_blob_carries_the_registered_key_and_the_challenge_key():
    signer = ChallengeSigner.generate()
    plan = plan_attestation(Posture(LINUX, HARDENED, dev=True))
    signed = signed_attestation(plan, signer=signer, encryption_public_key="x25519-key", chip_name="Apple M3 Max",
                                hardware_model="Mac15,8", os_version="15.3.0")
    blob = json.loads(signed.text)["attestation"]
    assert blob["publicKey"] == signer.public_key_b64 and blob["encryptionPublicKey"] == "x25519-key"
    assert (blob["secureEnclaveAvailable"], blob["sipEnabled"], blob["secureBootEnabled"]) == (True, True, True)
    assert blob["hypervisorActive"] is False and "serialNumber" not in blob  # no device identifier is sent
    assert routing_minimums(Level.SELF_SIGNED) == (Level.NONE, Level.SELF_SIGNED)
    assert routing_minimums(Level.NONE) == (Level.NONE,)


# --- end to end ----------------------------------------------------------------------------------------------


class TamperRegister:
    """A real WebSocket whose outgoing ``register`` frame is edited in flight (nothing else is touched)."""

    def __init__(self, ws: Any, edit: Callable[[str], str]) -> None:
        self._ws, self._edit = ws, edit

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ws, name)

    def __aiter__(self) -> Any:
        return self._ws.__aiter__()

    async def send(self, message: str) -> None:
        if message.startswith('{"type":"register"'):
            message = self._edit(message)
        await self._ws.send(message)

    async def close(self, code: int = 1000, reason: str = "") -> None:
        await self._ws.close(code, reason)


def tampering(edit: Callable[[str], str]):
    real = websocket_connect(open_timeout_s=5)

    async def connect(url: str) -> TamperRegister:
        return TamperRegister(await real(url), edit)

    return connect


@pytest.fixture
async def start_agent(tiny_model_path: Path, tmp_path: Path) -> AsyncIterator[Callable[..., Any]]:
    running: list[tuple[asyncio.Event, asyncio.Task[int]]] = []

    async def start(url: str, *, dev_posture: bool = True, connect=None) -> Agent:
        settings = Settings(coordinator_url=url, dev_posture=dev_posture, state_dir=tmp_path / "state",
                            hf_cache_dir=tmp_path / "empty-hf-cache", model_aliases={"tiny": tiny_model_path},
                            memory_limit_gb=8.0, memory_reserve_gb=0.5, heartbeat_interval_s=0.5,
                            drain_timeout_s=5.0, idle_timeout_mins=0, local_enabled=False)
        agent = await Agent.start(settings, harden=False, connect=connect, eos_token_ids={"tiny": NO_EOS})
        stop = asyncio.Event()
        running.append((stop, asyncio.create_task(agent.run(stop))))
        return agent

    yield start
    for stop, task in running:
        stop.set()
        assert await asyncio.wait_for(task, 30) == 0


def self_signed_double() -> CoordinatorDouble:
    return CoordinatorDouble(quick_config(min_trust=TrustLevel.SELF_SIGNED, queue_timeout=1.0))


def register_of(double: CoordinatorDouble) -> Register:
    [frame] = [e.message for e in double.events.of(FrameReceived) if isinstance(e.message, Register)]
    return frame


async def test_a_self_signed_coordinator_routes_the_dev_posture_agent(start_agent):
    async with self_signed_double() as double:
        agent = await start_agent(double.ws_url)
        [view] = await double.wait_routable(model="tiny", timeout=20)
        assert view.attested and view.trust_level is TrustLevel.SELF_SIGNED and view.attestation_error is None
        blob = json.loads(register_of(double).attestation.text)["attestation"]
        assert blob["encryptionPublicKey"] == register_of(double).public_key == agent.keys.encryption.public_key_b64
        assert blob["publicKey"] == agent.keys.signer.public_key_b64
        # Challenge answers are now checked with the attested key, status signature included.
        result = await double.wait_for(lambda e: isinstance(e, ChallengeResult), timeout=10)
        assert result.ok and result.signature is SignatureCheck.VERIFIED
        [answer] = [e.message for e in double.events.of(FrameReceived)
                    if isinstance(e.message, AttestationResponse) and e.message.nonce == result.nonce]
        assert answer.status_signature and answer.public_key == agent.keys.encryption.public_key_b64
        async with consumer_for(double) as client:
            raw = await client.chat.completions.with_raw_response.create(
                model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=4, temperature=0)
        assert raw.headers[ATTESTED_HEADER] == "true" and raw.headers[TRUST_LEVEL_HEADER] == "self_signed"
        assert raw.parse().usage.completion_tokens == 4


async def test_a_tampered_blob_is_refused_and_nothing_is_routed(start_agent):
    """The agent's own blob with one value changed after signing: [A] refuses it (trust none), still checks
    challenge signatures with its key — which pass, the key is ours — and routes nothing at self_signed."""
    async with self_signed_double() as double:
        await start_agent(double.ws_url, connect=tampering(lambda text: text.replace('"rdmaDisabled":true',
                                                                                     '"rdmaDisabled":false', 1)))
        registered = await double.wait_for(lambda e: isinstance(e, Registered), timeout=20)
        assert not registered.attested and registered.trust_level is TrustLevel.NONE
        assert registered.attestation_error == "signature verification failed"
        assert '"rdmaDisabled":false' in register_of(double).attestation.text  # the edit did reach the wire
        result = await double.wait_for(lambda e: isinstance(e, ChallengeResult), timeout=10)
        assert result.ok and result.signature is SignatureCheck.VERIFIED
        view = double.provider(0)
        assert not view.routable and view.unroutable == (Unroutable.TRUST_BELOW_MINIMUM,)
        async with consumer_for(double) as client:
            with pytest.raises(openai.APIStatusError) as refused:
                await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello"}],
                                                     max_tokens=4)
        assert refused.value.status_code == 503 and not double.events.of(Dispatched)


async def test_without_the_dev_posture_no_attestation_is_sent_and_the_log_says_why(start_agent):
    """On this host (not a Mac: no Secure Enclave) the agent sends none — never an Enclave it lacks — and logs
    the reasons; the self-signed coordinator registers it at trust none."""
    async with self_signed_double() as double:
        with capture_redacted_logs() as logs:
            await start_agent(double.ws_url, dev_posture=False)
        [note] = [e for e in logs if e["event"] == "attestation_not_sent"]
        assert note["state"] == "none" and note["reason"][0] == "no_secure_enclave"
        registered = await double.wait_for(lambda e: isinstance(e, Registered), timeout=20)
        assert registered.trust_level is TrustLevel.NONE and registered.attestation_error is None
        assert register_of(double).attestation is None


# --- doctor --------------------------------------------------------------------------------------------------


async def doctor(home: Path, tiny: Path, *args: str) -> str:
    env = clean_env()
    env.update(HOME=str(home), XDG_CONFIG_HOME=str(home / ".config"), XDG_DATA_HOME=str(home / ".local/share"))
    (home / "hub").mkdir(exist_ok=True)
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "provider.cli", "doctor", "--no-coordinator", "--hf-cache-dir", str(home / "hub"),
        "--coordinator-url", "ws://127.0.0.1:9/ws/provider", "--model-aliases", f"tiny={tiny}", *args,
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(process.communicate(), 120)
    assert process.returncode in (0, 1), err.decode()[-2000:]
    return out.decode()


async def test_doctor_shows_the_trust_level_the_coordinator_will_assign_and_why(tmp_path, tiny_model_path):
    honest = json.loads(await doctor(tmp_path, tiny_model_path, "--json"))["routing"]
    trust = honest["trust_level"]
    assert trust["level"] == "none" and trust["attestation_sent"] is False
    assert trust["routes_at_min_trust"] == ["none"]
    assert trust["reasons"][0]["code"] == "no_secure_enclave" and "no Secure Enclave" in trust["reasons"][0]["detail"]
    assert trust["signing_key"].startswith("a software key in a file (0600)")
    assert trust["attestation"]["secureEnclaveAvailable"] is False
    if sys.platform != "darwin":
        assert [r["code"] for r in trust["reasons"]] == ["no_secure_enclave", "sip_disabled", "secure_boot_disabled"]
    assert honest["coordinator_must"][0].startswith("EIGENINFERENCE_MIN_TRUST=none ")

    # The dev posture as the operator reads it (its values are the plan's, checked above).
    text = await doctor(tmp_path, tiny_model_path, "--dev-posture", "true")
    [line] = [line for line in text.splitlines() if line.strip().startswith("trust level ")]
    assert line.strip().startswith("trust level self_signed: register carries an attestation")
    assert "dev posture" in line and "EIGENINFERENCE_MIN_TRUST=none or self_signed" in line
    assert "a software key in a file (0600)" in line and "cannot tell from an Enclave-held key" in line
    assert any(line.strip().startswith("EIGENINFERENCE_MIN_TRUST=self_signed or none") for line in text.splitlines())


def test_doctor_on_an_apple_silicon_mac_says_self_signed_and_that_the_key_is_a_software_key():
    from provider.doctor.routing import gather_routing, routing_json, trust_sentence

    report = gather_routing(Settings(), total_bytes=16 * 2**30, models=(), runtime_hash=None, check_catalog=False,
                            timeout_s=1.0, host=MAC_FULL_SECURITY, hardening=HARDENED)
    sentence = trust_sentence(report)
    assert sentence.startswith("self_signed: register carries an attestation of this host's posture")
    assert "a software key in a file (0600), not held in the Secure Enclave" in sentence
    assert "self_signed means exactly that" in sentence
    trust = routing_json(report)["trust_level"]
    assert trust["attestation_sent"] is True and trust["reasons"] == []
    blob = trust["attestation"]
    assert blob["secureEnclaveAvailable"] is True and blob["authenticatedRootEnabled"] is True
