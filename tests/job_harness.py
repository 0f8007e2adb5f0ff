"""One inference_request through a job with no socket: the coordinator's half of the crypto
(``Coordinator``: it seals the request and opens each chunk, as the Go coordinator does) and a job
context on a real engine and model manager (``Harness``), the frames it sent kept in order.
"""

from __future__ import annotations

import base64
import json

from nacl.public import Box, PrivateKey, PublicKey

from memory import Ledger, Probe
from protocol import EncryptedPayload, InferenceRequest
from protocol.crypto import ProviderIdentity
from provider.config import Settings
from provider.doctor import cap_figures
from provider.engine import Engine
from provider.jobs import JobContext, JobOutcome, PromptCounter, ServingStats, run_job
from provider.models import discover
from provider.slots import ModelManager

NO_EOS = frozenset({10**9})  # the tiny model never stops early: completions have exactly max_tokens


class Coordinator:
    """The coordinator's half of the crypto for one provider identity."""

    def __init__(self, provider_key_b64: str) -> None:
        self.provider_key = provider_key_b64
        self.session = PrivateKey.generate()
        self.box = Box(self.session, PublicKey(base64.b64decode(provider_key_b64)))

    def request(self, rid: str, body: dict | bytes) -> InferenceRequest:
        plaintext = body if isinstance(body, bytes) else json.dumps(body).encode()
        sealed = base64.b64encode(self.box.encrypt(plaintext)).decode()
        return InferenceRequest(request_id=rid, encrypted_body=EncryptedPayload(
            ephemeral_public_key=base64.b64encode(bytes(self.session.public_key)).decode(), ciphertext=sealed))

    def open_chunk(self, frame: dict) -> bytes:
        assert "data" not in frame  # never plaintext
        assert frame["encrypted_data"]["ephemeral_public_key"] == self.provider_key
        return self.box.decrypt(base64.b64decode(frame["encrypted_data"]["ciphertext"]))


class Harness:
    def __init__(self, settings: Settings, engine: Engine, eos: frozenset[int] | None = NO_EOS) -> None:
        self.identity = ProviderIdentity.generate()
        self.coordinator = Coordinator(self.identity.public_key_b64)
        inventory = discover(hf_cache=None, aliases=settings.model_aliases)
        self.probe = Probe(settings.memory_limit_gb)
        self.ledger = Ledger(cap_figures(settings, self.probe.snapshot()), sample=self.probe.snapshot)
        self.engine = engine
        self.manager = ModelManager.from_settings(settings, engine, inventory, self.ledger, self.probe,
                                                  eos_token_ids=None if eos is None else {"tiny": eos})
        self.stats = ServingStats()
        self.ctx = JobContext(identity=self.identity, manager=self.manager,
                              counter=PromptCounter({m.id: m.path for m in inventory.models}), stats=self.stats)
        self.frames: list[dict] = []

    def send(self, text: str) -> None:
        self.frames.append(json.loads(text))

    async def run(self, request: InferenceRequest) -> JobOutcome:
        return await run_job(request, self.ctx, self.send)

    def of(self, rid: str) -> list[dict]:
        return [f for f in self.frames if f.get("request_id") == rid]

    def events(self, rid: str) -> list[bytes]:
        return [self.coordinator.open_chunk(f) for f in self.of(rid) if f["type"] == "inference_response_chunk"]


def chat(content: str = "hello there", max_tokens: int = 6, **extra) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, **extra}


def sse_json(event: bytes) -> dict:
    """One chunk's plaintext: exactly one ``data: {json}`` line, with no blank line after it (the coordinator
    adds the blank line when it relays the event)."""
    assert event.startswith(b"data: ") and b"\n" not in event and event.count(b"data: ") == 1
    return json.loads(event[len(b"data: "):])
