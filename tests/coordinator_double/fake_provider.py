"""A scripted fake provider for driving the coordinator double (tests only).

A plain ``websockets`` client speaking ``protocol``: it registers, answers challenges (validly by default,
or with any ``answer`` callback), queues each decrypted ``inference_request`` as a ``Job`` and records
cancels; the test then scripts the job (``accept``, ``event``, ``stream``, ``complete``, ``reject``) or
sends any raw text with ``send``. Not a provider implementation: it does exactly what the test says.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from protocol import (
    AttestationChallenge,
    Cancel,
    CpuCores,
    Hardware,
    Heartbeat,
    HeartbeatStats,
    InferenceAccepted,
    InferenceComplete,
    InferenceError,
    InferenceRequest,
    ModelInfo,
    PrivacyCapabilities,
    RawJSON,
    Register,
    SystemMetrics,
    Usage,
    decode,
    encode,
)
from protocol.attest import ChallengeSigner, SecurityPosture, answer_challenge
from protocol.crypto import ProviderIdentity, RequestBox
from protocol.sse import ChunkFactory, CompletionUsage, FinishReason, data_line

MODEL = "tiny/test-model"
GOOD_POSTURE = SecurityPosture(sip_enabled=True, secure_boot_enabled=True, rdma_disabled=True, hypervisor_active=False)


@dataclass
class Job:
    request_id: str
    box: RequestBox
    body: dict[str, Any]
    session_key: str


class FakeProvider:
    """Registers, answers challenges (per ``answer``), queues decrypted requests and records cancels."""

    def __init__(self, url: str, *, answer: Callable[[AttestationChallenge, FakeProvider], Any] | None = None) -> None:
        self.url = url
        self.identity = ProviderIdentity.generate()
        self.signer = ChallengeSigner.generate()
        self.answer = answer or FakeProvider.valid_answer
        self.jobs: asyncio.Queue[Job] = asyncio.Queue()
        self.cancels: list[str] = []
        self.raw_frames: list[str | bytes] = []
        self.ws: ClientConnection | None = None
        self._reader: asyncio.Task[None] | None = None
        self._received = asyncio.Condition()

    def valid_answer(self, challenge: AttestationChallenge) -> Any:
        return answer_challenge(challenge, public_key_b64=self.identity.public_key_b64, signer=self.signer, posture=GOOD_POSTURE)

    def register_frame(self, *, attested: bool = False, models: tuple[str, ...] = (MODEL,), **overrides: Any) -> Register:
        fields: dict[str, Any] = {
            "hardware": Hardware(
                machine_model="Linux",
                chip_name="test",
                chip_family="Unknown",
                chip_tier="Unknown",
                memory_gb=64,
                memory_available_gb=58.0,
                cpu_cores=CpuCores(total=2, performance=2, efficiency=0),
                gpu_cores=0,
                memory_bandwidth_gbs=50.0,
            ),
            "models": tuple(ModelInfo(id=m, size_bytes=1000, model_type="llama", quantization="f32") for m in models),
            "backend": "inprocess-mlx",
            "version": "0.1.0",
            "public_key": self.identity.public_key_b64,
            "encrypted_response_chunks": True,
            "privacy_capabilities": PrivacyCapabilities(
                text_backend_inprocess=True,
                text_proxy_disabled=True,
                python_runtime_locked=True,
                dangerous_modules_blocked=True,
                sip_enabled=True,
                anti_debug_enabled=True,
                core_dumps_disabled=True,
                env_scrubbed=True,
                hypervisor_active=False,
            ),
        }
        if attested:
            fields["attestation"] = self.attestation()
        fields.update(overrides)
        return Register(**fields)

    def attestation(self, **blob_overrides: Any) -> RawJSON:
        """A registration attestation [A] accepts (the fields of its Go test attestations), written by hand
        rather than with the provider's encoder; ``blob_overrides`` change fields before signing."""
        blob = {
            "authenticatedRootEnabled": True,
            "chipName": "Apple M3 Max",
            "encryptionPublicKey": self.identity.public_key_b64,
            "hardwareModel": "Mac15,8",
            "hypervisorActive": False,
            "osVersion": "15.3.0",
            "publicKey": self.signer.public_key_b64,
            "rdmaDisabled": True,
            "secureBootEnabled": True,
            "secureEnclaveAvailable": True,
            "sipEnabled": True,
            "timestamp": "2026-04-16T12:00:00Z",
            **blob_overrides,
        }
        text = json.dumps(blob, sort_keys=True, separators=(",", ":"))
        return RawJSON(f'{{"attestation":{text},"signature":"{self.signer.sign(text.encode())}"}}')

    async def connect(self, register: Register | None = None) -> FakeProvider:
        self.ws = await connect(self.url, max_size=64 * 1024 * 1024, compression=None)
        self._reader = asyncio.create_task(self._read(self.ws))
        await self.send(encode(register or self.register_frame()))
        return self

    async def close(self) -> None:
        if self.ws is not None:
            await self.ws.close()
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)

    async def _read(self, ws: ClientConnection) -> None:
        try:
            async for frame in ws:
                self.raw_frames.append(frame)
                await self._handle(ws, frame)
                async with self._received:
                    self._received.notify_all()
        except ConnectionClosed:
            pass

    async def _handle(self, ws: ClientConnection, frame: str | bytes) -> None:
        try:
            message = decode(frame)
        except Exception:
            return  # injected garbage: kept in raw_frames only
        if isinstance(message, AttestationChallenge):
            reply = self.answer(self, message)
            if reply is not None:
                await ws.send(reply if isinstance(reply, str) else encode(reply))
        elif isinstance(message, InferenceRequest):
            assert message.encrypted_body is not None
            box, plaintext = self.identity.open_request(message.encrypted_body)
            job = Job(message.request_id, box, json.loads(plaintext), message.encrypted_body.ephemeral_public_key)
            self.jobs.put_nowait(job)
        elif isinstance(message, Cancel):
            self.cancels.append(message.request_id)

    async def received(self, condition: Callable[[], bool], timeout: float = 5.0) -> None:
        """Wait until ``condition()`` holds, re-checked after every frame this provider receives."""
        async with self._received:
            await asyncio.wait_for(self._received.wait_for(condition), timeout)

    async def send(self, text: str) -> None:
        assert self.ws is not None
        await self.ws.send(text)

    async def next_job(self, timeout: float = 5.0) -> Job:
        return await asyncio.wait_for(self.jobs.get(), timeout)

    async def heartbeat(self, **overrides: Any) -> None:
        fields: dict[str, Any] = {
            "status": "idle",
            "stats": HeartbeatStats(requests_served=0, tokens_generated=0),
            "system_metrics": SystemMetrics(memory_pressure=0.1, cpu_usage=0.1, thermal_state="nominal"),
        }
        fields.update(overrides)
        await self.send(encode(Heartbeat(**fields)))

    # job scripting

    async def accept(self, job: Job) -> None:
        await self.send(encode(InferenceAccepted(request_id=job.request_id)))

    async def event(self, job: Job, sse: bytes) -> None:
        await self.send(encode(job.box.seal_chunk(job.request_id, sse)))

    async def stream(self, job: Job, pieces: list[str], *, prompt_tokens: int = 5, usage_chunk: bool = False) -> None:
        """Role, one chunk per piece, finish, optional usage chunk, then inference_complete (one ``data:`` line
        per chunk; the coordinator adds the blank lines and the ``[DONE]``)."""
        factory = ChunkFactory(id="chatcmpl-fake", created=1777777777, model=job.body["model"])
        usage = CompletionUsage(prompt_tokens=prompt_tokens, completion_tokens=len(pieces))
        await self.event(job, data_line(factory.role()))
        for piece in pieces:
            await self.event(job, data_line(factory.content(piece)))
        await self.event(job, data_line(factory.finish(FinishReason.STOP)))
        if usage_chunk:
            usage_only = factory.chunk(factory.role().choices[0].delta, usage=usage).model_copy(update={"choices": ()})
            await self.event(job, data_line(usage_only))
        await self.complete(job, prompt_tokens, len(pieces))

    async def complete(self, job: Job, prompt_tokens: int, completion_tokens: int) -> None:
        usage = Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens)
        await self.send(encode(InferenceComplete(request_id=job.request_id, usage=usage)))

    async def reject(self, job: Job, status: int = 503) -> None:
        frame = InferenceError(request_id=job.request_id, error="Provider capacity is temporarily unavailable.", status_code=status)
        await self.send(encode(frame))
