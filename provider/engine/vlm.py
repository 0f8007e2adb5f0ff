"""mlx-vlm glue: load a vision-language model, render its prompt, and run one request in steps.

Imported only when a model is a VLM (mlx-vlm is the optional `vision` extra). Everything that
touches MLX runs on the engine's worker thread, like the text path.

`VisionRun` is mlx-vlm's `generate_step` (mlx_vlm/generate/ar.py, 0.7.x) cut into steps the worker
can interleave with the text batch, so text requests keep streaming while an image is encoded:

    PREPARE  the model's chat template (mlx-vlm's `apply_chat_template`, the template itself
             rendered in the bounded renderer of provider/models/template.py: `BoundedTemplates`)
             and processor (`prepare_inputs`: tokens with the image soft tokens expanded, pixel values)
    ENCODE   `model.get_input_embeddings`: the vision tower and the projector; the rasters and the
             pixel tensor are dropped afterwards (the `media` reservation can go)
    PREFILL  the language model over the prompt embeddings, `prefill_step` tokens per step, then
             the last prompt token gives the first sampled token
    DECODE   one token per step

The arithmetic is mlx-vlm's own (same calls, same kwargs hand-over, same sampling on
log-probabilities), so a greedy run equals `mlx_vlm.generate` with the same `prefill_step_size`
(tests/test_engine_vision.py checks it). Not used: speculative drafts, KV quantization, mlx-vlm's
prompt caches.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from provider.engine.types import EngineError, EngineFailure
from provider.models.template import (
    DEFAULT_TIMEOUT_S,
    ChatTemplate,
    Lane,
    RendererUnavailable,
    TemplateExceeded,
    TemplateFailed,
    renderer,
)

DEFAULT_PREFILL_STEP = 256  # prompt tokens per prefill step (mlx-vlm's one-shot default is 2048)


@dataclass(slots=True)
class LoadedVlm:
    model: Any  # mlx_vlm model (language_model, vision tower, projector)
    processor: Any  # the model's processor (tokenizer + image processor)
    tokenizer: Any  # mlx-lm TokenizerWrapper over the same tokenizer files (detokenizer, eos ids)
    config: dict[str, Any]


def load_vlm(path: Path, eos_token_ids: frozenset[int] | None) -> LoadedVlm:
    """mlx-vlm's own loader (weights evaluated here), plus an mlx-lm tokenizer wrapper for the
    streaming detokenizer the text path uses."""
    from mlx_lm.utils import load_tokenizer
    from mlx_vlm.utils import load, load_config

    model, processor = load(str(path), lazy=True)
    mx.eval(model.parameters())
    config = load_config(path)
    eos = eos_token_ids
    if eos is None:
        raw = config.get("eos_token_id")
        eos = frozenset(raw if isinstance(raw, list) else [raw] if isinstance(raw, int) else [])
    tokenizer = load_tokenizer(path, eos_token_ids=sorted(eos) or None)
    if eos_token_ids is not None:
        tokenizer.eos_token_ids = set(eos_token_ids)
    return LoadedVlm(model, processor, tokenizer, config)


def template_messages(messages: Sequence[Mapping[str, object]]) -> tuple[list[dict[str, Any]], int]:
    """Chat messages as mlx-vlm's template helper reads them, and how many images they name.
    Image markers (`{"type": "image_url"}`, from provider/request/body) keep their place."""
    out: list[dict[str, Any]] = []
    images = 0
    for message in messages:
        content = message.get("content")
        if isinstance(content, (list, tuple)):
            parts = [dict(p) for p in content if isinstance(p, Mapping)]
            images += sum(1 for p in parts if p.get("type") == "image_url")
            out.append({"role": message.get("role", "user"), "content": parts})
        else:
            out.append({"role": message.get("role", "user"), "content": content or ""})
    return out, images


class BoundedTemplates:
    """A processor (or its tokenizer) as mlx-vlm's template helper sees it, whose
    ``apply_chat_template(..., tokenize=False)`` renders the template in the bounded renderer
    (transformers' own steps around it: the processor's template and its tokenizer's special
    tokens, OpenAI image blocks as image blocks). Every other attribute is the real object's."""

    def __init__(self, target: Any, lane: Lane, timeout_s: float) -> None:
        self._target, self._lane, self._timeout_s = target, lane, timeout_s

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._target, name)
        if name == "tokenizer" and value is not None:  # mlx-vlm renders with it when the processor has no template
            return BoundedTemplates(value, self._lane, self._timeout_s)
        return value

    def apply_chat_template(self, conversation: Any, chat_template: str | None = None, tools: Any = None,
                            add_generation_prompt: bool = False, tokenize: bool = False, **kwargs: Any) -> Any:
        try:
            template = None if tokenize or chat_template is not None else self._template()
        except AttributeError:  # mlx-vlm would take it for "no template" and render a plain prompt instead
            raise TemplateFailed("the chat template could not be read") from None
        if template is None:  # not how mlx-vlm builds a prompt: the real method
            return self._target.apply_chat_template(conversation, chat_template=chat_template, tools=tools,
                                                    add_generation_prompt=add_generation_prompt,
                                                    tokenize=tokenize, **kwargs)
        extra = {**kwargs, **({"tools": tools} if tools is not None else {})}
        return renderer(self._lane).render(template, _image_blocks(conversation),
                                           add_generation_prompt=add_generation_prompt, extra=extra,
                                           timeout_s=self._timeout_s)

    def _template(self) -> ChatTemplate | None:
        if hasattr(self._target, "image_processor") or hasattr(self._target, "_resolve_chat_template"):
            return ChatTemplate.of_processor(self._target)
        return ChatTemplate.of(self._target)


def _image_blocks(conversation: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI ``image_url`` blocks as transformers' processors hand them to the template."""
    out = []
    for message in conversation:
        message = dict(message)
        content = message.get("content")
        if isinstance(content, list):
            message["content"] = [
                {"type": "image", "url": (p["image_url"].get("url", "") if isinstance(p["image_url"], dict)
                                          else p["image_url"])}
                if isinstance(p, dict) and p.get("type") == "image_url" and "image_url" in p else p
                for p in content]
        out.append(message)
    return out


def render_prompt(processor: Any, config: Any, messages: Sequence[Mapping[str, object]], *,
                  lane: Lane = Lane.INTERACTIVE, timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[str, int]:
    """The prompt text mlx-vlm would build for these messages (image markers in place), and the
    number of images it expects. The template is bounded (blocking: not on the event loop);
    raises `TemplateFailed`, `TemplateExceeded`, `RendererUnavailable` from the renderer."""
    from mlx_vlm.prompt_utils import apply_chat_template

    msgs, images = template_messages(messages)
    return apply_chat_template(BoundedTemplates(processor, lane, timeout_s), config, msgs, num_images=images), images


def add_special_tokens(model_type: str, processor: Any) -> bool:
    from mlx_vlm.utils import should_add_special_tokens

    return should_add_special_tokens(model_type, processor)


def prompt_text_ids(processor: Any, config: Mapping[str, Any], messages: Sequence[Mapping[str, object]], *,
                    lane: Lane = Lane.INTERACTIVE, timeout_s: float = DEFAULT_TIMEOUT_S) -> list[int]:
    """The prompt's text tokens: the rendered template with one marker per image, before the
    processor expands each marker into the image's soft tokens (the policy adds those)."""
    prompt, _ = render_prompt(processor, config, messages, lane=lane, timeout_s=timeout_s)
    tokenizer = getattr(processor, "tokenizer", processor)
    return list(tokenizer.encode(prompt, add_special_tokens=add_special_tokens(str(config.get("model_type", "")),
                                                                               processor)))


def image_text_tokens(vlm: LoadedVlm) -> int:
    """Text tokens the processor puts around each image, beyond the image's marker in the template
    and its soft tokens (Gemma 3: blank lines and the begin/end-of-image tokens). Measured once at
    load with an 8×8 image; admission counts them as prompt text."""
    from mlx_vlm.utils import prepare_inputs
    from PIL import Image

    messages = [{"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "image_url"}]}]
    text = prompt_text_ids(vlm.processor, vlm.config, messages)
    prompt, _ = render_prompt(vlm.processor, vlm.config, messages)
    image_token = getattr(vlm.model.config, "image_token_index", None)
    inputs = prepare_inputs(vlm.processor, images=[Image.new("RGB", (8, 8))], prompts=prompt,
                            image_token_index=image_token,
                            add_special_tokens=add_special_tokens(str(vlm.config.get("model_type", "")), vlm.processor))
    ids = inputs["input_ids"][0].tolist()
    soft = ids.count(image_token) if image_token is not None else 0
    return max(0, len(ids) - len(text) - soft)


def kv_bytes_per_token(model: Any) -> int:
    """Bytes per token the language model's own caches allocate (see the text path's
    `Worker._kv_bytes_per_token`): one token into a fresh cache, growing layers' bytes / 256."""
    from mlx_vlm.models import cache

    from provider.models.kv import ALLOC_STEP

    caches = cache.make_prompt_cache(model.language_model)
    out = model.language_model(mx.array([[0]]), cache=caches)
    mx.eval(out.logits, [c.state for c in caches if not c.empty()])
    growing = (cache.KVCache, cache.RotatingKVCache, cache.QuantizedKVCache)
    nbytes = sum(c.nbytes for c in caches if isinstance(c, growing))
    return nbytes // ALLOC_STEP


class Phase(enum.Enum):
    PREPARE = "prepare"
    ENCODE = "encode"
    PREFILL = "prefill"
    DECODE = "decode"
    DONE = "done"


Sampler = Callable[[mx.array], mx.array]


class VisionRun:
    """One request on a VLM, advanced by `step()` (see the module docstring)."""

    def __init__(self, vlm: LoadedVlm, messages: Sequence[Mapping[str, object]], images: Sequence[Any], *,
                 sampler: Sampler, prefill_step: int = DEFAULT_PREFILL_STEP) -> None:
        self._vlm = vlm
        self._messages = messages
        self._images: list[Any] | None = list(images)
        self._sampler = sampler
        self._prefill_step = max(1, prefill_step)
        self.phase = Phase.PREPARE
        self.prompt_ids: list[int] = []
        self._input_ids: mx.array | None = None
        self._pixel_values: mx.array | None = None
        self._mask: mx.array | None = None
        self._embeds: mx.array | None = None
        self._kwargs: dict[str, Any] = {}
        self._chunked = True
        self._cache: list[Any] | None = None
        self._y: mx.array | None = None

    @property
    def media_held(self) -> bool:
        """Rasters or the pixel tensor are still referenced (before ENCODE has run)."""
        return self._images is not None or self._pixel_values is not None

    @property
    def cache(self) -> list[Any] | None:
        return self._cache

    def step(self) -> int | None:
        """Advance one step; returns the token sampled by it, if any."""
        match self.phase:
            case Phase.PREPARE:
                self._prepare()
            case Phase.ENCODE:
                self._encode()
            case Phase.PREFILL:
                return self._prefill()
            case Phase.DECODE:
                return self._decode()
        return None

    def close(self) -> None:
        """Drop every array this run holds (its KV cache included)."""
        self.phase = Phase.DONE
        self._images = None
        self._input_ids = self._pixel_values = self._mask = self._embeds = self._y = None
        self._kwargs = {}
        self._cache = None

    # -- phases ------------------------------------------------------------------------------

    def _prepare(self) -> None:
        from mlx_vlm.utils import prepare_inputs

        vlm = self._vlm
        try:
            prompt, expected = render_prompt(vlm.processor, vlm.model.config, self._messages)
        except (TypeError, ValueError, KeyError, TemplateExceeded, RendererUnavailable):  # TemplateFailed is a ValueError
            raise EngineError(EngineFailure.INVALID_REQUEST) from None
        if expected != len(self._images or ()):
            raise EngineError(EngineFailure.INVALID_REQUEST)
        inputs = prepare_inputs(
            vlm.processor, images=self._images or None, prompts=prompt,
            image_token_index=getattr(vlm.model.config, "image_token_index", None),
            add_special_tokens=add_special_tokens(vlm.config.get("model_type", ""), vlm.processor))
        self._images = None  # the processor has its pixel values; the rasters can go
        self._input_ids = inputs["input_ids"]
        self._pixel_values = inputs.get("pixel_values")
        self._mask = inputs.get("attention_mask")
        self._kwargs = {k: v for k, v in inputs.items() if k not in ("input_ids", "pixel_values", "attention_mask")}
        self.prompt_ids = self._input_ids[0].tolist()
        self.phase = Phase.ENCODE

    def _encode(self) -> None:
        from mlx_vlm.generate.common import _chunked_prefill_enabled
        from mlx_vlm.models import cache

        model = self._vlm.model
        out = model.get_input_embeddings(self._input_ids, self._pixel_values, mask=self._mask, **self._kwargs)
        self._embeds = out.inputs_embeds
        self._kwargs.update({k: v for k, v in out.to_dict().items() if k != "inputs_embeds" and v is not None})
        mx.eval(self._embeds)
        self._pixel_values = self._mask = None
        self._cache = cache.make_prompt_cache(model.language_model)
        self._chunked = _chunked_prefill_enabled(model, input_ids=self._input_ids, inputs_embeds=self._embeds,
                                                 prompt_cache=self._cache, prefill_kwargs=self._kwargs)
        self.phase = Phase.PREFILL

    def _prefill(self) -> int | None:
        assert self._embeds is not None and self._input_ids is not None
        if self._chunked and self._embeds.shape[1] > 1:
            n = min(self._prefill_step, self._embeds.shape[1] - 1)
            self._vlm.model.language_model(
                inputs=self._input_ids[:, :n], inputs_embeds=self._embeds[:, :n], cache=self._cache,
                n_to_process=n, logits_to_keep=1, **self._kwargs)
            mx.eval([c.state for c in self._cache])
            self._embeds = self._embeds[:, n:]
            self._input_ids = self._input_ids[:, n:]
            return None
        ids = self._input_ids[:, -1:] if self._chunked else self._input_ids
        self._y = self._sample(ids, self._embeds)
        self._embeds = self._input_ids = None
        self.phase = Phase.DECODE
        return self._y.item()

    def _decode(self) -> int:
        assert self._y is not None
        self._y = self._sample(self._y[None], None)
        return self._y.item()

    def _sample(self, ids: mx.array, embeds: mx.array | None) -> mx.array:
        outputs = self._vlm.model.language_model(ids, inputs_embeds=embeds, cache=self._cache, logits_to_keep=1,
                                                 **self._kwargs)
        logits = outputs.logits[:, -1, :]
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        y = self._sampler(logprobs)
        # mlx-vlm hands these to later steps; every other prompt kwarg was for the prompt only.
        if outputs.cross_attention_states is not None:
            self._kwargs = {"cross_attention_states": outputs.cross_attention_states}
        elif outputs.encoder_outputs is not None:
            self._kwargs = {"encoder_outputs": outputs.encoder_outputs}
        else:
            self._kwargs = {}
        mx.eval(y)
        return y
