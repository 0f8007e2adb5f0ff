"""Typed commands from the asyncio side to the MLX worker thread.

Replies travel back through a `concurrent.futures.Future` that the asyncio side wraps;
request events travel through the request's `EventSink`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from kvcache.bits import KvBits
from provider.engine.types import ChatRequest, EngineError, EngineFailure, Event, LoadPhase
from provider.telemetry import get_logger

log = get_logger("provider.engine")

# Called on the engine thread, exactly once per submitted request, after the request's KV cache
# has left the batch (or the request was refused before it joined one).
ReleaseHook = Callable[[str], None]


class EventSink(Protocol):
    """Where a request's events go: `push` is scheduled on `loop`."""

    loop: asyncio.AbstractEventLoop

    def push(self, event: Event) -> None: ...


@dataclass(frozen=True, slots=True)
class Load:
    model_id: str
    path: Path
    eos_token_ids: frozenset[int] | None
    reply: Future
    vision: bool = False  # a vision-language model: load it with mlx-vlm
    kv_bits: KvBits | None = None  # keep its KV quantized in this form inside the batch (kvcache/quantized.py)
    # Called on the engine thread as each step of the load ends (`LoadPhase`); must not block.
    progress: Callable[[LoadPhase], None] | None = None


@dataclass(frozen=True, slots=True)
class Unload:
    model_id: str
    reply: Future


@dataclass(frozen=True, slots=True)
class Submit:
    model_id: str
    request: ChatRequest
    sink: EventSink
    on_released: ReleaseHook | None
    # Vision requests: called on the engine thread once the decoded images and the pixel tensor
    # are dropped (after the vision encoder ran, or when the request ends first).
    on_media_released: ReleaseHook | None = None


@dataclass(frozen=True, slots=True)
class Cancel:
    request_id: str


@dataclass(frozen=True, slots=True)
class CountPromptTokens:
    model_id: str
    messages: Sequence[Mapping[str, object]]
    reply: Future


@dataclass(frozen=True, slots=True)
class KvCacheBytes:
    model_id: str
    reply: Future


@dataclass(frozen=True, slots=True)
class MemoryReading:
    """MLX active bytes and the KV every loaded model's batch holds, read together between steps."""

    reply: Future


@dataclass(frozen=True, slots=True)
class KvBytesPerToken:
    """Measure a loaded model's real KV growth: a one-token prefill into a fresh prompt cache."""

    model_id: str
    reply: Future


@dataclass(frozen=True, slots=True)
class Reclaim:
    """`mx.clear_cache()` + glibc `malloc_trim(0)` on the thread that owns MLX; with `collect`, a
    full gc first (memory.settle.reclaim)."""

    reply: Future
    collect: bool = False


@dataclass(frozen=True, slots=True)
class Stop:
    reply: Future


Command = Load | Unload | Submit | Cancel | CountPromptTokens | KvCacheBytes | KvBytesPerToken | Reclaim | Stop


def answer(reply: Future, fn: Callable[[], object]) -> None:
    """Run a command's work on the engine thread and settle its future: the result, its EngineError, or
    INTERNAL_ERROR for anything else (logged; the worker stays alive)."""
    if not reply.set_running_or_notify_cancel():
        return
    try:
        reply.set_result(fn())
    except EngineError as exc:
        reply.set_exception(exc)
    except Exception:  # an edge: report a fixed code, keep the worker alive
        log.exception("engine_command_failed")
        reply.set_exception(EngineError(EngineFailure.INTERNAL_ERROR))


def notify_released(hook: ReleaseHook | None, request_id: str) -> None:
    """Tell a request's owner its memory is free; a broken hook must not kill the worker."""
    if hook is None:
        return
    try:
        hook(request_id)
    except Exception:  # an edge
        log.exception("release_hook_failed")
