"""What the local server serves from: the shared `provider.runtime.Runtime`, so `serve --local`
has the same admission and memory policy as the coordinator agent (issue 7).

`RuntimeBackend.open(request_id, body)` is an async context manager that either raises `Refused`
(a typed `protocol.errors.Failure`, nothing else) or yields the request's event stream. The steps
are the job's (`provider.jobs.job`), minus the encryption:

* count the prompt exactly with the runtime's `PromptCounter` (no model load needed);
* check the images, if any: bounds before allocation (`provider.request.media`, headers only);
* fast admission, `ModelManager.admit`: a refusal is the manager's `Failure`;
* `async with manager.serve(...) as slot`: waits for (or does) the load, evicting idle models
  and prefix-cache entries as the policy says, reserves the request's KV, pins the model;
  `slot.submit(...)` starts it; leaving the block cancels it if it is still running.

Every 503 carries `Retry-After` (a capacity refusal is transient: memory frees as requests finish).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from memory import CapFigures
from protocol.errors import Failure
from provider.engine import ChatRequest, RequestStream
from provider.request import PromptCounter
from provider.request.tokens import PromptError, UnknownModel
from provider.request.body import ChatBody
from provider.request.media import NO_MEDIA, MediaRefused, inspect_images
from provider.runtime import Runtime
from provider.slots import Admitted, Refused as AdmissionRefused, SlotRefused
from provider.telemetry import get_logger

log = get_logger(__name__)
RETRY_AFTER_S = 2  # seconds; memory frees as in-flight requests finish
DRAINING_RETRY_AFTER_S = 5


class Refused(Exception):
    """The request is not admitted; `failure` says why in the protocol's closed vocabulary."""

    def __init__(self, failure: Failure) -> None:
        super().__init__(failure.code.value)
        self.failure = failure

    @property
    def retry_after_s(self) -> int | None:
        if self.failure.status_code != 503:
            return None
        return DRAINING_RETRY_AFTER_S if self.failure == Failure.draining() else RETRY_AFTER_S


class RuntimeBackend:
    """The local app's `Backend` over a started `Runtime`."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime

    @property
    def figures(self) -> CapFigures:
        return self.runtime.ledger.figures

    @property
    def counter(self) -> PromptCounter:
        return self.runtime.counter

    def model_ids(self) -> list[str]:
        return list(self.runtime.servable)

    @asynccontextmanager
    async def open(self, request_id: str, body: ChatBody) -> AsyncIterator[RequestStream]:
        rt = self.runtime
        try:
            prompt_tokens = await rt.counter.count(body.model, body.messages)
        except UnknownModel:
            raise Refused(Failure.model_unavailable()) from None
        except PromptError:
            raise Refused(Failure.template_render()) from None
        media = NO_MEDIA
        if body.images:  # bounds before allocation: headers only, nothing decoded
            try:
                media = await asyncio.to_thread(inspect_images, body.images)
            except MediaRefused as refused:
                log.info("request_refused", request_id=request_id, reason="media", kind=refused.kind)
                raise Refused(refused.failure) from None
        match rt.manager.admit(body.model, prompt_tokens, body.max_tokens, media=media):
            case AdmissionRefused(failure=failure):
                raise Refused(failure)
            case Admitted(kv=kv):
                max_tokens = kv.max_tokens
        request = ChatRequest(request_id, body.messages, body.sampling(max_tokens))
        rt.stats.accepted(request_id, body.model)
        try:
            async with rt.manager.serve(request_id, body.model, prompt_tokens, body.max_tokens,
                                        media=media) as slot:
                stream = slot.submit(request)
                rt.metrics.add_tokens(prompt=prompt_tokens)
                try:
                    with rt.metrics.in_flight():
                        yield stream
                finally:
                    await stream.aclose()  # no-op after a terminal event; a cancel otherwise
        except (SlotRefused, MediaRefused) as exc:  # MediaRefused: an image that would not decode
            raise Refused(exc.failure) from None
        finally:
            rt.stats.ended(request_id)

    def status(self) -> dict[str, Any]:
        return self.runtime.status()

    def refresh_metrics(self) -> None:
        self.runtime.refresh_metrics()
