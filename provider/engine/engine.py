"""The asyncio face of the engine: typed commands to the MLX worker thread, async streams back.

Nothing here blocks the event loop: every call either puts a command on the worker's queue
or awaits a future the worker resolves.

    async with Engine() as engine:
        info = await engine.load("tiny", path)
        stream = engine.submit("tiny", ChatRequest("r1", messages, SamplingParams(max_tokens=64)),
                               on_released=ledger_release)
        async for event in stream:
            match event:
                case TextDelta(text): ...
                case Finished(reason, usage): ...
                case Failed(code): ...

`stream.aclose()` (or `engine.cancel(request_id)`) cancels: the stream ends at once with no
further event, and the worker removes the request from its batch before the next decode step.
`stream.interrupt(code)` cancels too, but the stream's last event is `Failed(code)`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import queue
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from kvcache.bits import KvBits
from provider.engine.active import PrefixCacheLookup
from provider.engine.commands import (
    Cancel,
    Command,
    CountPromptTokens,
    KvBytesPerToken,
    KvCacheBytes,
    Load,
    MemoryReading,
    Reclaim,
    ReleaseHook,
    Stop,
    Submit,
    Unload,
)
from provider.engine.cuda_graphs import without_cuda_graphs
from provider.engine.options import EngineOptions
from provider.engine.types import (
    ChatRequest,
    EngineError,
    EngineFailure,
    Event,
    Failed,
    Finished,
    LoadedModelInfo,
    LoadPhase,
    ModelStats,
    TextDelta,
)
from provider.engine.vision import Trace
from provider.engine.worker import Worker


def _wait_for_os_thread_exit(native_id: int | None, limit: float = 2.0) -> None:
    """Wait until the worker's OS thread is gone, not just its Python frame.

    MLX registers C++ thread-local destructors that take the GIL. They run after
    `Thread.join()` returns; if the interpreter is finalizing by then (an `Engine` closed just
    before exit), taking the GIL ends the thread with a forced unwind and the process aborts
    ("terminate called without an active exception"). There is no event for OS-level thread
    exit in Python 3.11, so on Linux we watch /proc for the task to disappear (a few ms).
    """
    task = Path(f"/proc/self/task/{native_id}")
    if native_id is None or not Path("/proc/self/task").is_dir():
        return
    deadline = time.monotonic() + limit
    while task.exists() and time.monotonic() < deadline:
        time.sleep(0.001)


GIL_SWITCH_INTERVAL_S = 0.0005  # see Engine.__init__


def _on_loop(loop: asyncio.AbstractEventLoop, call: Callable[[LoadPhase], None]) -> Callable[[LoadPhase], None]:
    """`call` for the engine thread: scheduled on `loop` (dropped once the loop is closed)."""

    def scheduled(phase: LoadPhase) -> None:
        try:
            loop.call_soon_threadsafe(call, phase)
        except RuntimeError:  # the loop is closed: nobody waits for the load any more
            pass

    return scheduled


class _End(enum.Enum):
    """Queue marker: the consumer (or engine.cancel) closed the stream."""

    CLOSED = enum.auto()


class RequestStream:
    """The events of one request, as an async iterator. Ends after the terminal event."""

    def __init__(self, engine: Engine, request_id: str, loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self.loop = loop  # read by the worker to schedule `push`
        self._engine = engine
        self._queue: asyncio.Queue[Event | _End] = asyncio.Queue()
        self._done = False  # a terminal event was queued, or the stream was closed
        self._exhausted = False  # the consumer has read the end

    # Called on the loop by the worker's delivery callback.
    def push(self, event: Event) -> None:
        if self._done:
            return  # closed by the consumer: drop whatever was already on its way
        if isinstance(event, Finished | Failed):
            self._done = True
            self._engine._forget(self.request_id)
        self._queue.put_nowait(event)

    def _close_local(self, last: Failed | None = None) -> bool:
        """End the stream here: undelivered events are dropped, then `last` (or nothing) is read."""
        if self._done:
            return False
        self._done = True
        while not self._queue.empty():
            self._queue.get_nowait()
        self._queue.put_nowait(_End.CLOSED if last is None else last)
        return True

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> Event:
        if self._exhausted:
            raise StopAsyncIteration
        item = await self._queue.get()
        if item is _End.CLOSED or isinstance(item, Finished | Failed):
            self._exhausted = True
        if item is _End.CLOSED:
            raise StopAsyncIteration
        return item

    async def aclose(self) -> None:
        """Cancel the request if it is still running; no event follows."""
        self._engine.cancel(self.request_id)

    def interrupt(self, code: EngineFailure) -> bool:
        """Cancel the request if it is still running; its last event is `Failed(code)`."""
        return self._engine.interrupt(self.request_id, code)

    async def collect(self) -> tuple[str, Finished | Failed | None]:
        """Read the stream to its end: (all text, terminal event or None if cancelled)."""
        parts: list[str] = []
        async for event in self:
            match event:
                case TextDelta(text):
                    parts.append(text)
                case Finished() | Failed():
                    return "".join(parts), event
        return "".join(parts), None


class Engine:
    """Owns the MLX worker thread. Create it on the event loop that will consume its streams."""

    def __init__(self, options: EngineOptions | None = None, *, thread_name: str = "mlx-engine",
                 prefix_cache: PrefixCacheLookup | None = None, trace: Trace | None = None, **overrides: Any):
        """`options`: how the engine runs its models (`EngineOptions`); `overrides`: fields of it to
        replace, e.g. `Engine(batch_size=16)` for a test. `prefix_cache`: model id -> its
        `kvcache.ModelKvCache` (e.g. `KvCacheManager.get`); the worker reuses cached prompt prefixes
        on submit and stores them when a request ends. `trace(model_id, request_id, phase)`: called on
        the worker thread before every step (request_id None for a text batch step); for tests."""
        options = dataclasses.replace(options or EngineOptions(), **overrides)
        without_cuda_graphs()  # before the worker's first stream exists (cuda_graphs.py)
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._worker = Worker(self._commands, options, prefix_cache=prefix_cache, trace=trace)
        self._streams: dict[str, RequestStream] = {}
        self._closed = False
        # Between two steps the engine thread needs the GIL for a moment; while the event loop thread
        # runs Python (token delivery, SSE, sealing), CPython hands it over only after the switch
        # interval, 5 ms by default: a whole decode step on a GPU. Ask for it sooner, process-wide.
        sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_INTERVAL_S))
        self._thread = threading.Thread(target=self._worker.serve, name=thread_name, daemon=True)
        self._thread.start()

    async def __aenter__(self) -> Engine:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # -- model lifecycle (driven by the model manager) ---------------------------------------

    async def load(self, model_id: str, path: str | Path, *, eos_token_ids: frozenset[int] | None = None,
                   vision: bool = False, kv_bits: KvBits | None = None,
                   on_progress: Callable[[LoadPhase], None] | None = None) -> LoadedModelInfo:
        """Load and evaluate a model's weights on the worker thread, then (a text model) measure and
        warm it on a time budget (`EngineOptions.measure_budget_s`, loading.py).

        `eos_token_ids` replaces the tokenizer's EOS set (tests use it for deterministic stops).
        `vision`: a vision-language model, loaded with mlx-vlm (the `vision` extra).
        `kv_bits` (a `kv_quantization` setting's form): every sequence of the model keeps its KV quantized
        inside the batch; a model whose cache is not plain KV, or a vision model, is refused (LOAD_FAILED):
        `LoadedModelInfo.kv_bits` says what was loaded. `on_progress(phase)` is called on this loop as
        each step of the load ends (every call before the load returns). Raises `EngineError` with
        LOAD_FAILED or MODEL_ALREADY_LOADED.
        """
        progress = None if on_progress is None else _on_loop(asyncio.get_running_loop(), on_progress)
        return await self._call(lambda reply: Load(model_id, Path(path), eos_token_ids, reply, vision, kv_bits,
                                                   progress))

    async def unload(self, model_id: str) -> None:
        """Fail the model's requests (MODEL_UNLOADED), drop every reference, gc, clear MLX's cache."""
        await self._call(lambda reply: Unload(model_id, reply))

    async def reclaim(self, *, collect: bool = False) -> None:
        """`mx.clear_cache()` + `malloc_trim(0)` on the engine thread, between decode steps; with
        `collect`, a full gc first (it stalls the event loop too: the engine thread holds the GIL)."""
        await self._call(lambda reply: Reclaim(reply, collect))

    def request_reclaim(self) -> Future:
        """Queue a cache-only `reclaim` and return at once: the engine thread runs it before any command queued
        after this one (a booking's load, its request's KV). The future is done when it has run;
        after the engine closed it is cancelled (nothing to clear)."""
        reply: Future = Future()
        if self._closed:
            reply.cancel()
        else:
            self._commands.put(Reclaim(reply))
        return reply

    def reclaim_blocking(self) -> None:
        """A full `reclaim` (gc first) for a blocking caller off the loop: the settle barrier's last
        rounds, in a worker thread."""
        if self._closed:
            raise EngineError(EngineFailure.ENGINE_CLOSED)
        reply: Future = Future()
        self._commands.put(Reclaim(reply, collect=True))
        reply.result()

    # -- requests ----------------------------------------------------------------------------

    async def count_prompt_tokens(self, model_id: str, messages: Sequence[Mapping[str, object]]) -> int:
        """Length of the templated prompt, exactly as `submit` will count it."""
        return await self._call(lambda reply: CountPromptTokens(model_id, messages, reply))

    def submit(self, model_id: str, request: ChatRequest, *, on_released: ReleaseHook | None = None,
               on_media_released: ReleaseHook | None = None) -> RequestStream:
        """Start a request. `on_released(request_id)` runs on the engine thread exactly once,
        after the request's KV cache has left the batch (or it was refused before joining).
        `on_media_released(request_id)` (vision requests) runs once, before `on_released`, as soon
        as the decoded images and the pixel tensor are dropped."""
        if self._closed:
            raise EngineError(EngineFailure.ENGINE_CLOSED)
        if request.request_id in self._streams:
            raise EngineError(EngineFailure.INVALID_REQUEST)
        stream = RequestStream(self, request.request_id, asyncio.get_running_loop())
        self._streams[request.request_id] = stream
        self._commands.put(Submit(model_id, request, stream, on_released, on_media_released))
        return stream

    def cancel(self, request_id: str) -> bool:
        """Stop a request: its stream ends with no further event. Unknown ids are ignored.
        True when a cancel went to the worker (the request had not ended yet)."""
        stream = self._streams.pop(request_id, None)
        if stream is not None and stream._close_local():
            self._commands.put(Cancel(request_id))
            return True
        return False

    def interrupt(self, request_id: str, code: EngineFailure) -> bool:
        """Stop a request and end its stream with `Failed(code)` (a server whose drain ran out ends
        every stream with an error instead of cutting it). Unknown or ended ids are ignored."""
        stream = self._streams.pop(request_id, None)
        if stream is not None and stream._close_local(Failed(code)):
            self._commands.put(Cancel(request_id))
            return True
        return False

    def _forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    # -- observation -------------------------------------------------------------------------

    @property
    def batch_size(self) -> int:
        """How many requests one model runs at once; more wait in mlx-lm's queue without tokens."""
        return self._worker.batch_size

    def stats(self, model_id: str) -> ModelStats | None:
        """Snapshot from the last step; cheap, never blocks."""
        return self._worker.stats.get(model_id)

    async def kv_cache_bytes(self, model_id: str) -> int:
        """Bytes held by the model's batch KV caches right now (measured on the worker)."""
        return await self._call(lambda reply: KvCacheBytes(model_id, reply))

    async def memory_reading(self) -> tuple[int, int]:
        """(MLX active bytes, Σ KV bytes every loaded model's batch holds), read together on the
        worker between two steps (the manager's no-model baseline subtracts the second)."""
        return await self._call(MemoryReading)

    async def kv_bytes_per_token(self, model_id: str) -> int:
        """The loaded model's real KV cost per token, measured on its own cache classes (cheap: one
        token). The post-load check compares it with the config estimate. Only while it serves nothing."""
        return await self._call(lambda reply: KvBytesPerToken(model_id, reply))

    # -- shutdown ----------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Fail running requests (ENGINE_CLOSED), unload every model, and end the thread."""
        if self._closed:
            return
        self._closed = True
        reply: Future = Future()
        self._commands.put(Stop(reply))
        await asyncio.wrap_future(reply)
        self._join()

    def close(self, timeout: float | None = None) -> None:
        """Blocking variant of `aclose`, for code outside an event loop."""
        if not self._closed:
            self._closed = True
            self._commands.put(Stop(Future()))
        self._join(timeout)

    def _join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)  # the worker returns right after answering Stop
        if not self._thread.is_alive():
            _wait_for_os_thread_exit(self._thread.native_id)

    async def _call(self, make: Callable[[Future], Command]):
        if self._closed:
            raise EngineError(EngineFailure.ENGINE_CLOSED)
        reply: Future = Future()
        self._commands.put(make(reply))
        return await asyncio.wrap_future(reply)
