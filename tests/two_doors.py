"""Both front doors over one `Runtime`, in the test's process.

* the coordinator's: a request sealed to the provider's key through `run_job`, its frames kept as the
  coordinator receives them;
* the local server's: its ASGI app (`create_app(RuntimeBackend(runtime))`) through httpx.

An answer is reduced to what a client acts on and what must not change from one ask of the same
question to the next: `LocalAnswer` (status, OpenAI error `code` and our `reason`, `Retry-After`),
`JobAnswer` (the frame types, `status_code`, `failure_code`, `error_reason`, `rejection_reason`).

``await start_runtime(tmp, {"id": path}, memory_limit_gb=8.0, ...)`` starts a Runtime with the suite's
usual settings for a rig (no hub, no SSD tier, no idle reaper, weights not hashed).
"""

from __future__ import annotations

import base64
import json
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from nacl.public import Box, PrivateKey, PublicKey

from protocol import EncryptedPayload, InferenceRequest
from protocol.crypto import ProviderIdentity
from provider.config import Settings
from provider.jobs import JobContext, run_job
from provider.local.app import create_app
from provider.local.backend import RuntimeBackend
from provider.runtime import Runtime


async def start_runtime(tmp: Path, models: dict[str, Path], **settings: Any) -> Runtime:
    (tmp / "hub").mkdir(parents=True, exist_ok=True)
    return await Runtime.start(Settings(**{
        "state_dir": tmp / "state", "hf_cache_dir": tmp / "hub", "model_aliases": models, "idle_timeout_mins": 0,
        "kv_ssd_budget_gb": 0, **settings}), hash_weights=False)


@dataclass(frozen=True)
class LocalAnswer:
    status: int
    code: str | None
    reason: str | None
    retry_after: str | None


@dataclass(frozen=True)
class JobAnswer:
    types: tuple[str, ...]
    status: int | None
    code: str | None
    reason: str | None
    rejection: str | None


def model_loads(runtime: Runtime, result: str) -> int:
    """Model loads so far with this result (`loaded`, `failed`, `refused`), as /metrics counts them."""
    return int(runtime.metrics.registry.get_sample_value("darkbloom_model_loads_total", {"result": result}) or 0)


class TwoDoors:
    """The coordinator's door and the local app on one runtime; `async with` opens the local client."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        identity = ProviderIdentity.generate()
        self._session = PrivateKey.generate()
        self._box = Box(self._session, PublicKey(base64.b64decode(identity.public_key_b64)))
        self._ctx = JobContext(identity=identity, manager=runtime.manager, counter=runtime.counter,
                               stats=runtime.stats, metrics=runtime.metrics, intake=runtime.intake)
        self.app = create_app(RuntimeBackend(runtime), runtime.metrics)
        self.client: httpx.AsyncClient | None = None

    async def __aenter__(self) -> TwoDoors:
        self.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://local",
                                        timeout=60)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.client is not None
        await self.client.aclose()

    async def local_reply(self, body: dict | bytes, path: str = "/v1/chat/completions") -> httpx.Response:
        assert self.client is not None
        if isinstance(body, bytes):
            return await self.client.post(path, content=body, headers={"content-type": "application/json"})
        return await self.client.post(path, json=body)

    async def local(self, body: dict | bytes, path: str = "/v1/chat/completions") -> LocalAnswer:
        reply = await self.local_reply(body, path)
        error = (reply.json().get("error") or {}) if reply.status_code != 200 else {}
        return LocalAnswer(reply.status_code, error.get("code"), error.get("reason"), reply.headers.get("retry-after"))

    async def job_frames(self, body: dict | bytes) -> list[dict]:
        rid = str(uuid.uuid4())
        plain = body if isinstance(body, bytes) else json.dumps(body).encode()
        sealed = base64.b64encode(self._box.encrypt(plain)).decode()
        request = InferenceRequest(request_id=rid, encrypted_body=EncryptedPayload(
            ephemeral_public_key=base64.b64encode(bytes(self._session.public_key)).decode(), ciphertext=sealed))
        frames: list[dict] = []
        await run_job(request, self._ctx, lambda text: frames.append(json.loads(text)))
        return frames

    async def job(self, body: dict | bytes) -> JobAnswer:
        frames = await self.job_frames(body)
        last = frames[-1]
        return JobAnswer(tuple(f["type"] for f in frames), last.get("status_code"), last.get("failure_code"),
                         last.get("error_reason"), last.get("rejection_reason"))


__all__ = ["JobAnswer", "LocalAnswer", "TwoDoors", "model_loads", "start_runtime"]
