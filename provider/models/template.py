"""Chat templates, rendered where a model folder's code cannot hold up the agent.

A chat template (``chat_template.jinja`` and friends) is a program that comes with the model folder:
two nested loops run for hours, one string repetition takes gigabytes, and a Python thread running it
can be neither stopped nor bounded. So templates render in a child process of their own
(`_template_child.py`: a fresh interpreter, never a fork of this one, which holds MLX and threads),
one render at a time, and this process only waits for the answer:

* **time**: a render may take ``timeout_s`` (the ``template_timeout_s`` setting) plus an allowance
  for a long prompt (`RENDER_CHARS_PER_S`); past that the child is killed and another started, and
  the render fails with `TemplateExceeded(TemplateBound.TIMEOUT)`;
* **memory**: the child's address space is limited to `MEMORY_BYTES` (RLIMIT_AS, where the OS
  enforces it), the waiting caller kills it when its resident memory passes the same bound (macOS
  enforces no RLIMIT_AS), and a rendered prompt longer than `max_rendered_chars` is refused in the
  child: `TemplateExceeded(TemplateBound.MEMORY)`;
* the child's imports (~1 s) are never counted against a render, and it exits by itself when this
  process goes (its lifeline pipe closes), even in the middle of a render.

The render is transformers' own ``render_jinja_template`` — what ``apply_chat_template`` calls —
with the tokenizer's special tokens and mlx-lm's thinking switch as variables (`ChatTemplate.of`),
so the text, and the tokens this process makes from it (`encode`), are those of mlx-lm's
``tokenizer.apply_chat_template``. The interface is general: (messages, add_generation_prompt,
extra template variables such as ``tools``) -> str.

Each process has two renderers (`renderer(lane)`), started on first use: `Lane.INTERACTIVE` for short
prompts (awaited on the event loop with `arender`), the engine thread and start-up checks, and
`Lane.BULK` for the bulk lane's long prompts, so a short prompt never waits behind a long one; and
when a render has been stuck for `SPARE_AFTER_S`, the interactive renderer starts a second process,
so the requests behind it are served while it runs out its bound.
A template error (``raise_exception``, a missing key) is `TemplateFailed`: the client's problem, as
before. Nothing raised here carries template or prompt text.
"""

from __future__ import annotations

import asyncio
import enum
import os
import pickle
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

DEFAULT_TIMEOUT_S = 2.0  # a template renders a chat in well under a millisecond; minutes is a loop
MEMORY_BYTES = 1 << 30  # the child's address space: ~0.2 GiB of imports, a 16 MiB body's copies many times over
RENDER_CHARS_PER_S = 2 << 20  # added to the timeout per character sent: a long prompt is not a loop
OUTPUT_FACTOR, OUTPUT_SLACK_CHARS = 4, 1 << 20  # a rendered prompt is at most 4x what was sent, plus 1 Mi chars
START_TIMEOUT_S = 60.0  # the child's imports on a busy machine; never part of a render's time
WATCH_S = 0.05  # how often a waiting caller looks at the child's memory
SPARE_AFTER_S = 0.25  # a render this long is stuck in a template (a chat renders in ~0.1 ms): start another process
INTERACTIVE_PROCESSES = 2  # one stuck render, and the others still served
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


class Lane(enum.Enum):
    INTERACTIVE = "interactive"  # short prompts (event loop), the engine thread, start-up checks
    BULK = "bulk"  # the bulk lane's long prompts


@dataclass(frozen=True, slots=True)
class ChatTemplate:
    """What a render needs from a tokenizer: the template text and the variables it is rendered with."""

    source: str
    variables: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, tokenizer: Any) -> ChatTemplate | None:
        """The template mlx-lm's ``apply_chat_template`` renders for `tokenizer` (its
        ``TokenizerWrapper`` or a transformers tokenizer): transformers' template and special tokens,
        plus the thinking switch mlx-lm adds. None when mlx-lm renders with Python code instead (its
        renderers for some model types, a tokenizer class with its own method): that stays in-process."""
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase

        # mlx-lm's wrapper keeps the transformers tokenizer as `_tokenizer` (a transformers tokenizer's
        # own `_tokenizer` is its Rust backend: not what renders).
        inner = tokenizer if isinstance(tokenizer, PreTrainedTokenizerBase) else tokenizer._tokenizer
        if inner is not tokenizer and vars(tokenizer).get("_chat_template") is not None:
            return None
        if type(inner).apply_chat_template is not PreTrainedTokenizerBase.apply_chat_template:
            return None
        try:
            source = inner.get_chat_template()
        except ValueError:  # no template: apply_chat_template raises the same, in-process
            return None
        variables = dict(inner.special_tokens_map)
        switch = vars(tokenizer).get("_thinking_kwarg") if inner is not tokenizer else None
        if switch is not None:
            variables[switch] = bool(tokenizer.has_thinking)
        return cls(source, variables)

    @classmethod
    def of_processor(cls, processor: Any) -> ChatTemplate | None:
        """A transformers processor's template (``ProcessorMixin.apply_chat_template``: its own
        template, its tokenizer's special tokens); None when it has none."""
        try:
            source = processor._resolve_chat_template(None)
        except (AttributeError, ValueError):
            return None
        return cls(source, dict(processor.tokenizer.special_tokens_map))


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


def encode(tokenizer: Any, text: str) -> list[int]:
    """The ids of a rendered prompt, as ``apply_chat_template`` makes them (no special tokens added)."""
    return list(tokenizer.encode(text, add_special_tokens=False))


def _child_env() -> dict[str, str]:
    """The renderer's environment: ours, less a preloaded BLAS (tools/with-blas.sh preloads OpenBLAS
    for MLX; a renderer needs none) and with one BLAS thread for the numpy its imports bring: each
    BLAS thread reserves address space, which the child's memory bound counts."""
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env.update(OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return env


class _Child:
    """One renderer process and this side's ends of its three pipes."""

    def __init__(self, memory_bytes: int) -> None:
        from multiprocessing.connection import Connection

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
        self.requests = Connection(req_w, readable=False)
        self.replies = Connection(rep_r, writable=False)
        self._lifeline = life_w
        self.ready = False

    def wait_ready(self, timeout_s: float) -> bool:
        try:
            self.ready = self.replies.poll(timeout_s) and self.replies.recv_bytes(16) == b"S"
        except (EOFError, OSError):
            self.ready = False
        return self.ready

    def rss(self) -> int:
        try:
            return psutil.Process(self.proc.pid).memory_info().rss
        except psutil.Error:
            return 0

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.requests.close()
        self.replies.close()
        os.close(self._lifeline)


class TemplateRenderer:
    """A few renderer processes, one render at a time in each: `render` from any thread but the
    event loop's, `arender` from the event loop (the wait runs on one of this renderer's threads).

    One process serves while renders are quick; when every process has been busy for `SPARE_AFTER_S`
    (a template stuck in its loops until its bound), another is started, up to `processes`, so a
    stuck render holds up only the requests that wait for it."""

    def __init__(self, *, processes: int = 1, memory_bytes: int = MEMORY_BYTES,
                 limit_address_space: bool = True) -> None:
        self.memory_bytes = memory_bytes
        self._address_limit = memory_bytes if limit_address_space else 0
        self._max = max(1, processes)
        self._cond = threading.Condition()
        self._idle: list[_Child] = []
        self._busy: dict[_Child, float] = {}  # child -> when its render began
        self._count = 0  # idle + busy + being started
        self._closed = False
        self._jobs: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        self._threads = 0
        self.replaced = 0  # processes killed for a bound

    def pids(self) -> list[int]:
        """The renderer processes' ids."""
        with self._cond:
            return [c.proc.pid for c in (*self._idle, *self._busy)]

    def start(self) -> None:
        """Start the first process now (without waiting for it), so the first render does not wait for it."""
        with self._cond:
            if self._count or self._closed:
                return
            self._count += 1
        self._put_back(self._spawn())

    def render(self, template: ChatTemplate, messages: Sequence[Mapping[str, Any]], *,
               add_generation_prompt: bool, extra: Mapping[str, Any] | None = None,
               timeout_s: float = DEFAULT_TIMEOUT_S) -> str:
        """The rendered prompt. Blocks up to `timeout_s` plus the prompt's allowance (and a process's
        start-up, when one is started for it). Raises `TemplateFailed`, `TemplateExceeded`,
        `RendererUnavailable`."""
        extra = dict(extra or {})
        sent = text_size(messages) + text_size(extra)
        request = pickle.dumps((template.source, dict(template.variables), [dict(m) for m in messages],
                                add_generation_prompt, extra, max_rendered_chars(sent)), pickle.HIGHEST_PROTOCOL)
        answer = self._exchange(request, timeout_s + sent / RENDER_CHARS_PER_S, 4 * max_rendered_chars(sent) + 16)
        del request  # a long prompt's copies: one at a time
        status = answer[:1]
        if status == b"R":
            return str(memoryview(answer)[1:], "utf-8", "surrogatepass")
        if status == b"E":
            raise TemplateFailed("the chat template could not render the messages")
        raise TemplateExceeded(TemplateBound.MEMORY)

    async def arender(self, template: ChatTemplate, messages: Sequence[Mapping[str, Any]], *,
                      add_generation_prompt: bool, extra: Mapping[str, Any] | None = None,
                      timeout_s: float = DEFAULT_TIMEOUT_S) -> str:
        """`render`, awaited: the event loop goes on while one of the renderer's threads waits."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[str] = loop.create_future()
        self._submit((loop, future, template, list(messages), add_generation_prompt, extra, timeout_s))
        return await future

    def close(self) -> None:
        """Stop the processes (a render in progress fails with `RendererUnavailable`)."""
        with self._cond:
            self._closed = True
            idle, busy = list(self._idle), list(self._busy)
            self._idle.clear()
            self._cond.notify_all()
        for child in busy:
            if child.proc.poll() is None:
                child.proc.kill()  # its caller cleans up
        for child in idle:
            child.kill()
        for _ in range(self._threads):
            self._jobs.put(None)

    # -- one render ---------------------------------------------------------------------------------

    def _exchange(self, request: bytes, budget_s: float, max_bytes: int) -> bytes:
        for attempt in (1, 2):
            child = self._acquire()
            try:
                if not child.ready and not child.wait_ready(START_TIMEOUT_S):
                    raise RendererUnavailable()
                child.requests.send_bytes(request)
                break
            except OSError:  # it went away between renders (killed from outside): once more, on another
                self._discard(child)
                if attempt == 2:
                    raise RendererUnavailable() from None
            except BaseException:
                self._discard(child)
                raise
        try:
            answer = self._wait(child, budget_s, max_bytes)
        except BaseException:
            self._discard(child)
            raise
        if answer == b"M":
            self._discard(child, bound=True)  # it exits after a MemoryError: a fresh one for what comes next
        else:
            self._put_back(child)
        return answer

    def _wait(self, child: _Child, budget_s: float, max_bytes: int) -> bytes:
        deadline = time.monotonic() + budget_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self._discard(child, bound=True)
                raise TemplateExceeded(TemplateBound.TIMEOUT)
            if child.replies.poll(min(left, WATCH_S)):
                try:
                    return child.replies.recv_bytes(max_bytes)
                except (EOFError, OSError):  # it died rendering: out of memory, or closed by us
                    if self._closed:
                        raise RendererUnavailable() from None
                    self._discard(child, bound=True)
                    raise TemplateExceeded(TemplateBound.MEMORY) from None
            if child.rss() > self.memory_bytes:
                self._discard(child, bound=True)
                raise TemplateExceeded(TemplateBound.MEMORY)

    # -- the processes --------------------------------------------------------------------------------

    def _spawn(self) -> _Child:
        """A new process (called with a place counted in `_count`, outside the lock)."""
        try:
            return _Child(self._address_limit)
        except OSError:
            with self._cond:
                self._count -= 1
                self._cond.notify_all()
            raise RendererUnavailable() from None

    def _acquire(self) -> _Child:
        """An idle process; a new one when there is none (the first), or when every one has been busy
        for `SPARE_AFTER_S` and there is room for another; else wait for one to be free."""
        with self._cond:
            while True:
                if self._closed:
                    raise RendererUnavailable()
                if self._idle:
                    child = self._idle.pop()
                    self._busy[child] = time.monotonic()
                    return child
                stuck = min(self._busy.values(), default=time.monotonic()) + SPARE_AFTER_S - time.monotonic()
                if self._count == 0 or (self._count < self._max and len(self._busy) == self._count and stuck <= 0):
                    self._count += 1
                    break
                self._cond.wait(timeout=max(stuck, 0.01) if self._count < self._max else None)
        child = self._spawn()
        with self._cond:
            self._busy[child] = time.monotonic()
        return child

    def _put_back(self, child: _Child) -> None:
        with self._cond:
            self._busy.pop(child, None)
            if self._closed:
                child.kill()
                return
            self._idle.append(child)
            self._cond.notify()

    def _discard(self, child: _Child, *, bound: bool = False) -> None:
        """Kill a process; when it was the last, start the next one now (its imports overlap whatever
        comes next). Idempotent."""
        with self._cond:
            if self._busy.pop(child, None) is None and child not in self._idle:
                return
            if child in self._idle:
                self._idle.remove(child)
            self._count -= 1
            self.replaced += bound
            restart = self._count == 0 and not self._closed
            if restart:
                self._count += 1
            self._cond.notify_all()
        child.kill()
        if restart:
            try:
                self._put_back(self._spawn())
            except RendererUnavailable:
                pass  # the next render tries again

    # -- the threads behind `arender` ----------------------------------------------------------------

    def _submit(self, job: tuple[Any, ...]) -> None:
        with self._cond:
            # One thread per process at most: a render stuck in one never holds up the others' callers.
            if self._threads < self._max:
                self._threads += 1
                # Daemon threads: the process never waits for them at exit (the children follow us out).
                threading.Thread(target=self._serve, name="chat-template", daemon=True).start()
        self._jobs.put(job)

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            loop, future, template, messages, add_generation_prompt, extra, timeout_s = job
            try:
                outcome: tuple[str | None, BaseException | None] = (
                    self.render(template, messages, add_generation_prompt=add_generation_prompt, extra=extra,
                                timeout_s=timeout_s), None)
            except Exception as exc:  # handed to the awaiting caller
                outcome = (None, exc)
            try:
                loop.call_soon_threadsafe(_settle, future, *outcome)
            except RuntimeError:  # that loop is closed: nobody waits any more
                pass


def _settle(future: asyncio.Future[str], result: str | None, exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)


_shared: dict[Lane, TemplateRenderer] = {}
_shared_lock = threading.Lock()


def renderer(lane: Lane = Lane.INTERACTIVE) -> TemplateRenderer:
    """This process's renderer for `lane` (created on first use; its process starts on first render)."""
    with _shared_lock:
        found = _shared.get(lane)
        if found is None:
            found = _shared[lane] = TemplateRenderer(
                processes=INTERACTIVE_PROCESSES if lane is Lane.INTERACTIVE else 1)
        return found


def render_ids(tokenizer: Any, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool,
               tools: Sequence[Mapping[str, Any]] = (), timeout_s: float = DEFAULT_TIMEOUT_S,
               lane: Lane = Lane.INTERACTIVE) -> list[int]:
    """``tokenizer.apply_chat_template(messages, add_generation_prompt=..., tools=...)``, the template
    bounded (blocking: for a worker thread). Raises `TemplateFailed`, `TemplateExceeded`, `RendererUnavailable`."""
    extra = {"tools": [dict(t) for t in tools]} if tools else {}
    template = ChatTemplate.of(tokenizer)
    if template is None:  # mlx-lm's own Python renderer: trusted code, in-process as before
        try:
            return list(tokenizer.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt,
                                                      **extra))
        except (TypeError, ValueError, KeyError, IndexError, AttributeError):
            raise TemplateFailed("the chat template could not render the messages") from None
    text = renderer(lane).render(template, messages, add_generation_prompt=add_generation_prompt, extra=extra,
                                 timeout_s=timeout_s)
    return encode(tokenizer, text)


__all__ = ["DEFAULT_TIMEOUT_S", "MEMORY_BYTES", "ChatTemplate", "Lane", "RendererUnavailable", "TemplateBound",
           "TemplateExceeded", "TemplateFailed", "TemplateRenderer", "encode", "max_rendered_chars", "render_ids",
           "renderer", "text_size"]
