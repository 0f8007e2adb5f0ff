"""Chat templates, rendered where a model folder's code cannot hold up the agent.

A chat template (``chat_template.jinja`` and friends) is a program that comes with the model folder:
two nested loops run for hours, one string repetition takes gigabytes, and a Python thread running it
can be neither stopped nor bounded. So templates render in a child process of their own
(`_template_child.py`: a fresh interpreter, never a fork of this one, which holds MLX and threads),
and this process only waits for the answers (`provider.models.renderer`, which says how):

* **time**: a render may take ``timeout_s`` (the ``template_timeout_s`` setting) plus an allowance
  for a long prompt, counted from when the child begins it; past that the child is killed and
  another started, and the render fails with `TemplateExceeded(TemplateBound.TIMEOUT)`;
* **memory**: the child's address space and resident memory are bounded by `MEMORY_BYTES`, and a
  rendered prompt longer than `max_rendered_chars` is refused: `TemplateExceeded(TemplateBound.MEMORY)`;
* the child's imports (~1 s) are never counted against a render, and it exits by itself when this
  process goes (its lifeline pipe closes), even in the middle of a render;
* a burst is not a queue of round trips: the requests that wait are written into the child's pipe
  at once and their answers handed back together, so 32 renders cost about what one does.

The render is transformers' own ``render_jinja_template`` — what ``apply_chat_template`` calls —
with the tokenizer's special tokens and mlx-lm's thinking switch as variables (`ChatTemplate.of`),
so the text, and the tokens this process makes from it (`encode`), are those of mlx-lm's
``tokenizer.apply_chat_template``. The interface is general: (messages, add_generation_prompt,
extra template variables such as ``tools``) -> str.

Each process has two renderers (`renderer(lane)`), started on first use: `Lane.INTERACTIVE` for short
prompts (awaited on the event loop with `arender`), the engine thread and start-up checks, and
`Lane.BULK` for the bulk lane's long prompts, so a short prompt never waits behind a long one; and
when a render has been stuck for a quarter of a second, the interactive renderer starts a second
process and sends it the requests queued behind the stuck one, so they are served while it runs out
its bound. A template error (``raise_exception``, a missing key) is `TemplateFailed`: the client's
problem, as before. Nothing raised here carries template or prompt text.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from provider.models.renderer import (
    DEFAULT_TIMEOUT_S,
    MEMORY_BYTES,
    RendererUnavailable,
    TemplateBound,
    TemplateExceeded,
    TemplateFailed,
    TemplateRenderer,
    max_rendered_chars,
    text_size,
)

INTERACTIVE_PROCESSES = 2  # one stuck render, and the others still served


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

        from provider.mlxlm import own_chat_template, thinking_switch, wrapped_tokenizer

        # A transformers tokenizer renders itself; mlx-lm's wrapper renders with the one it wraps, unless
        # it has a template of its own.
        inner = tokenizer if isinstance(tokenizer, PreTrainedTokenizerBase) else wrapped_tokenizer(tokenizer)
        if inner is not tokenizer and own_chat_template(tokenizer) is not None:
            return None
        if type(inner).apply_chat_template is not PreTrainedTokenizerBase.apply_chat_template:
            return None
        try:
            source = inner.get_chat_template()
        except ValueError:  # no template: apply_chat_template raises the same, in-process
            return None
        variables = dict(inner.special_tokens_map)
        switch = thinking_switch(tokenizer) if inner is not tokenizer else None
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


def encode(tokenizer: Any, text: str) -> list[int]:
    """The ids of a rendered prompt, as ``apply_chat_template`` makes them (no special tokens added)."""
    return list(tokenizer.encode(text, add_special_tokens=False))


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
