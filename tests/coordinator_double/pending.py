"""One dispatched request as the read loop and the consumer handler share it ([A] PendingRequest).

The read loop (synchronous, one per socket) turns the provider's frames into ``Item`` values on the
request's queue; the consumer handler consumes them. A request leaves its provider's pending table exactly
once: on its terminal frame (``TERMINATED``) or when the double drops it (``REMOVED``: timeout, consumer
gone, handler finished, eviction, disconnect). Frames that arrive afterwards are recorded, never delivered.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

from protocol import Usage
from protocol.crypto import RequestBox

if TYPE_CHECKING:
    from .routing import ProviderSession


@dataclass(frozen=True, slots=True)
class AcceptedItem:
    pass


@dataclass(frozen=True, slots=True)
class ChunkItem:
    event: bytes  # one decrypted SSE event


@dataclass(frozen=True, slots=True)
class CompleteItem:
    usage: Usage


@dataclass(frozen=True, slots=True)
class ErrorItem:
    status_code: int
    error: str
    failure_code: str | None = None
    error_reason: str | None = None
    internal: bool = False  # raised by the double (untrusted chunk, provider gone), not sent by the provider


Item = AcceptedItem | ChunkItem | CompleteItem | ErrorItem

PROVIDER_DISCONNECTED = ErrorItem(502, "provider disconnected", internal=True)


class RequestState(Enum):
    OPEN = "open"
    TERMINATED = "terminated"  # the provider sent inference_complete or inference_error
    REMOVED = "removed"  # the double dropped it


@dataclass(eq=False)
class PendingRequest:
    request_id: str
    consumer_id: int
    provider: ProviderSession
    box: RequestBox  # session key <-> provider key: opens the chunks
    queue: asyncio.Queue[Item] = field(default_factory=asyncio.Queue)
    state: RequestState = RequestState.OPEN
    accepted: bool = False
    cancel_sent: bool = False  # the double sends at most one cancel per request id
    chunks: int = 0

    def deliver(self, item: Item) -> None:
        self.queue.put_nowait(item)

    def close(self, state: RequestState) -> None:
        """Leave the provider's pending table (idempotent)."""
        if self.state is RequestState.OPEN:
            self.state = state
            self.provider.pending.pop(self.request_id, None)
            self.provider.closed[self.request_id] = state
