"""The dispatch/retry loop of one consumer request ([A] consumer.go handleChatCompletions).

Per attempt: a new request id, a fresh X25519 session key pair, the body sealed to the provider's key,
then up to ``first_response_timeout`` for accept | first chunk | error; after an accept, up to
``accepted_timeout`` for the first chunk. A pre-first-chunk error (any status) excludes the provider and
moves on without a cancel; a timeout sends ``cancel``, excludes, and moves on with code 504. The first chunk
(or a terminal without chunks) commits the request: from then on nothing is rerouted.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nacl.public import Box, PrivateKey

from protocol.crypto import RequestBox, b64encode, parse_public_key

from . import events as ev
from .chat_wire import error_body
from .pending import AcceptedItem, ChunkItem, CompleteItem, ErrorItem, Item, PendingRequest, RequestState

if TYPE_CHECKING:
    from .server import CoordinatorDouble


@dataclass(frozen=True, slots=True)
class CommittedRequest:
    pending: PendingRequest
    first: ChunkItem | CompleteItem


@dataclass(frozen=True, slots=True)
class FailedRequest:
    status_code: int
    body: dict[str, Any]


@dataclass(frozen=True, slots=True)
class ConsumerGone:
    pass


Outcome = CommittedRequest | FailedRequest | ConsumerGone


class WindowClosed:
    """No item before the window ended."""


class ConsumerLeft:
    """The consumer disconnected first."""


async def next_item(pending: PendingRequest, timeout: float, gone: asyncio.Event) -> Item | WindowClosed | ConsumerLeft:
    """The request's next item, unless the window closes or the consumer leaves first."""
    getter = asyncio.ensure_future(pending.queue.get())
    leaver = asyncio.ensure_future(gone.wait())
    try:
        await asyncio.wait({getter, leaver}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        leaver.cancel()
        if not getter.done():
            getter.cancel()  # a not-yet-finished Queue.get loses no item when cancelled
    if getter.done() and not getter.cancelled():
        return getter.result()
    return ConsumerLeft() if gone.is_set() else WindowClosed()


def inference_request_frame(request_id: str, box: RequestBox, body: bytes) -> str:
    """[A] builds the frame as a Go map: keys sorted, no ``body`` key."""
    sealed = box.seal(body)
    frame = {
        "encrypted_body": {"ciphertext": sealed.ciphertext, "ephemeral_public_key": sealed.ephemeral_public_key},
        "request_id": request_id,
        "type": "inference_request",
    }
    return json.dumps(frame, separators=(",", ":"), sort_keys=True)


async def dispatch(
    double: CoordinatorDouble, consumer_id: int, model: str, body: bytes, gone: asyncio.Event
) -> Outcome:
    config = double.config
    excluded: list[str] = []
    last_error, last_code = "", 0
    for attempt in range(config.dispatch_attempts):
        session = double.registry.pick(model, excluded, double.now())
        if session is None:
            if attempt > 0:
                break
            queued = await double.queue_for_provider(model, excluded, gone)
            if isinstance(queued, (FailedRequest, ConsumerGone)):
                return queued
            session = queued
        request_id = str(uuid.uuid4())
        session_key = PrivateKey.generate()
        box = RequestBox(Box(session_key, parse_public_key(session.public_key)), b64encode(bytes(session_key.public_key)))
        pending = PendingRequest(request_id, consumer_id, session, box)
        session.pending[request_id] = pending
        double.events.append(
            ev.Dispatched(consumer_id, request_id, session.provider_id, attempt, b64encode(bytes(session_key.public_key)))
        )
        frame = inference_request_frame(request_id, box, body)
        if not await double.send(session, frame, config.control_write_timeout):
            pending.close(RequestState.REMOVED)
            excluded.append(session.provider_id)
            double.events.append(ev.Rerouted(consumer_id, request_id, session.provider_id, ev.RerouteCause.WRITE_FAILED))
            continue
        window, timeout = ev.Window.FIRST_RESPONSE, config.first_response_timeout
        while True:
            item = await next_item(pending, timeout, gone)
            if isinstance(item, ConsumerLeft):
                double.cancel(pending, ev.CancelCause.CONSUMER_GONE)
                return ConsumerGone()
            if isinstance(item, WindowClosed):
                double.events.append(ev.TimedOut(consumer_id, request_id, session.provider_id, window))
                double.cancel(pending, ev.CancelCause.TIMEOUT)
                excluded.append(session.provider_id)
                last_error, last_code = "provider did not respond in time", 504
                double.events.append(ev.Rerouted(consumer_id, request_id, session.provider_id, ev.RerouteCause.TIMEOUT))
                break
            if isinstance(item, AcceptedItem):
                window, timeout = ev.Window.ACCEPTED, config.accepted_timeout
                continue
            if isinstance(item, ErrorItem):
                double.events.append(
                    ev.Rejected(
                        consumer_id,
                        request_id,
                        session.provider_id,
                        item.status_code,
                        item.failure_code,
                        item.error_reason,
                        item.internal,
                    )
                )
                excluded.append(session.provider_id)
                last_error, last_code = item.error, item.status_code
                double.events.append(ev.Rerouted(consumer_id, request_id, session.provider_id, ev.RerouteCause.ERROR))
                break
            double.events.append(ev.Committed(consumer_id, request_id, session.provider_id))
            return CommittedRequest(pending, item)
    message = f"inference failed after {config.dispatch_attempts} attempt(s): {last_error}"
    return FailedRequest(last_code or 503, error_body(message))
