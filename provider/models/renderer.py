"""The bounded renderer: the processes a chat template renders in, its bounds, and the one thread
that talks to them (provider/models/template.py says why and how it is used).

A child process (`_template_child.py`) renders the requests written into its pipe one after another
and answers each in turn, so the answers need no ids: the first answer is the oldest request's.
Renders are pipelined, never a round trip each: a caller writes its request into a pipe itself,
behind those not answered yet, and an event loop that awaits renders reads that process's answers
itself (``add_reader``), so an `arender` waits for no thread and no hand-off of the GIL; a burst of
32 costs the process its renders (~0.05 ms each). The renderer's thread (``chat-template``) does the
rest: it reads the answers no loop reads (`render`'s, from other threads), writes what a full pipe
held back, starts the processes, and enforces the bounds on the render in progress in each process:

* **time**: ``timeout_s`` plus `RENDER_CHARS_PER_S` of allowance, counted from when the process
  begins the render (its start-up and the renders before it are never counted); past that the
  process is killed, that render fails with `TemplateExceeded(TemplateBound.TIMEOUT)`, and the
  renders queued behind it are sent to the next process;
* **memory**: the address space is limited to `MEMORY_BYTES` in the child (RLIMIT_AS, where the OS
  enforces it), the thread kills a process whose resident memory passes the same bound (macOS
  enforces no RLIMIT_AS), and an answer longer than the request allows is refused:
  `TemplateExceeded(TemplateBound.MEMORY)`;
* a render stuck for `SPARE_AFTER_S` holds up only itself: the renders queued behind it are sent to
  another process too (started if there is room), and the first answer counts.

Nothing raised here carries template or prompt text.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import io
import itertools
import math
import os
import pickle
import selectors
import struct
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import psutil

DEFAULT_TIMEOUT_S = 2.0  # a template renders a chat in well under a millisecond; minutes is a loop
MEMORY_BYTES = 1 << 30  # the child's address space: ~0.2 GiB of imports, a 16 MiB body's copies many times over
RENDER_CHARS_PER_S = 2 << 20  # added to the timeout per character sent: a long prompt is not a loop
OUTPUT_FACTOR, OUTPUT_SLACK_CHARS = 4, 1 << 20  # a rendered prompt is at most 4x what was sent, plus 1 Mi chars
START_TIMEOUT_S = 60.0  # the child's imports on a busy machine; never part of a render's time
WATCH_S = 0.05  # how often the renderer looks at the memory of a child that is rendering
SPARE_AFTER_S = 0.25  # a render this long is stuck in a template (a chat renders in ~0.1 ms): start another process
_WRITE_PARTS = 256  # requests written to a child in one system call, at most
_READ_BYTES = 1 << 20  # read from a child's answers in one system call, at most
_CHILD = Path(__file__).with_name("_template_child.py")


class TemplateBound(enum.StrEnum):
    """Which bound a template passed (the reason a model is unservable)."""

    TIMEOUT = "chat_template_timeout"
    MEMORY = "chat_template_memory"


class TemplateFailed(ValueError):
    """The template raised while rendering these messages (a client error, as in-process)."""


class TemplateExceeded(Exception):
    """The render passed a bound: the template, not the request, is at fault."""

    def __init__(self, bound: TemplateBound) -> None:
        super().__init__(bound.value)
        self.bound = bound


class RendererUnavailable(RuntimeError):
    """The renderer process could not start, or was closed."""


class Template(Protocol):
    """What a render needs from a chat template (`provider.models.template.ChatTemplate`)."""

    @property
    def source(self) -> str: ...

    @property
    def variables(self) -> Mapping[str, Any]: ...


def text_size(value: object) -> int:
    """Characters of every string in `value` (messages, tools): what a render is sized by."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, Mapping):
        return sum(text_size(k) + text_size(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return sum(text_size(v) for v in value)
    return 0


def max_rendered_chars(sent_chars: int) -> int:
    return OUTPUT_FACTOR * sent_chars + OUTPUT_SLACK_CHARS


def _child_env() -> dict[str, str]:
    """The renderer's environment: ours, less a preloaded BLAS (tools/with-blas.sh preloads OpenBLAS
    for MLX; a renderer needs none) and with one BLAS thread for the numpy its imports bring: each
    BLAS thread reserves address space, which the child's memory bound counts."""
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env.update(OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return env


class _Child:
    """One renderer process, this side's ends of its pipes, and the renders sent to it. The process
    renders its requests one after another and answers each in turn, so `queue[0]` is the render
    in progress (once written and the process is ready) and every answer is `queue[0]`'s."""

    def __init__(self, memory_bytes: int) -> None:
        req_r, req_w = os.pipe()
        rep_r, rep_w = os.pipe()
        life_r, life_w = os.pipe()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-P", str(_CHILD), str(req_r), str(rep_w), str(life_r), str(memory_bytes)],
                pass_fds=(req_r, rep_w, life_r), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL, start_new_session=True,  # no terminal signals: we stop it
                env=_child_env())
        except OSError:
            for fd in (req_w, rep_r, life_w):
                os.close(fd)
            raise
        finally:
            for fd in (req_r, rep_w, life_r):
                os.close(fd)
        os.set_blocking(req_w, False)  # a stuck process's full pipe never blocks the writer
        os.set_blocking(rep_r, False)
        self.requests = req_w
        self.replies = rep_r
        self.received = bytearray()  # read from `replies`, not yet a whole answer
        self._lifeline = life_w
        self.started = time.monotonic()
        self.ready = False
        self.queue: deque[_Job] = deque()  # sent, or to be sent, in order
        self.written = 0  # of `queue`, how many are wholly in the pipe
        self.offset = 0  # bytes of `queue[written]` in the pipe
        self.head_since: float | None = None  # when `queue[0]` began rendering
        self.watch_at = 0.0  # when to look at its memory next
        self.reader: asyncio.AbstractEventLoop | None = None  # the loop that reads `replies`; None: the thread

    def stuck(self, now: float) -> bool:
        return self.head_since is not None and now - self.head_since >= SPARE_AFTER_S

    def rss(self) -> int:
        try:
            return psutil.Process(self.proc.pid).memory_info().rss
        except psutil.Error:
            return 0

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def close(self) -> None:
        """Close this side's ends of the pipes (once nothing watches them any more)."""
        for fd in (self.requests, self.replies, self._lifeline):
            os.close(fd)


@dataclass(eq=False, slots=True)
class _Job:
    """One render: its request as framed for the pipe, its bounds, and whom to tell."""

    frame: memoryview  # a length header and the pickled request
    budget_s: float  # its time once it is rendering
    max_bytes: int  # the longest answer it may have
    future: asyncio.Future[str] | concurrent.futures.Future[str]
    loop: asyncio.AbstractEventLoop | None  # the loop of an `arender`; None: a thread waits on `future`
    holders: set[_Child] = field(default_factory=set)  # the processes it is sent to (more than one: rescued)
    rescued: bool = False  # from behind a stuck render
    done: bool = False


def _frame(template: Template, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool,
           extra: dict[str, Any], max_chars: int) -> memoryview:
    """A request as the child reads it (`multiprocessing.connection.Connection.recv_bytes`: a length,
    then the bytes), built in one buffer."""
    buffer = io.BytesIO()
    buffer.write(bytes(4))
    pickle.dump((template.source, dict(template.variables), [dict(m) for m in messages], add_generation_prompt,
                 extra, max_chars), buffer, pickle.HIGHEST_PROTOCOL)
    size = buffer.tell() - 4
    if size > 0x7FFFFFFF:  # past the pipe protocol's short header (a 16 MiB body never is)
        raise TemplateExceeded(TemplateBound.MEMORY)
    frame = buffer.getbuffer()
    frame[:4] = struct.pack("!i", size)
    return frame


def _outcome(answer: bytes) -> tuple[str | None, BaseException | None]:
    status = answer[:1]
    if status == b"R":
        return str(memoryview(answer)[1:], "utf-8", "surrogatepass"), None
    if status == b"E":
        return None, TemplateFailed("the chat template could not render the messages")
    return None, TemplateExceeded(TemplateBound.MEMORY)


class TemplateRenderer:
    """Up to `processes` renderer processes (more than one only once a render is stuck): `render`
    from any thread but the event loop's, `arender` from the event loop. One lock guards every piece
    of state; whoever holds it writes and reads pipes without blocking and never waits for a render.
    Answers go to a waiting thread at once, to the loop that read them at once, and to other loops
    in one callback per loop."""

    def __init__(self, *, processes: int = 1, memory_bytes: int = MEMORY_BYTES,
                 limit_address_space: bool = True) -> None:
        self.memory_bytes = memory_bytes
        self._address_limit = memory_bytes if limit_address_space else 0
        self._max = max(1, processes)
        self.replaced = 0  # processes killed for a bound
        self._lock = threading.Lock()
        self._children: list[_Child] = []
        self._waiting: deque[_Job] = deque()  # not sent to a process yet (or rescued from a stuck one)
        self._outbox: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future[str], str | None,
                                                                  BaseException | None]]] = {}
        self._start_one = False
        self._closed = False
        self._thread: threading.Thread | None = None
        self._armed_until: float | None = math.inf  # when the thread looks next; None: it is looking now
        self._busy = False  # a render began since the thread last looked
        self._signalled = False  # a byte is in the wake pipe
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)

    def pids(self) -> list[int]:
        """The renderer processes' ids."""
        with self._lock:
            return [c.proc.pid for c in self._children]

    def start(self) -> None:
        """Start the first process now (without waiting for it), so the first render does not wait for it."""
        with self._lock:
            if self._closed:
                return
            self._running()
            self._start_one = True
            self._wake()

    def render(self, template: Template, messages: Sequence[Mapping[str, Any]], *,
               add_generation_prompt: bool, extra: Mapping[str, Any] | None = None,
               timeout_s: float = DEFAULT_TIMEOUT_S) -> str:
        """The rendered prompt. Blocks up to `timeout_s` plus the prompt's allowance once it renders
        (and a process's start-up, when one is started for it). Raises `TemplateFailed`,
        `TemplateExceeded`, `RendererUnavailable`."""
        future: concurrent.futures.Future[str] = concurrent.futures.Future()
        self._post(self._job(template, messages, add_generation_prompt, extra, timeout_s, future, None))
        return future.result()

    async def arender(self, template: Template, messages: Sequence[Mapping[str, Any]], *,
                      add_generation_prompt: bool, extra: Mapping[str, Any] | None = None,
                      timeout_s: float = DEFAULT_TIMEOUT_S) -> str:
        """`render`, awaited: the event loop goes on while the template renders."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[str] = loop.create_future()
        self._post(self._job(template, messages, add_generation_prompt, extra, timeout_s, future, loop))
        return await future

    def close(self) -> None:
        """Stop the processes (a render in progress or waiting fails with `RendererUnavailable`)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._wake()
            thread = self._thread
        if thread is not None:
            thread.join()
        os.close(self._wake_r)
        os.close(self._wake_w)

    # -- the callers' side ------------------------------------------------------------------------------

    @staticmethod
    def _job(template: Template, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool,
             extra: Mapping[str, Any] | None, timeout_s: float, future: Any,
             loop: asyncio.AbstractEventLoop | None) -> _Job:
        extra = dict(extra or {})
        sent = text_size(messages) + text_size(extra)
        frame = _frame(template, messages, add_generation_prompt, extra, max_rendered_chars(sent))
        return _Job(frame, timeout_s + sent / RENDER_CHARS_PER_S, 4 * max_rendered_chars(sent) + 16, future, loop)

    def _post(self, job: _Job) -> None:
        """Send `job` to a process now, from the caller's thread; what needs a process started, or
        waits for one, is the thread's."""
        with self._lock:
            if self._closed:
                raise RendererUnavailable()
            self._running()
            now = time.monotonic()
            self._waiting.append(job)
            self._assign(now, spawn=False)
            if self._waiting:
                self._wake()
            for child in list(job.holders):
                self._flush(child, now)
                self._listen(child, job.loop)
            self._deliver()

    def _listen(self, child: _Child, loop: asyncio.AbstractEventLoop | None) -> None:
        """The caller's loop reads `child`'s answers from now, unless a live loop already does."""
        if child.reader is not None and child.reader.is_closed():
            child.reader = None  # its loop has gone: the thread reads them again
            self._wake()
        if loop is not None and child.reader is None and child in self._children:
            child.reader = loop
            loop.add_reader(child.replies, self._on_answers, child)
            self._wake()  # the thread stops watching them

    def _on_answers(self, child: _Child) -> None:
        """`child` has written (on the loop that reads its answers)."""
        with self._lock:
            if child in self._children and child.reader is asyncio.get_running_loop():
                self._read(child, time.monotonic())
                self._deliver()

    def _running(self) -> None:
        if self._thread is None:
            # A daemon thread: the process never waits for it at exit (the children follow us out).
            self._thread = threading.Thread(target=self._run, name="chat-template", daemon=True)
            self._thread.start()

    def _wake(self) -> None:
        """Have the thread look now (a no-op from the thread itself, which is looking)."""
        if self._armed_until is not None and not self._signalled:
            self._signalled = True
            os.write(self._wake_w, b"\0")

    # -- the thread -------------------------------------------------------------------------------------

    def _run(self) -> None:
        selector = selectors.DefaultSelector()
        watched: dict[int, tuple[int, _Child | None]] = {}
        events: list[tuple[selectors.SelectorKey, int]] = []
        try:
            while True:
                with self._lock:
                    self._armed_until = None
                    if not self._round(events):
                        return
                    self._watch_fds(selector, watched)
                    now = time.monotonic()
                    wait = self._soonest(now)
                    if wait is None and self._busy:
                        wait = WATCH_S  # renders come and go: look again soon rather than be woken for each
                    self._busy = False
                    self._armed_until = math.inf if wait is None else now + wait
                events = selector.select(wait)
        except BaseException:  # a fault here: nobody may be left waiting (the thread's excepthook logs it)
            with self._lock:
                self._stop(RendererUnavailable())
                self._thread = None  # the next render starts another
            raise
        finally:
            selector.close()

    def _round(self, events: list[tuple[selectors.SelectorKey, int]]) -> bool:
        """Read and write what woke the thread, then enforce the bounds and send what waits. False once
        closed (everything stopped)."""
        now = time.monotonic()
        for key, mask in events:
            child = key.data
            if child is None or child not in self._children:
                continue
            if mask & selectors.EVENT_READ and child.reader is None:
                self._read(child, now)
            if mask & selectors.EVENT_WRITE and child in self._children:
                self._flush(child, now)
        if self._signalled:
            os.read(self._wake_r, 64)
            self._signalled = False
        if self._closed:
            self._stop(RendererUnavailable())
            return False
        if self._start_one:
            self._start_one = False
            if not self._children:
                self._spawn()
        for child in self._children:
            if child.reader is not None and child.reader.is_closed():
                child.reader = None  # its loop has gone without a word: the thread reads from now
        self._watch(now)
        self._assign(now, spawn=True)
        for child in list(self._children):
            self._flush(child, now)
        self._deliver()
        return True

    def _watch_fds(self, selector: selectors.BaseSelector, watched: dict[int, tuple[int, _Child | None]]) -> None:
        """The thread's selector watches the wake pipe, the answers no loop reads, and the pipes a
        request waits to be written into. (A pipe closed meanwhile leaves a stale entry, dropped here:
        the OS has forgotten it already.)"""
        wanted: dict[int, tuple[int, _Child | None]] = {self._wake_r: (selectors.EVENT_READ, None)}
        for child in self._children:
            if child.reader is None:
                wanted[child.replies] = (selectors.EVENT_READ, child)
            if child.written < len(child.queue):
                wanted[child.requests] = (selectors.EVENT_WRITE, child)
        for fd, entry in list(watched.items()):
            if wanted.get(fd) != entry:
                selector.unregister(fd)
                del watched[fd]
        for fd, (events, child) in wanted.items():
            if fd not in watched:
                selector.register(fd, events, child)
                watched[fd] = (events, child)

    def _watch(self, now: float) -> None:
        """Enforce the bounds, and rescue the renders queued behind a stuck one."""
        for child in list(self._children):
            if child.reader is not None and child.head_since is not None and now >= child.head_since + WATCH_S:
                self._read(child, now)  # its loop is slow to read: an answer there is no render running
                if child not in self._children:
                    continue
            if not child.ready:
                if now >= child.started + START_TIMEOUT_S:
                    self._retire(child, RendererUnavailable(), everything=True)
                continue
            if child.head_since is None:
                continue
            if now >= child.head_since + child.queue[0].budget_s:
                self._bound(child, TemplateBound.TIMEOUT)
            elif now >= child.watch_at and child.rss() > self.memory_bytes:
                self._bound(child, TemplateBound.MEMORY)
            else:
                if now >= child.watch_at:
                    child.watch_at = now + WATCH_S
                if child.stuck(now):
                    self._rescue(child)

    def _soonest(self, now: float) -> float | None:
        """Seconds until `_watch` has something to look at (None: nothing)."""
        soonest = math.inf
        for child in self._children:
            if not child.ready:
                soonest = min(soonest, child.started + START_TIMEOUT_S)
            elif child.head_since is not None:
                soonest = min(soonest, child.head_since + child.queue[0].budget_s, child.watch_at)
                if any(not job.rescued for job in itertools.islice(child.queue, 1, None)):
                    soonest = min(soonest, child.head_since + SPARE_AFTER_S)
        return None if soonest == math.inf else max(0.0, soonest - now)

    # -- sending, reading ---------------------------------------------------------------------------------

    def _assign(self, now: float, *, spawn: bool) -> None:
        """Each waiting render to the process with the shortest queue that is not stuck (one started
        when there is none, there is room and `spawn`); left waiting otherwise."""
        kept: deque[_Job] = deque()
        while self._waiting:
            job = self._waiting.popleft()
            if job.done or job.future.done():  # answered elsewhere, or its caller has gone
                continue
            free = [c for c in self._children if not c.stuck(now)]
            if any(c in job.holders for c in free):
                continue  # the process it is queued in is flowing again
            if not free and spawn and len(self._children) < self._max:
                child = self._spawn()
                if child is None:
                    self._fail([job, *self._waiting, *kept], RendererUnavailable())
                    self._waiting.clear()
                    return
                free = [child]
            if not free:
                kept.append(job)
                continue
            child = min(free, key=lambda c: len(c.queue))
            child.queue.append(job)
            job.holders.add(child)
        self._waiting = kept

    def _flush(self, child: _Child, now: float) -> None:
        """Write the child's queued requests into its pipe, as far as it takes them without blocking:
        every waiting one in one system call."""
        while child.written < len(child.queue):
            parts = [child.queue[child.written].frame[child.offset:]]
            parts += (job.frame for job in itertools.islice(child.queue, child.written + 1, child.written + _WRITE_PARTS))
            try:
                sent = os.writev(child.requests, parts)
            except BlockingIOError:
                self._wake()  # the thread writes the rest when the pipe has room
                return
            except OSError:  # it went away: as when its answers end
                self._gone(child)
                return
            for part in parts:
                if sent < len(part):
                    child.offset += sent
                    break
                sent -= len(part)
                child.written += 1
                child.offset = 0
                self._began(child, now)

    def _read(self, child: _Child, now: float) -> None:
        """What the child has written, and every whole answer in it."""
        try:
            data = os.read(child.replies, _READ_BYTES)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._gone(child)
            return
        received = child.received
        received += data
        while len(received) >= 4:
            (size,) = struct.unpack_from("!i", received)
            limit = child.queue[0].max_bytes if child.ready and child.head_since is not None else 16
            if not 0 <= size <= limit:  # an answer too long (or nothing of ours in progress)
                self._gone(child)
                return
            if len(received) < 4 + size:
                return
            answer = bytes(memoryview(received)[4:4 + size])
            del received[:4 + size]
            if not self._answered(child, answer, now):
                return

    def _answered(self, child: _Child, answer: bytes, now: float) -> bool:
        """One message from the child: its start, or `queue[0]`'s answer. False once it is retired."""
        if not child.ready:
            if answer != b"S":  # it could not start
                self._gone(child)
                return False
            child.ready = True
            self._began(child, now)
            return True
        if answer == b"M":  # it exits after a MemoryError: a fresh one for what comes next
            self._bound(child, TemplateBound.MEMORY)
            return False
        head = child.queue.popleft()
        child.written -= 1
        head.holders.discard(child)
        child.head_since = None
        self._settle(head, *_outcome(answer))
        self._began(child, now)
        if self._waiting:
            self._wake()  # a process may be free for them now
        return True

    def _began(self, child: _Child, now: float) -> None:
        """`queue[0]` renders from now once it is written and the process is up; the thread looks at
        it within `WATCH_S`."""
        if child.ready and child.written and child.head_since is None:
            child.head_since = now
            child.watch_at = now + WATCH_S
            self._busy = True
            if self._armed_until is not None and self._armed_until > child.watch_at:
                self._wake()

    # -- the processes --------------------------------------------------------------------------------

    def _spawn(self) -> _Child | None:
        try:
            child = _Child(self._address_limit)
        except OSError:
            return None
        self._children.append(child)
        return child

    def _rescue(self, child: _Child) -> None:
        """The renders queued behind `child`'s stuck one wait for another process too."""
        behind = [job for job in itertools.islice(child.queue, 1, None) if not job.done and not job.rescued]
        for job in behind:
            job.rescued = True
        self._waiting.extendleft(reversed(behind))

    def _gone(self, child: _Child) -> None:
        """Its pipes ended: it could not start (what was sent to it fails), it died rendering (out of
        memory: a bound), or it went away between renders (what was sent to it goes to another)."""
        if not child.ready:
            self._retire(child, RendererUnavailable(), everything=True)
        elif child.head_since is not None:
            self._bound(child, TemplateBound.MEMORY)
        else:
            self._retire(child, None)

    def _bound(self, child: _Child, bound: TemplateBound) -> None:
        """The render in progress passed `bound`: it fails, its process is killed, the others are sent
        again; the next process starts now when it was the last (its imports overlap what comes next)."""
        self.replaced += 1
        self._retire(child, TemplateExceeded(bound))
        if not self._children:
            self._start_one = True
            self._wake()

    def _retire(self, child: _Child, head: BaseException | None, *, everything: bool = False) -> None:
        """Kill `child`. The render in progress fails with `head` (None: it is sent again), or every
        render sent to it does (`everything`: a process that never started); the rest are sent again."""
        self._children.remove(child)
        in_progress = child.head_since is not None
        child.kill()
        self._release(child)
        again = []
        for i, job in enumerate(child.queue):
            job.holders.discard(child)
            if job.done:
                continue
            if head is not None and i == 0 and in_progress:
                self._settle(job, None, head)
            elif job.holders:
                continue  # sent to another process too
            elif everything and head is not None:
                self._settle(job, None, head)
            else:
                again.append(job)
        self._waiting.extendleft(reversed(again))
        if again:
            self._wake()

    def _release(self, child: _Child) -> None:
        """Close a killed child's pipes, once the loop that reads its answers has stopped watching them
        (a pipe closed under a loop's watch would leave it a stale entry for the next file to get
        that number)."""
        loop = child.reader
        if loop is None or loop.is_closed():
            child.close()
        elif loop is _running_loop():
            loop.remove_reader(child.replies)
            child.close()
        else:
            try:
                loop.call_soon_threadsafe(_unwatch, child)
            except RuntimeError:  # closed meanwhile: nothing watches them
                child.close()

    def _stop(self, error: BaseException) -> None:
        """Closed (or a fault): every process killed, every render failed."""
        jobs = list(self._waiting)
        self._waiting.clear()
        for child in list(self._children):
            jobs.extend(child.queue)
            child.queue.clear()
            self._retire(child, None)
        self._waiting.clear()
        self._fail(jobs, error)
        self._deliver()

    # -- answers ----------------------------------------------------------------------------------------

    def _fail(self, jobs: Iterable[_Job], error: BaseException) -> None:
        for job in jobs:
            self._settle(job, None, error)

    def _settle(self, job: _Job, text: str | None, exc: BaseException | None) -> None:
        """Answer `job`: at once when its caller is a thread or this loop, else in its loop's batch."""
        if job.done:
            return
        job.done = True
        if job.loop is None:
            if exc is not None:
                job.future.set_exception(exc)
            else:
                job.future.set_result(text)
        elif job.loop is _running_loop():
            _settle_all([(job.future, text, exc)])
        else:
            self._outbox.setdefault(job.loop, []).append((job.future, text, exc))

    def _deliver(self) -> None:
        """The answers for other event loops, in one callback per loop."""
        outbox, self._outbox = self._outbox, {}
        for loop, answers in outbox.items():
            try:
                loop.call_soon_threadsafe(_settle_all, answers)
            except RuntimeError:  # that loop is closed: nobody waits any more
                pass


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _unwatch(child: _Child) -> None:
    """On the loop that read a retired child's answers: stop watching its pipe, then close its pipes."""
    asyncio.get_running_loop().remove_reader(child.replies)
    child.close()


def _settle_all(answers: list[tuple[asyncio.Future[str], str | None, BaseException | None]]) -> None:
    for future, text, exc in answers:
        if future.done():
            continue
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(text)


__all__ = ["DEFAULT_TIMEOUT_S", "MEMORY_BYTES", "RendererUnavailable", "Template", "TemplateBound", "TemplateExceeded",
           "TemplateFailed", "TemplateRenderer", "max_rendered_chars", "text_size"]
