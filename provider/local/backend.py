"""What the local server serves from: the shared `provider.runtime.Runtime`, so `serve --local`
has the same admission and memory policy as the coordinator agent.

`RuntimeBackend.open(request_id, body)` (chat) and `open_completion` (the legacy completions
endpoint: the prompt tokenized without the chat template) are async context managers that either
raise (`InvalidBody`, `Refused`: a typed `protocol.errors.Failure`, or `Explained`) or yield the
request's event stream. The steps are the request pipeline's (`provider.request.serving`), the
coordinator's door's too, minus the encryption: the body read through the runtime's `Intake` (a
large one in the bulk lane, its working memory reserved), the size bound, the images' headers, the
exact prompt count, the output plan, the booking, then the model waited for and the request
submitted; leaving the block cancels it if it is still running. This door sets the pipeline's
`queue_s` (`local_queue_s`: a booking refused for room waits for a request in flight to end) and asks
the engine to prepare a conversation's next turn.

Every 503 carries `Retry-After` (a capacity refusal is transient: memory frees as requests finish; a
pause says when it ends, `Failure.retry_after_s`). A request this machine can never serve (the model,
or the request's KV, over the cap: `request_exceeds_node`) is not a 503 here: the coordinator's front
refuses it so another provider takes it, but behind the owner's server there is no other node, so it
is `TooLarge`, a 400 whose message gives the numbers (what `doctor` shows), at every ask: whichever
step refuses it (the intake's read-only check before counting, or the booking after), one function
answers (`_answer`). A model whose load failed and is remembered is a 404 `model_load_failed` with
its reason (`load_failed`), never retried by an SDK. The owner's client is told more than the
coordinator's fixed words in two more cases (`Explained`): a model not served here (the id asked
for, and the ids served) and a prompt over the context window (its tokens, max_tokens and the
window). An engine failure is answered from the table both doors read (`provider.response.failures`).
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from enum import StrEnum
from typing import Any

from memory import CapFigures
from memory.fit import FitResult
from memory.media import DEFAULT_LIMITS, MediaLimits
from protocol.errors import ErrorReason, Failure, RejectionReason
from provider.engine import EngineError, RequestStream
from provider.metrics import EvictionCause
from provider.models.broken import reason_words
from provider.models.tools import ToolFormat
from provider.request import PromptCounter
from provider.request.body import ChatBody, CompletionBody
from provider.request.intake import OverContext, Refusal
from provider.request.media import DECODABLE_FORMATS, MediaRefused
from provider.request.serving import Pipeline, Prepared, json_body
from provider.response.failures import engine_failure
from provider.runtime import Runtime
from provider.slots import ModelState, SlotRefused
from provider.slots.admission import kv_need
from provider.slots.broken import Broken
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
        if self.failure.retry_after_s is not None:  # a pause says when it ends (provider/guest)
            return self.failure.retry_after_s
        return DRAINING_RETRY_AFTER_S if self.failure == Failure.draining() else RETRY_AFTER_S


class Explained(Exception):
    """A refusal the owner's client is told in this request's own numbers and model ids (fixed words
    around them, never request text): `status_code`, `code`, `param` and `message` of OpenAI's error.
    The coordinator's front keeps the fixed text of `failure` instead."""

    def __init__(self, failure: Failure, code: str, param: str, message: str, status_code: int = 400) -> None:
        super().__init__(code)
        self.failure = failure
        self.code = code
        self.param = param
        self.message = message
        self.status_code = status_code


class TooLarge(Explained):
    """A request this machine can never serve: a 400 whose message has the numbers."""


MAX_SHOWN_ID = 200  # characters of a requested model id repeated in an error (the id is the client's)


def unknown_model(asked: str, served: list[str]) -> Explained:
    """404 naming the model asked for (an id, not prompt text; never logged) and the ones served."""
    shown = asked if len(asked) <= MAX_SHOWN_ID else asked[:MAX_SHOWN_ID] + "..."
    listed = ("Models served: " + ", ".join(served) + ".") if served else \
        "No model is served now (`darkbloom-provider models` shows what was found and why)."
    return Explained(Failure.model_unavailable(), "model_unavailable", "model",
                     f"The model '{shown}' is not served here. {listed}", status_code=404)


def context_exceeded(over: OverContext, param: str) -> Explained:
    """400 in numbers: the prompt's tokens (exact, or at least), max_tokens, the model's window."""
    tokens = f"{over.prompt_tokens} tokens" if over.exact else f"at least {over.prompt_tokens} tokens"
    asked = "" if over.max_tokens is None else f" (max_tokens {over.max_tokens})"
    return Explained(Failure.request_exceeds_context(), "invalid_request", param,
                     f"This prompt has {tokens} but model '{over.model_id}' has a context window of "
                     f"{over.context_length} tokens, so no output fits{asked}. Shorten the prompt: an output "
                     "that would pass the window's end is cut short there (finish_reason \"length\"), never refused.")


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB"


def too_large(failure: Failure, model_id: str, fit: FitResult, kv_bytes: int, figures: CapFigures) -> TooLarge:
    """Why `model_id` (one of ours) with this request's `kv_bytes` can never be served here, in numbers."""
    if not fit.ever_fits:
        return TooLarge(failure, "model_too_large", "model",
                        f"Model '{model_id}' needs {_gib(fit.required_bytes)} of memory to load (its weights and "
                        f"the load headroom) but this machine's memory cap is {_gib(fit.cap_bytes)}, so it can "
                        "never be served here. `darkbloom-provider doctor` shows what fits.")
    if failure.rejection is RejectionReason.TOKEN_BUDGET:
        return TooLarge(failure, "request_too_large", "max_tokens",
                        f"This request needs {_gib(kv_bytes)} of KV cache for its prompt and max_tokens, but one "
                        f"request may use at most {_gib(figures.single_request_limit_bytes)} on this machine. "
                        "Lower max_tokens or shorten the prompt.")
    return TooLarge(failure, "request_too_large", "max_tokens",
                    f"Model '{model_id}' with this request's KV cache needs {_gib(fit.required_bytes + kv_bytes)} "
                    f"but this machine's memory cap is {_gib(fit.cap_bytes)}. Lower max_tokens or shorten the "
                    "prompt.")


_MIB = 1 << 20
_FORMATS = ", ".join(sorted(DECODABLE_FORMATS))
_IMAGE_WORDS = {
    "remote_url": "An image is a URL, and this server never fetches one: send the image inline as a data: URI "
                  "(data:image/png;base64,...).",
    "url_scheme": "An image_url must be a data: URI (data:image/png;base64,...).",
    "data_uri": "An image's data: URI is not of the form data:image/<type>;base64,<data>.",
    "media_type": "An image's data: URI does not have an image/* media type.",
    "base64": "An image's base64 data does not decode.",
    "image_header": f"An image could not be read: it is not a {_FORMATS} image, or it is damaged.",
    "image_format": f"An image's format is not one this server decodes: send {_FORMATS}.",
    "image_data": "An image is damaged: its header reads but its pixels do not decode.",
    "no_vision_runtime": "This installation cannot read images: its `vision` extra is not installed "
                         "(`make venv` installs it).",
}


def media_refused(refused: MediaRefused, limits: MediaLimits = DEFAULT_LIMITS) -> Explained:
    """An image refusal with its reason in words (the limit, where one was passed) and the parameter:
    `messages` for what the images add up to, `image_url` for one image. Never the image or its URL."""
    kind = refused.kind
    if kind == "decoded_length":
        message = f"An image decodes to more than {limits.max_decoded_bytes / _MIB:.0f} MiB, the most one image may."
    elif kind == "image_pixels":
        message = f"An image has more than {limits.max_image_pixels:,} pixels, the most one image may have."
    elif kind == "too_many_images":
        message = f"This request carries more than {limits.max_images} images, the most one request may."
    elif kind == "request_pixels":
        message = (f"This request's images have more than {limits.max_request_pixels:,} pixels in all, the most one "
                   "request may.")
    else:
        message = _IMAGE_WORDS.get(kind, "An image was refused.")
    param = "messages" if kind in ("too_many_images", "request_pixels") else "image_url"
    failure = refused.failure
    return Explained(failure, failure.code.value, param, message, status_code=failure.status_code)


def images_for_a_text_model(failure: Failure, model_id: str) -> Explained:
    """415 naming the model: it reads text only."""
    shown = model_id if len(model_id) <= MAX_SHOWN_ID else model_id[:MAX_SHOWN_ID] + "..."
    return Explained(failure, failure.code.value, "image_url",
                     f"Model '{shown}' reads text only and this request carries images: send text only, or ask a "
                     "vision-language model.", status_code=failure.status_code)


_NEVER_HERE = frozenset({ErrorReason.REQUEST_EXCEEDS_NODE, ErrorReason.REQUEST_EXCEEDS_NODE_BUDGET})


def load_failed(failure: Failure, model_id: str, broken: Broken | None) -> Explained:
    """404 `model_load_failed`: the model's load failed here and is remembered, in words (its reason,
    and what makes it be tried again). A 4xx, not a 5xx: OpenAI's SDKs retry 408, 409, 429 and every
    5xx on their own, and trying again cannot help until the folder is fixed; a 404 is what they raise
    for a model they cannot use (`NotFoundError`), and the model is left out of /v1/models meanwhile."""
    why = reason_words(broken.reason.value) if broken is not None else "its load failed"
    return Explained(failure, "model_load_failed", "model",
                     f"Model '{model_id}' failed to load on this machine: {why}. It is not loaded again until its "
                     "folder changes (fix or replace its files) or a backoff passes; `darkbloom-provider models` "
                     "and /status show it.", status_code=404)


class UnloadOutcome(StrEnum):
    """The answer of `POST /control/unload` (`darkbloom-provider unload MODEL`)."""

    UNLOADED = "unloaded"
    NOT_LOADED = "not_loaded"
    BUSY = "busy"  # requests are running on it: it stays
    UNKNOWN_MODEL = "unknown_model"


class RuntimeBackend:
    """The local app's `Backend` over a started `Runtime`."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.pipeline = Pipeline(runtime.intake, runtime.manager, runtime.stats, queue_s=runtime.settings.local_queue_s,
                                 next_turn=True)  # one user's conversations: the next turn comes here

    @property
    def figures(self) -> CapFigures:
        return self.runtime.ledger.figures

    @property
    def counter(self) -> PromptCounter:
        return self.runtime.counter

    def model_ids(self) -> list[str]:
        return list(self.runtime.servable_now())

    def tool_format(self, model_id: str) -> ToolFormat | None:
        """How the model writes tool calls (None: it has no tool calling, or is not one of ours)."""
        return self.runtime.counter.tool_format_now(model_id)

    def open(self, request_id: str, raw: bytes) -> AbstractAsyncContextManager[tuple[ChatBody, RequestStream]]:
        """A chat request through the pipeline: parse `raw` (inline or in the bulk lane, by its size),
        count, book, wait for the model, submit; yields the body and its event stream. Raises
        `InvalidBody`, `Refused` or `Explained`."""
        return self._open(self.pipeline.chat(request_id, len(raw), functools.partial(json_body, raw)), "messages")

    def open_completion(self, request_id: str,
                        raw: bytes) -> AbstractAsyncContextManager[tuple[CompletionBody, RequestStream]]:
        """A legacy completions request, the same steps as `open` but for the prompt: its text
        tokenized without the chat template (or its ids as given). Same admission, same engine."""
        return self._open(self.pipeline.completion(request_id, len(raw), functools.partial(json_body, raw)), "prompt")

    @asynccontextmanager
    async def _open(self, prepared: AbstractAsyncContextManager[Prepared[Any]],
                    prompt_param: str) -> AsyncIterator[tuple[Any, RequestStream]]:
        """`open` and `open_completion`: the pipeline's request, its refusals as the door's answers
        (`prompt_param` names the prompt's field), then served."""
        async with contextlib.AsyncExitStack() as stack:
            try:
                request = await stack.enter_async_context(prepared)
            except Refusal as refusal:  # the intake's checks, admission's read-only answer among them
                raise self._answer(refusal.failure, refusal.model_id, prompt_param, over=refusal.over,
                                   prompt_tokens=refusal.prompt_tokens or 0, max_tokens=refusal.max_tokens) from None
            except MediaRefused as refused:  # chat only: a completion carries no media
                raise media_refused(refused) from None
            stream = await stack.enter_async_context(self._served(request, prompt_param))
            yield request.body, stream

    @asynccontextmanager
    async def _served(self, request: Prepared[Any], prompt_param: str) -> AsyncIterator[RequestStream]:
        """Book (waiting up to local_queue_s for room), wait for the model, submit; a refusal in the
        owner's words, an engine failure from the table both doors read."""
        model_id = request.body.model
        try:
            booking = await request.book()
        except Refusal as refusal:
            raise self._answer(refusal.failure, model_id, prompt_param, over=refusal.over,
                               prompt_tokens=request.prompt_tokens, max_tokens=request.body.max_tokens) from None
        metrics = self.runtime.metrics
        try:
            async with request.serve(booking) as stream:
                metrics.add_tokens(prompt=request.prompt_tokens)
                with metrics.in_flight():
                    yield stream
        except MediaRefused as refused:  # an image that would not decode
            raise media_refused(refused) from None
        except SlotRefused as exc:  # the model's load failed (remembered), stalled, or was undone
            raise self._answer(exc.failure, model_id, prompt_param) from None
        except EngineError as exc:  # submit refused by the engine itself (closed under a drain)
            raise Refused(engine_failure(exc.code)) from None

    def _answer(self, failure: Failure, model_id: str | None, prompt_param: str, *, over: OverContext | None = None,
                prompt_tokens: int = 0, max_tokens: int | None = None) -> Exception:
        """The one answer to a refusal, whichever step refused (the intake's checks before counting, the
        booking after it, the wait for the model): `Explained` where this request's ids and numbers say
        more than the failure's fixed text — a request this machine can never serve (`TooLarge`, a 400
        with the numbers), a model whose failed load is remembered (404 `model_load_failed`), a model not
        served here (the id asked for, and those served), a prompt over the context window, images for a
        text model — else the failure itself (`Refused`: a 503 with `Retry-After` when it is one)."""
        if failure.reason in _NEVER_HERE and model_id is not None:
            return self._too_large(failure, model_id, prompt_tokens, max_tokens)
        if failure == Failure.model_load_failed() and model_id is not None:
            return load_failed(failure, model_id, self.runtime.manager.broken(model_id))
        if failure.reason is ErrorReason.REQUEST_EXCEEDS_CONTEXT and over is not None:
            return context_exceeded(over, prompt_param)
        if failure == Failure.model_unavailable() and model_id is not None:
            return unknown_model(model_id, self.model_ids())
        if failure == Failure.unsupported_media() and model_id is not None:  # admission: images for a text model
            return images_for_a_text_model(failure, model_id)
        return Refused(failure)

    def _too_large(self, failure: Failure, model_id: str, prompt_tokens: int, max_tokens: int | None) -> Exception:
        manager = self.runtime.manager
        fit = next((r for m, r in manager.verdicts() if m.id == model_id), None)
        info = manager.info(model_id)
        if fit is None or info is None:  # not ours after all (it was just admitted): keep the refusal
            return Refused(failure)
        kv = kv_need(self.figures, info, prompt_tokens, max_tokens).nbytes
        return too_large(failure, model_id, fit, kv, self.figures)

    def token_bytes(self, model_id: str) -> Callable[[int], bytes] | None:
        """How the model's tokens are spelled in log-probabilities (built at intake for a request that asked)."""
        table = self.runtime.intake.grammars.table(model_id)
        return None if table is None else table.token_bytes

    def status(self) -> dict[str, Any]:
        return self.runtime.status()

    async def unload(self, model_id: str) -> str:
        """The operator's `unload MODEL`: an idle loaded model is unloaded now (a busy one is left alone)."""
        manager = self.runtime.manager
        if model_id not in self.model_ids() and manager.info(model_id) is None:
            return UnloadOutcome.UNKNOWN_MODEL
        if manager.state(model_id) is not ModelState.LOADED:
            return UnloadOutcome.NOT_LOADED
        if await manager.unload(model_id, cause=EvictionCause.OPERATOR):
            log.info("model_unloaded_by_operator", model=model_id)
            return UnloadOutcome.UNLOADED
        return UnloadOutcome.BUSY

    def refresh_metrics(self) -> None:
        self.runtime.refresh_metrics()

