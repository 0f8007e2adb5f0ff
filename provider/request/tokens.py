"""Prompt token counts for fast admission, before the model is loaded.

Admission needs the prompt length before ``inference_accepted`` goes out, and the accept must not wait
for a model load (protocol.md §7.2). ``Engine.count_prompt_tokens`` needs the model loaded and shares
the MLX worker thread with loads, so it cannot be used here. Decision: each model's tokenizer is loaded
with mlx-lm's own loader (``mlx_lm.utils.load_tokenizer``, the loader ``mlx_lm.load`` uses, so the chat
template and special tokens are the engine's) on a worker thread, once, and cached; counting renders
the chat template and tokenizes on a worker thread too. The agent warms every advertised model's
tokenizer at startup (``warm``), so a request only ever pays the count itself (well under a
millisecond for ordinary prompts). A tokenizer still cold at request time is loaded then, once.

The count is exact — the same ``apply_chat_template(..., add_generation_prompt=True)`` the engine runs —
so admission neither over-reserves KV nor refuses a prompt that fits.

Vision models (``vision=`` ids): the count is the prompt *text* as mlx-vlm renders it, one marker per
image (``provider.engine.vlm.prompt_text_ids``, what the engine renders too); the image soft tokens are
the policy's to add (``memory.media.vision_span``). For a text model, image markers count as nothing
(admission refuses the images with 415 before anything is served).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2

from provider.telemetry import get_logger

log = get_logger("provider.request.tokens")

TokenizerLoader = Callable[[Path], Any]
_TEMPLATE_ERRORS = (jinja2.TemplateError, TypeError, ValueError, KeyError)


class PromptError(ValueError):
    """The messages cannot be rendered by the model's chat template (a client error)."""


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
    __slots__ = ("lock", "tokenizer")

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.lock = threading.Lock()  # HF fast tokenizers are not safe for concurrent calls


class PromptCounter:
    """Exact prompt lengths per model, counted off the event loop."""

    def __init__(self, paths: Mapping[str, Path], *, loader: TokenizerLoader = _mlx_lm_loader,
                 vision: Collection[str] = (), vision_loader: TokenizerLoader = VisionPromptTokenizer) -> None:
        self._paths = dict(paths)
        self._loader = loader
        self._vision = frozenset(vision)
        self._vision_loader = vision_loader
        self._entries: dict[str, _Entry] = {}
        self._loading: dict[str, asyncio.Future[_Entry]] = {}

    def knows(self, model_id: str) -> bool:
        """Whether ``model_id`` is one of ours (a consumer-chosen string otherwise: not for logs)."""
        return model_id in self._paths

    async def warm(self, model_ids: Iterable[str]) -> None:
        """Load these models' tokenizers now (startup), one after the other on a worker thread."""
        for model_id in model_ids:
            try:
                await self._entry(model_id)
            except (UnknownModel, OSError, ValueError):
                log.warning("tokenizer_unavailable", model=model_id)

    async def count(self, model_id: str, messages: Sequence[Mapping[str, object]]) -> int:
        """Tokens of the templated prompt. Raises ``PromptError`` or ``UnknownModel``."""
        entry = await self._entry(model_id)
        msgs = list(messages) if model_id in self._vision else _text_only(messages)
        return await asyncio.to_thread(_count, entry, msgs)

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
            loader = self._vision_loader if model_id in self._vision else self._loader
            tokenizer = await asyncio.to_thread(loader, path)
        finally:
            self._loading.pop(model_id, None)
        entry = self._entries[model_id] = _Entry(tokenizer)
        return entry


def _count(entry: _Entry, messages: list[Mapping[str, object]]) -> int:
    with entry.lock:
        try:
            ids = entry.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except _TEMPLATE_ERRORS:
            raise PromptError("chat template could not render the messages") from None
    if not ids:
        raise PromptError("empty prompt")
    return len(ids)


__all__ = ["PromptCounter", "PromptError", "TokenizerLoader", "UnknownModel"]
