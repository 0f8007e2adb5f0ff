"""The engine thread's view of a loaded text model and its requests (engine thread only)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import jinja2
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import make_prompt_cache

from kvcache.bits import KvBits
from kvcache.manager import ModelKvCache
from kvcache.quantized import make_quantized_cache
from provider.engine import guided
from provider.engine.commands import EventSink, ReleaseHook
from provider.engine.lifecycle import RequestEvent, RequestLifecycle, RequestState
from provider.engine.prefill import PREFILL_STEP, SoloPrefill, SplitHead
from provider.engine.textstream import CompletionText
from provider.engine.types import EngineError, EngineFailure, Event, LoadedModelInfo, ModelStats, TokenLogprob
from provider.mlxlm import waiting
from provider.models.template import RendererUnavailable, TemplateExceeded, render_ids

_TEMPLATE_ERRORS = (jinja2.TemplateError, TypeError, ValueError, KeyError, TemplateExceeded, RendererUnavailable)

# model id -> that model's prefix cache (kvcache.KvCacheManager.get), or None when reuse is off.
PrefixCacheLookup = Callable[[str], ModelKvCache | None]


@dataclass(slots=True, eq=False)
class Active:
    """One request of a model. Its phase is `state` (lifecycle.py); its Slot holds it where its phase
    has it wait or run: queued, prefilled alone (`solo`), `ready` to join the batch, or in it (`uid`)."""

    request_id: str
    sink: EventSink
    on_released: ReleaseHook | None
    text: CompletionText
    prompt_tokens: int
    max_tokens: int
    sampler: object
    uid: int | None = None  # its BatchGenerator uid once inserted
    completion_ids: list[int] = field(default_factory=list)
    prompt_ids: list[int] = field(default_factory=list)  # with completion_ids: the key its KV is kept under
    reused_key: tuple[int, ...] | None = None  # the cached sequence its prompt reused, if any
    reused: int = 0  # prompt tokens that came from the prefix cache
    solo: SoloPrefill | None = None  # its prompt's own prefill, while it runs
    cache: list | None = None  # ready: its prompt's KV, until it joins the batch
    messages: Sequence[Mapping[str, object]] | None = None  # kept only to prepare the next turn
    answer: list[str] | None = None  # the text sent, kept only to prepare the next turn
    text_sent: bool = False  # its first text is out (later text may be held: delivery.py)
    # Its grammar and log-probabilities in the batch (guided.py), None for a plain request; the
    # log-probabilities of tokens whose text has not gone out yet.
    guide: guided.RowGuide | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    tools: Sequence[Mapping[str, object]] = ()  # rendered with the messages (kept only to prepare the next turn)
    # time.monotonic() of its Submit, of its prefill or insert, of its first token (types.EngineTimes)
    received: float = field(default_factory=time.monotonic)
    started: float = 0.0
    first_token: float = 0.0
    lifecycle: RequestLifecycle = field(init=False)

    def __post_init__(self) -> None:
        self.lifecycle = RequestLifecycle(self.request_id)

    @property
    def state(self) -> RequestState:
        return self.lifecycle.state

    def step(self, event: RequestEvent) -> RequestState:
        """Its lifecycle's step (lifecycle.py): the only way its phase changes."""
        return self.lifecycle.step(event)

    def solo_step(self) -> tuple[int, int | None, TokenLogprob | None]:
        """One chunk of the prompt prefilled alone: the tokens it took, and after the last chunk the first
        token (sampled, or through its grammar's first mask with its log-probabilities)."""
        done, logprobs = self.solo.step()
        if logprobs is None:
            return done, None, None
        if self.guide is None:
            return done, int(self.sampler(logprobs).item()), None
        token, record = guided.first_token(self.guide, self.sampler, logprobs)
        return done, token, record


@dataclass(slots=True)
class Keep:
    """A finished request's cache waiting to be stored; its `Finished` event waits for the store, so
    whoever sees a request finish sees its sequence in the prefix cache."""

    model_id: str
    active: Active
    cache: list
    finished: tuple[EventSink, Event] | None = None


@dataclass(slots=True)
class Slot:
    """One loaded model, its batch, and the requests not in it yet."""

    info: LoadedModelInfo
    model: object
    tokenizer: object
    generator: BatchGenerator
    split: SplitHead | None = None  # None: no solo prefill for this model (prefill.split_head)
    solo_min_tokens: int = PREFILL_STEP
    requests: dict[int, Active] = field(default_factory=dict)  # in the batch, by BatchGenerator uid
    queue: deque[Active] = field(default_factory=deque)  # admitted, not started (first come first)
    solo: Active | None = None  # the prompt being prefilled alone
    ready: list[Active] = field(default_factory=list)  # first token out, waiting to join the batch
    held_tokens: int = 0  # prompt tokens prefilled alone since the batch last stepped
    joining: bool = False  # the generator's last insert was ready requests joining (see `unmerged`)
    kv_bits: KvBits | None = None  # the form its sequences' KV is kept quantized in (kvcache/quantized.py)

    def new_cache(self) -> list:
        """A fresh prompt cache for one of its sequences."""
        if self.kv_bits is None:
            return make_prompt_cache(self.model)
        return make_quantized_cache(self.model, self.kv_bits)

    def actives(self) -> list[Active]:
        return [*self.queue, *([self.solo] if self.solo is not None else []), *self.ready,
                *self.requests.values()]

    def busy(self) -> bool:
        return bool(self.requests or self.queue or self.ready or self.solo is not None)

    def model_stats(self) -> ModelStats:
        actives = self.actives()
        running = sum(1 for a in actives if a.state is RequestState.DECODING)
        tokens = sum(a.prompt_tokens + len(a.completion_ids) for a in actives)
        return ModelStats(running, len(actives) - running, tokens)

    def render(self, messages: Sequence[Mapping[str, object]], tools: Sequence[Mapping[str, object]] = (), *,
               add_generation_prompt: bool = True) -> list[int]:
        """The templated prompt's token ids; `EngineError(INVALID_REQUEST)` for a template that fails
        or renders nothing. The template runs in the bounded renderer (provider/models/template.py),
        never on this thread: its own errors (TemplateFailed is a ValueError) and its bounds both refuse."""
        try:
            ids = render_ids(self.tokenizer, messages, add_generation_prompt=add_generation_prompt, tools=tools)
        except _TEMPLATE_ERRORS:
            raise EngineError(EngineFailure.INVALID_REQUEST) from None
        if not ids:
            raise EngineError(EngineFailure.INVALID_REQUEST)
        return list(ids)

    def kv_bytes(self) -> int:
        """KV held by the batch and by the prompts prefilled alone that wait to join it."""
        waiting = [a.solo.cache if a.solo is not None else a.cache for a in (self.solo, *self.ready) if a is not None]
        return self.generator.prompt_cache_nbytes + sum(c.nbytes for cache in waiting if cache for c in cache)


def unmerged(generator: BatchGenerator) -> bool:
    """Inserted sequences the generator has not yet taken into a batch (`provider.mlxlm.waiting`). It
    merges them in insertion order with the first one's cache type, so ready requests
    (`prefill.for_batch`: block-rounded buffers) are never inserted beside requests inserted as they
    are, or the merged batch would lose the block rounding the ledger counts on."""
    return bool(waiting(generator))


__all__ = ["Active", "Keep", "PrefixCacheLookup", "Slot", "unmerged"]
