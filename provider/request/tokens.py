"""Prompt tokens for admission, before the model is loaded, without blocking anyone else.

Admission needs the prompt length before ``inference_accepted`` goes out, and the accept must not
wait for a model load, so each model's tokenizer is loaded here with mlx-lm's own
loader (``mlx_lm.utils.load_tokenizer``, the one ``mlx_lm.load`` uses: same chat template, same
special tokens) and the ids it produces are handed to the engine (``ChatRequest.prompt_ids``), which
then never tokenizes on its thread. The agent warms every advertised model's tokenizer at startup.

The chat template is the model folder's code: it renders in a bounded child process
(`provider.models.template`), never on the event loop or a thread of ours. Tokenizing the rendered
text stays here. A template that passes its time or memory bound — on the start-up check (`warm`
renders one and three short messages) or on a request — makes the model unservable from then on
(`unservable()`, `on_unservable`): that request fails with `TemplateTooCostly` (a `PromptError`),
later ones as an unknown model.

Where the work runs (a 15 MiB prompt must not delay a 100-token one):

* **inline**, for prompts up to ``INLINE_CHARS`` characters: the render is awaited on the event loop
  (the interactive renderer, ~0.2 ms there and back), and the rendered text (up to
  ``INLINE_RENDERED_CHARS``) is counted on the loop: well under a millisecond;
* **the bulk lane** (``BulkLane``: one dedicated thread, a short bounded queue) for anything longer,
  with a tokenizer instance of its own, so the loop's never waits on a lock, and the bulk renderer,
  so a short prompt never waits behind a long one. There the rendered prompt is checked against the
  size bound of ``bounds.py``; past ``CHUNK_CHARS`` it is counted piece by piece and given up as soon
  as it is surely over the context window, so the tokenizer's working memory stays bounded by the
  window, not by what the consumer sent. Only a prompt that can fit is tokenized whole.

The count is exact: the ids of the same ``apply_chat_template(..., add_generation_prompt=True)`` the
engine would run, so admission neither over-reserves KV nor refuses a prompt that fits.

Tools: a request's function tools are rendered with the messages (the template's
``tools`` variable, as ``apply_chat_template(..., tools=...)`` renders them) and counted with them.
Only a model whose family mlx-lm has a tool parser for (`provider.models.tools.ToolFormat`, read
when its tokenizer loads; `tool_format`) can be offered tools: for any other, `ToolsUnsupported`.

Vision models (``vision=`` ids): the count is the prompt *text* as mlx-vlm renders it, one marker per
image (``provider.engine.vlm.prompt_text_ids``, what the engine renders too), always in the lane; the
image soft tokens are the policy's to add (``memory.media.vision_span``). For a text model, image
markers count as nothing (admission refuses the images with 415 before anything is served).
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2

from provider.models.template import (
    DEFAULT_TIMEOUT_S,
    ChatTemplate,
    Lane,
    RendererUnavailable,
    TemplateBound,
    TemplateExceeded,
    TemplateFailed,
    render_ids,
    renderer,
    text_size,
)
from provider.models.template_check import PROBES
from provider.models.tools import ToolFormat
from provider.request.bounds import NO_BOUND, TokenBounds, normalizer_shrink
from provider.request.lanes import BulkLane
from provider.telemetry import get_logger

log = get_logger("provider.request.tokens")

TokenizerLoader = Callable[[Path], Any]
LaneRunner = Callable[..., Awaitable[Any]]  # (fn, *args, size=chars) -> fn(*args) on the bulk lane
# What mlx-lm's own Python renderers (in-process) raise for messages they cannot render.
_TEMPLATE_ERRORS = (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError)

INLINE_CHARS = 4096  # rendered on the loop's renderer and counted on the loop: ~1 ms at most
INLINE_RENDERED_CHARS = 64 * 1024  # a short prompt its template made longer than this is counted in the lane
CHUNK_CHARS = 256 * 1024  # longer rendered prompts are counted piece by piece, stopping early
BOUNDARY_SLACK_TOKENS = 8  # tokens a piece boundary may add to the count (a split pre-token)
_PIECE_BREAK = re.compile(r"(?<=\S) (?=\S)")  # a single space between two words: a pre-token boundary


class PromptError(ValueError):
    """The messages cannot be rendered by the model's chat template (a client error)."""


class TemplateTooCostly(PromptError):
    """The template passed its time or memory bound on this prompt: the model is unservable now."""

    def __init__(self, bound: TemplateBound) -> None:
        super().__init__(bound.value)
        self.bound = bound


class ToolsUnsupported(ValueError):
    """Tools were offered to a model whose family has no tool calling (a client error naming `tools`)."""


class PromptTooLong(ValueError):
    """The templated prompt leaves no room in the context window for one output token. `tokens`: its
    length, exact, or (`exact` False) what it has at least when counting stopped as soon as it was
    surely over."""

    def __init__(self, tokens: int, *, exact: bool) -> None:
        super().__init__("prompt too long")
        self.tokens = tokens
        self.exact = exact


class UnknownModel(KeyError):
    """No tokenizer path for this model id, or its template made it unservable."""


def load_tokenizer(path: Path) -> Any:
    from mlx_lm.utils import load_tokenizer  # deferred: importing mlx-lm costs ~1 s

    return load_tokenizer(path)


class VisionPromptTokenizer:
    """A VLM's processor behind the one method `_count` calls: the prompt text ids as the engine
    renders them (mlx-vlm's template helper, one marker per image; the template bounded). Blocking."""

    def __init__(self, path: Path, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        from mlx_vlm.utils import load_config, load_processor  # the vision extra, only for a VLM

        self._processor = load_processor(path, add_detokenizer=False)
        self._config = load_config(path)
        self._timeout_s = timeout_s

    def apply_chat_template(self, messages: Sequence[Mapping[str, object]], add_generation_prompt: bool = True) -> list[int]:
        from provider.engine.vlm import prompt_text_ids

        return prompt_text_ids(self._processor, self._config, messages, lane=Lane.BULK, timeout_s=self._timeout_s)


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
    __slots__ = ("bounds", "bulk", "template", "tokenizer", "tools")

    def __init__(self, tokenizer: Any, bounds: TokenBounds, template: ChatTemplate | None,
                 tools: ToolFormat | None = None) -> None:
        self.tokenizer = tokenizer  # used on the event loop only (a VLM's: in the lane, see `_load`)
        self.bounds = bounds
        self.template = template  # None: the tokenizer renders with mlx-lm's own Python code, in-process
        self.tools = tools  # None: the model's family has no tool calling
        self.bulk: Any | None = None  # the bulk lane's own instance, loaded on first use there


class PromptCounter:
    """Exact prompt token ids per model; short prompts on the loop, long ones in the bulk lane."""

    def __init__(self, paths: Mapping[str, Path], *, loader: TokenizerLoader = load_tokenizer,
                 vision: Collection[str] = (), vision_loader: TokenizerLoader | None = None,
                 lane: BulkLane | None = None, template_timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self._paths = dict(paths)
        self._loader = loader
        self._vision = frozenset(vision)
        self._vision_loader = vision_loader or functools.partial(VisionPromptTokenizer, timeout_s=template_timeout_s)
        self._lane = lane if lane is not None else BulkLane()
        self._timeout_s = template_timeout_s
        self._entries: dict[str, _Entry] = {}
        self._loading: dict[str, asyncio.Future[_Entry]] = {}
        self._unservable: dict[str, TemplateBound] = {}
        self.on_unservable: Callable[[str, TemplateBound], None] | None = None  # called on the loop, once per model

    @property
    def lane(self) -> BulkLane:
        return self._lane

    def _loader_for(self, model_id: str) -> TokenizerLoader:
        return self._vision_loader if model_id in self._vision else self._loader

    def models(self) -> list[str]:
        return list(self._paths)

    def add(self, model_id: str, path: Path) -> None:
        """A model that arrived while running (a verified prefetch): its tokenizer loads on first use."""
        self._paths[model_id] = Path(path)

    def knows(self, model_id: str) -> bool:
        """Whether ``model_id`` is one of ours and servable (a consumer-chosen string otherwise: not for logs)."""
        return model_id in self._paths and model_id not in self._unservable

    def is_vision(self, model_id: str) -> bool:
        return model_id in self._vision

    async def tokenizer(self, model_id: str) -> Any:
        """The model's tokenizer, loaded on first use (its grammar vocabulary is built from
        it in a thread; nothing there encodes with it). Raises ``UnknownModel``."""
        return (await self._entry(model_id)).tokenizer

    def unservable(self) -> dict[str, TemplateBound]:
        """Models whose chat template passed a bound, with the bound."""
        return dict(self._unservable)

    def bounds(self, model_id: str) -> TokenBounds:
        """The model's size bound (no bound while its tokenizer is not loaded yet)."""
        entry = self._entries.get(model_id)
        return entry.bounds if entry is not None else NO_BOUND

    async def warm(self, model_ids: Iterable[str]) -> dict[str, TemplateBound]:
        """Load these models' tokenizers and check their templates now (startup), one after the
        other; returns the models whose template passed a bound (unservable from now on)."""
        ids = list(model_ids)
        for model_id in ids:
            try:
                await self._entry(model_id)
            except UnknownModel:
                pass  # its template passed a bound: recorded, and logged by the caller
            except Exception as exc:  # an edge: a broken tokenizer folder must not stop the agent
                log.warning("tokenizer_unavailable", model=model_id, exc_type=type(exc).__name__)
        return {m: self._unservable[m] for m in ids if m in self._unservable}

    async def count(self, model_id: str, messages: Sequence[Mapping[str, object]]) -> int:
        """Tokens of the templated prompt. Raises ``PromptError`` or ``UnknownModel``."""
        return len(await self.prompt_ids(model_id, messages))

    async def tool_format(self, model_id: str) -> ToolFormat | None:
        """How the model's family writes tool calls (its tokenizer loaded first); None: it has no tool
        calling. Raises ``UnknownModel``."""
        return (await self._entry(model_id)).tools

    def tool_format_now(self, model_id: str) -> ToolFormat | None:
        """`tool_format` for a model whose tokenizer is loaded (warmed at start); None otherwise."""
        entry = self._entries.get(model_id)
        return entry.tools if entry is not None else None

    async def prompt_ids(self, model_id: str, messages: Sequence[Mapping[str, object]], *,
                         tools: Sequence[Mapping[str, Any]] = (), chars: int | None = None,
                         limit: int | None = None, run: LaneRunner | None = None) -> list[int]:
        """The templated prompt's token ids. ``tools``: function tools the template renders with the
        messages; ``chars``: the messages' whole text length if the caller
        has it (it decides inline or lane); ``limit``: the context window — ``PromptTooLong`` as soon as the prompt surely reaches it;
        ``run``: how to run lane work (``intake.Ticket.in_lane``, which keeps the request's working
        memory reserved until the thread is done), default the lane itself.
        Raises ``PromptError`` (``TemplateTooCostly``), ``PromptTooLong``, ``UnknownModel``, ``ToolsUnsupported``
        or ``lanes.LaneFull``."""
        entry = await self._entry(model_id)
        if tools and entry.tools is None:
            raise ToolsUnsupported()
        run = run or self._lane.run
        vision = model_id in self._vision
        msgs = list(messages) if vision else _text_only(messages)
        tools = [dict(t) for t in tools]
        size = (chars if chars is not None else _text_chars(messages)) + text_size(tools)
        try:
            if vision or size > INLINE_CHARS:
                return await run(self._bulk_ids, model_id, entry, msgs, tools, limit, size=size)
            if entry.template is None:
                ids = _encode_in_process(entry.tokenizer, msgs, tools)
            else:
                rendered = await renderer(Lane.INTERACTIVE).arender(entry.template, msgs, add_generation_prompt=True,
                                                                    extra=_tools_extra(tools), timeout_s=self._timeout_s)
                if len(rendered) > INLINE_RENDERED_CHARS:
                    return await run(self._counted, model_id, entry, rendered, limit, size=len(rendered))
                ids = _encode(entry.tokenizer, rendered)
        except TemplateExceeded as exc:
            self._mark_unservable(model_id, exc.bound)
            raise TemplateTooCostly(exc.bound) from None
        except TemplateFailed:
            raise PromptError("chat template could not render the messages") from None
        if limit is not None and len(ids) >= limit:
            raise PromptTooLong(len(ids), exact=True)
        return ids

    async def text_ids(self, model_id: str, text: str, *, limit: int | None = None,
                       run: LaneRunner | None = None) -> list[int]:
        """A raw prompt's ids (the legacy completions endpoint: no chat template), with the tokenizer's
        own special tokens (a BOS where the model has one), as mlx-lm's server and vLLM encode it. Long
        text is counted in the lane and given up as soon as it is surely over ``limit``. May be empty.
        Raises ``PromptError`` (text the tokenizer cannot take), ``PromptTooLong``, ``UnknownModel`` or
        ``lanes.LaneFull``; a vision model's processor has no plain encoder (``is_vision``)."""
        entry = await self._entry(model_id)
        if len(text) > INLINE_RENDERED_CHARS:
            return await (run or self._lane.run)(self._counted, model_id, entry, text, limit, True, size=len(text))
        ids = _encode(entry.tokenizer, text, special=True)
        if limit is not None and len(ids) >= limit:
            raise PromptTooLong(len(ids), exact=True)
        return ids

    async def vocabulary(self, model_id: str) -> int:
        """How many token ids the model's tokenizer knows (ids from 0 to this less one)."""
        return len((await self._entry(model_id)).tokenizer)

    def _mark_unservable(self, model_id: str, bound: TemplateBound) -> None:
        if model_id in self._unservable:
            return
        self._unservable[model_id] = bound
        log.warning("model_unservable", model=model_id, reason=bound.value)
        if self.on_unservable is not None:
            self.on_unservable(model_id, bound)

    # -- the bulk lane (its own thread) -----------------------------------------------------------

    def _bulk_ids(self, model_id: str, entry: _Entry, messages: list[Mapping[str, object]],
                  tools: list[dict[str, Any]], limit: int | None) -> list[int]:
        tokenizer = self._bulk_tokenizer(model_id, entry)
        if model_id in self._vision or entry.template is None:  # a VLM's processor renders its image markers
            ids = _encode_in_process(tokenizer, messages, tools)
        else:
            rendered = renderer(Lane.BULK).render(entry.template, messages, add_generation_prompt=True,
                                                  extra=_tools_extra(tools), timeout_s=self._timeout_s)
            return self._counted(model_id, entry, rendered, limit)
        if limit is not None and len(ids) >= limit:
            raise PromptTooLong(len(ids), exact=True)
        return ids

    def _bulk_tokenizer(self, model_id: str, entry: _Entry) -> Any:
        if entry.bulk is None:
            entry.bulk = self._loader_for(model_id)(self._paths[model_id])
        return entry.bulk

    def _counted(self, model_id: str, entry: _Entry, rendered: str, limit: int | None,
                 special: bool = False) -> list[int]:
        """A rendered prompt's ids (`special`: a raw one's, with the tokenizer's special tokens), given
        up early when it is surely over `limit` (lane thread)."""
        tokenizer = self._bulk_tokenizer(model_id, entry)
        if limit is not None:
            lower = entry.bounds.lower_bound(len(rendered))
            if lower >= limit:
                raise PromptTooLong(lower, exact=False)
            over = _surely_over(tokenizer, rendered, limit) if len(rendered) > CHUNK_CHARS else None
            if over is not None:
                raise PromptTooLong(over, exact=False)
        ids = _encode(tokenizer, rendered, special=special)
        if limit is not None and len(ids) >= limit:
            raise PromptTooLong(len(ids), exact=True)
        return ids

    # -- tokenizers ---------------------------------------------------------------------------------

    async def _entry(self, model_id: str) -> _Entry:
        entry = self._entries.get(model_id)
        if entry is not None and model_id not in self._unservable:
            return entry
        path = self._paths.get(model_id)
        if path is None or model_id in self._unservable:
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
            template = None if model_id in self._vision else ChatTemplate.of(tokenizer)
            try:
                lengths = await self._probe(model_id, tokenizer, template)
            except TemplateExceeded as exc:
                self._mark_unservable(model_id, exc.bound)
                raise UnknownModel(model_id) from None
            bounds = await asyncio.to_thread(measure_bounds, tokenizer, per_message=_per_message(tokenizer, lengths))
        finally:
            self._loading.pop(model_id, None)
        tools = None if model_id in self._vision else ToolFormat.of(tokenizer)
        entry = self._entries[model_id] = _Entry(tokenizer, bounds, template, tools)
        if model_id in self._vision:
            entry.bulk = tokenizer  # a VLM's prompts are all counted in the lane: one processor is enough
        log.info("tokenizer_ready", model=model_id, longest_token_count=bounds.longest_token_chars,
                 per_message_tokens=bounds.per_message_tokens, outcome="bounded" if bounds.shrink else "unbounded",
                 kind=tools.name if tools is not None else "no_tool_calling")
        return entry

    async def _probe(self, model_id: str, tokenizer: Any, template: ChatTemplate | None) -> list[int | None]:
        """The start-up check: each probe's token count (None where the template refuses it).
        Raises `TemplateExceeded` for a template that passes a bound on any of them."""
        lengths: list[int | None] = []
        for messages, generation in PROBES:
            try:
                if template is None:  # a VLM's processor, or mlx-lm's own renderer: blocking, so in a thread
                    ids = await asyncio.to_thread(tokenizer.apply_chat_template, list(messages),
                                                  add_generation_prompt=generation)
                else:
                    text = await renderer(Lane.INTERACTIVE).arender(template, messages, add_generation_prompt=generation,
                                                                    timeout_s=self._timeout_s)
                    ids = _encode(tokenizer, text)
                lengths.append(len(ids))
            except TemplateExceeded:
                raise
            except RendererUnavailable:  # not the template's fault: its requests fail (500) until it starts
                log.error("template_renderer_unavailable", model=model_id)
                lengths.append(None)
            except Exception:  # an edge: a template is third-party code; no bound is claimed from it then
                lengths.append(None)
        return lengths


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


def _encode(tokenizer: Any, rendered: str, *, special: bool = False) -> list[int]:
    """The ids of a rendered prompt, as ``apply_chat_template`` makes them; ``special``: of a raw
    prompt, with the tokenizer's special tokens, and possibly none (the caller decides)."""
    try:
        ids = tokenizer.encode(rendered, add_special_tokens=special)
    except TypeError:  # text the tokenizer cannot take (a lone surrogate): a client error, as before
        raise PromptError("the rendered prompt could not be tokenized") from None
    if not ids and not special:
        raise PromptError("empty prompt")
    return list(ids)


def _tools_extra(tools: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """The template variables a request's tools add (none without tools: the render is as before)."""
    return {"tools": list(tools)} if tools else None


def _encode_in_process(tokenizer: Any, messages: Sequence[Mapping[str, object]],
                       tools: Sequence[Mapping[str, Any]] = ()) -> list[int]:
    """Render and tokenize in this process: mlx-lm's own Python renderers, and a VLM's processor
    (whose template it hands to the bounded renderer itself)."""
    try:
        extra = {"tools": list(tools)} if tools else {}  # a VLM's processor is never offered tools
        ids = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, **extra)
    except TemplateFailed:
        raise PromptError("chat template could not render the messages") from None
    except _TEMPLATE_ERRORS:
        raise PromptError("chat template could not render the messages") from None
    if not ids:
        raise PromptError("empty prompt")
    return list(ids)


def _surely_over(tokenizer: Any, rendered: str, limit: int) -> int | None:
    """Count `rendered` in pieces of about CHUNK_CHARS, split between words, and stop as soon as
    the count less the pieces' boundary slack reaches `limit`: then return that (tokens it has at
    least, >= limit), else None. Memory: one piece at a time."""
    encode = getattr(tokenizer, "encode", None)
    if encode is None:
        return None
    total = pieces = 0
    start = 0
    while start < len(rendered):
        end = min(len(rendered), start + CHUNK_CHARS)
        if end < len(rendered):
            found = _PIECE_BREAK.search(rendered, end, min(len(rendered), end + 4096))
            end = found.start() if found else end
        try:
            total += len(encode(rendered[start:end], add_special_tokens=False))
        except TypeError:  # see _encode
            raise PromptError("the rendered prompt could not be tokenized") from None
        pieces += 1
        if total - pieces * BOUNDARY_SLACK_TOKENS >= limit:
            return total - pieces * BOUNDARY_SLACK_TOKENS
        start = end
    return None


def measure_bounds(tokenizer: Any, *, per_message: int | None = None) -> TokenBounds:
    """The size bound of one tokenizer (see bounds.py): its longest token in characters, what its
    normalizer can shorten, and the template tokens each message adds at least (`per_message`, as
    the counter's start-up check measured it; None: measured here, the template bounded). Blocking."""
    if per_message is None:
        per_message = _per_message(tokenizer, [_bounded_length(tokenizer, m, g) for m, g in PROBES])
    from provider.mlxlm import unwrapped  # deferred: importing mlx-lm costs ~1 s

    backend = getattr(unwrapped(tokenizer), "backend_tokenizer", None)
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
    return TokenBounds(longest_token_chars=longest, shrink=shrink, per_message_tokens=per_message or 0)


def _bounded_length(tokenizer: Any, messages: list[dict[str, str]], generation: bool) -> int | None:
    try:
        return len(render_ids(tokenizer, messages, add_generation_prompt=generation))
    except Exception:  # an edge: see PromptCounter._probe
        return None


def _per_message(tokenizer: Any, lengths: Sequence[int | None]) -> int:
    """Template tokens one message adds at least: [u] against [u, a, u], less their content."""
    one, three = lengths[1], lengths[2]
    if one is None or three is None:
        return 0
    try:
        content = len(tokenizer.encode("x", add_special_tokens=False))
    except Exception:  # an edge: see _probe
        return 0
    return max(0, (three - one - 2 * content) // 2)


__all__ = ["INLINE_CHARS", "PromptCounter", "PromptError", "PromptTooLong", "TemplateTooCostly", "TokenizerLoader",
           "ToolsUnsupported", "UnknownModel", "measure_bounds"]
