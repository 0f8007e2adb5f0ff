"""Prompt tokens for admission, before the model is loaded, without blocking anyone else.

Admission needs the prompt length before ``inference_accepted`` goes out, and the accept must not
wait for a model load (protocol.md §7.2), so each model's tokenizer is loaded here with mlx-lm's own
loader (``mlx_lm.utils.load_tokenizer``, the one ``mlx_lm.load`` uses: same chat template, same
special tokens) and the ids it produces are handed to the engine (``ChatRequest.prompt_ids``), which
then never tokenizes on its thread. The agent warms every advertised model's tokenizer at startup.

Where the work runs (issue 11: a 15 MiB prompt must not delay a 100-token one):

* **inline**, on the event loop, for prompts up to ``INLINE_CHARS`` characters: a short prompt
  costs well under a millisecond to count, less than a hop to a thread pool and back, and it never
  waits behind anyone;
* **the bulk lane** (``BulkLane``: one dedicated thread, a short bounded queue) for anything longer,
  with a tokenizer instance of its own, so the loop's never waits on a lock. There a prompt is first
  rendered (a string join, no tokenization) and checked against the size bound of ``bounds.py``;
  past ``CHUNK_CHARS`` it is counted piece by piece and given up as soon as it is surely over the
  context window, so the tokenizer's working memory stays bounded by the window, not by what the
  consumer sent. Only a prompt that can fit is tokenized whole.

The count is exact: the same ``apply_chat_template(..., add_generation_prompt=True)`` the engine would
run, so admission neither over-reserves KV nor refuses a prompt that fits.

Vision models (``vision=`` ids): the count is the prompt *text* as mlx-vlm renders it, one marker per
image (``provider.engine.vlm.prompt_text_ids``, what the engine renders too); the image soft tokens are
the policy's to add (``memory.media.vision_span``). For a text model, image markers count as nothing
(admission refuses the images with 415 before anything is served).
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2

from provider.request.bounds import NO_BOUND, TokenBounds, normalizer_shrink
from provider.request.lanes import BulkLane
from provider.telemetry import get_logger

log = get_logger("provider.request.tokens")

TokenizerLoader = Callable[[Path], Any]
LaneRunner = Callable[..., Awaitable[Any]]  # (fn, *args) -> fn(*args) on the bulk lane
_TEMPLATE_ERRORS = (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError)

INLINE_CHARS = 4096  # counted on the loop: ~1 ms at most
CHUNK_CHARS = 256 * 1024  # longer rendered prompts are counted piece by piece, stopping early
BOUNDARY_SLACK_TOKENS = 8  # tokens a piece boundary may add to the count (a split pre-token)
_PIECE_BREAK = re.compile(r"(?<=\S) (?=\S)")  # a single space between two words: a pre-token boundary


class PromptError(ValueError):
    """The messages cannot be rendered by the model's chat template (a client error)."""


class PromptTooLong(ValueError):
    """The templated prompt leaves no room in the context window for one output token."""


class UnknownModel(KeyError):
    """No tokenizer path for this model id."""


def _mlx_lm_loader(path: Path) -> Any:
    from mlx_lm.utils import load_tokenizer  # deferred: importing mlx-lm costs ~1 s

    return load_tokenizer(path)


class VisionPromptTokenizer:
    """A VLM's processor behind the one method `_count` calls: the prompt text ids as the engine
    renders them (mlx-vlm's template helper, one marker per image)."""

    def __init__(self, path: Path) -> None:
        from mlx_vlm.utils import load_config, load_processor  # the vision extra, only for a VLM

        self._processor = load_processor(path, add_detokenizer=False)
        self._config = load_config(path)

    def apply_chat_template(self, messages: Sequence[Mapping[str, object]], add_generation_prompt: bool = True) -> list[int]:
        from provider.engine.vlm import prompt_text_ids

        return prompt_text_ids(self._processor, self._config, messages)


def _text_only(messages: Sequence[Mapping[str, object]]) -> list[Mapping[str, object]]:
    """Messages for a text model's template: image markers dropped, text parts joined."""
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, (list, tuple)):
            text = "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping) and p.get("type") == "text")
            m = {**m, "content": text}
        out.append(m)
    return out


class _Entry:
    __slots__ = ("bounds", "bulk", "tokenizer")

    def __init__(self, tokenizer: Any, bounds: TokenBounds) -> None:
        self.tokenizer = tokenizer  # used on the event loop only
        self.bounds = bounds
        self.bulk: Any | None = None  # the bulk lane's own instance, loaded on first use there


class PromptCounter:
    """Exact prompt token ids per model; short prompts on the loop, long ones in the bulk lane."""

    def __init__(self, paths: Mapping[str, Path], *, loader: TokenizerLoader = _mlx_lm_loader,
                 vision: Collection[str] = (), vision_loader: TokenizerLoader = VisionPromptTokenizer,
                 lane: BulkLane | None = None) -> None:
        self._paths = dict(paths)
        self._loader = loader
        self._vision = frozenset(vision)
        self._vision_loader = vision_loader
        self._lane = lane if lane is not None else BulkLane()
        self._entries: dict[str, _Entry] = {}
        self._loading: dict[str, asyncio.Future[_Entry]] = {}

    @property
    def lane(self) -> BulkLane:
        return self._lane

    def _loader_for(self, model_id: str) -> TokenizerLoader:
        return self._vision_loader if model_id in self._vision else self._loader

    def models(self) -> list[str]:
        return list(self._paths)

    def knows(self, model_id: str) -> bool:
        """Whether ``model_id`` is one of ours (a consumer-chosen string otherwise: not for logs)."""
        return model_id in self._paths

    def bounds(self, model_id: str) -> TokenBounds:
        """The model's size bound (no bound while its tokenizer is not loaded yet)."""
        entry = self._entries.get(model_id)
        return entry.bounds if entry is not None else NO_BOUND

    async def warm(self, model_ids: Iterable[str]) -> None:
        """Load these models' tokenizers now (startup), one after the other on a worker thread."""
        for model_id in model_ids:
            try:
                await self._entry(model_id)
            except Exception as exc:  # an edge: a broken tokenizer folder must not stop the agent
                log.warning("tokenizer_unavailable", model=model_id, exc_type=type(exc).__name__)

    async def count(self, model_id: str, messages: Sequence[Mapping[str, object]]) -> int:
        """Tokens of the templated prompt. Raises ``PromptError`` or ``UnknownModel``."""
        return len(await self.prompt_ids(model_id, messages))

    async def prompt_ids(self, model_id: str, messages: Sequence[Mapping[str, object]], *,
                         chars: int | None = None, limit: int | None = None,
                         run: LaneRunner | None = None) -> list[int]:
        """The templated prompt's token ids. ``chars``: the messages' whole text length if the caller
        has it (it decides inline or lane); ``limit``: the context window — ``PromptTooLong`` as soon as the prompt surely reaches it;
        ``run``: how to run lane work (``intake.Ticket.in_lane``, which keeps the request's working
        memory reserved until the thread is done), default the lane itself.
        Raises ``PromptError``, ``PromptTooLong``, ``UnknownModel`` or ``lanes.LaneFull``."""
        entry = await self._entry(model_id)
        msgs = list(messages) if model_id in self._vision else _text_only(messages)
        size = chars if chars is not None else _text_chars(messages)
        if size <= INLINE_CHARS:
            ids = _encode(entry.tokenizer, msgs)
            if limit is not None and len(ids) >= limit:
                raise PromptTooLong()
            return ids
        return await (run or self._lane.run)(self._bulk_ids, model_id, entry, msgs, limit)

    # -- the bulk lane (its own thread) -----------------------------------------------------------

    def _bulk_ids(self, model_id: str, entry: _Entry, messages: list[Mapping[str, object]],
                  limit: int | None) -> list[int]:
        if entry.bulk is None:
            entry.bulk = self._loader_for(model_id)(self._paths[model_id])
        tokenizer = entry.bulk
        if model_id in self._vision:  # the processor renders its image markers: count it exactly
            ids = _encode(tokenizer, messages)
            if limit is not None and len(ids) >= limit:
                raise PromptTooLong()
            return ids
        try:
            rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except _TEMPLATE_ERRORS:
            raise PromptError("chat template could not render the messages") from None
        if not isinstance(rendered, str):
            return _encode(tokenizer, messages)
        if limit is not None:
            if entry.bounds.lower_bound(len(rendered)) >= limit:
                raise PromptTooLong()
            if len(rendered) > CHUNK_CHARS and _surely_over(tokenizer, rendered, limit):
                raise PromptTooLong()
        ids = _encode(tokenizer, messages)
        if limit is not None and len(ids) >= limit:
            raise PromptTooLong()
        return ids

    # -- tokenizers ---------------------------------------------------------------------------------

    async def _entry(self, model_id: str) -> _Entry:
        entry = self._entries.get(model_id)
        if entry is not None:
            return entry
        path = self._paths.get(model_id)
        if path is None:
            raise UnknownModel(model_id)
        task = self._loading.get(model_id)
        if task is None:
            # A task of its own: a caller being cancelled must not cancel the load others wait for.
            task = asyncio.ensure_future(self._load(model_id, path))
            self._loading[model_id] = task
        return await asyncio.shield(task)

    async def _load(self, model_id: str, path: Path) -> _Entry:
        try:
            tokenizer = await asyncio.to_thread(self._loader_for(model_id), path)
            bounds = await asyncio.to_thread(measure_bounds, tokenizer)
        finally:
            self._loading.pop(model_id, None)
        entry = self._entries[model_id] = _Entry(tokenizer, bounds)
        log.info("tokenizer_ready", model=model_id, longest_token_count=bounds.longest_token_chars,
                 per_message_tokens=bounds.per_message_tokens, outcome="bounded" if bounds.shrink else "unbounded")
        return entry


def _text_chars(messages: Sequence[Mapping[str, object]]) -> int:
    """All message text (string contents and text parts): what decides inline or the lane."""
    total = 0
    for m in messages:
        content = m.get("content")
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, (list, tuple)):
            total += sum(len(p["text"]) for p in content if isinstance(p, Mapping) and isinstance(p.get("text"), str))
    return total


def _encode(tokenizer: Any, messages: Sequence[Mapping[str, object]]) -> list[int]:
    try:
        ids = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True)
    except _TEMPLATE_ERRORS:
        raise PromptError("chat template could not render the messages") from None
    if not ids:
        raise PromptError("empty prompt")
    return list(ids)


def _surely_over(tokenizer: Any, rendered: str, limit: int) -> bool:
    """Count `rendered` in pieces of about CHUNK_CHARS, split between words, and stop as soon as
    the count less the pieces' boundary slack reaches `limit`. Memory: one piece at a time."""
    encode = getattr(tokenizer, "encode", None)
    if encode is None:
        return False
    total = pieces = 0
    start = 0
    while start < len(rendered):
        end = min(len(rendered), start + CHUNK_CHARS)
        if end < len(rendered):
            found = _PIECE_BREAK.search(rendered, end, min(len(rendered), end + 4096))
            end = found.start() if found else end
        total += len(encode(rendered[start:end], add_special_tokens=False))
        pieces += 1
        if total - pieces * BOUNDARY_SLACK_TOKENS >= limit:
            return True
        start = end
    return False


def measure_bounds(tokenizer: Any) -> TokenBounds:
    """The size bound of one tokenizer (see bounds.py): its longest token in characters, what its
    normalizer can shorten, and the template tokens each message adds at least."""
    backend = getattr(getattr(tokenizer, "_tokenizer", tokenizer), "backend_tokenizer", None)
    if backend is None:
        return NO_BOUND
    try:
        shrink = normalizer_shrink(json.loads(backend.to_str()))
        size = backend.get_vocab_size(with_added_tokens=True)
        pieces = backend.decode_batch([[i] for i in range(size)], skip_special_tokens=False)
    except Exception:  # an edge: an odd tokenizer gets no size bound, only exact counts
        return NO_BOUND
    # +1: a decoder may strip the one leading space a token stands for ("▁the" -> "the").
    longest = max((len(p) for p in pieces), default=0) + 1
    return TokenBounds(longest_token_chars=longest, shrink=shrink, per_message_tokens=_per_message(tokenizer))


def _per_message(tokenizer: Any) -> int:
    """Template tokens one message adds at least: [u] against [u, a, u], less their content."""
    def length(messages: list[dict[str, str]]) -> int:
        return len(tokenizer.apply_chat_template(messages, add_generation_prompt=False))

    user, assistant = {"role": "user", "content": "x"}, {"role": "assistant", "content": "x"}
    try:
        one = length([user])
        three = length([user, assistant, user])
        content = len(tokenizer.encode("x", add_special_tokens=False))
    except Exception:  # an edge: a template is third-party code; no bound is claimed from it then
        return 0
    return max(0, (three - one - 2 * content) // 2)


__all__ = ["INLINE_CHARS", "PromptCounter", "PromptError", "PromptTooLong", "TokenizerLoader", "UnknownModel",
           "measure_bounds"]
