"""Values that cross the engine boundary: requests, events out, and what a load reports.

Events are small frozen dataclasses; consumers `match` on them. Every request's stream ends
with exactly one terminal event (`Finished` or `Failed`), except after a cancel asked for by
the consumer, which ends the stream with no further event.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvcache.bits import KvBits
from memory.activation import ActivationProfile


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS token or a stop string
    LENGTH = "length"  # max_tokens, or the context window is full


class EngineFailure(enum.StrEnum):
    """Why a request ended without finishing. Values match protocol failure codes where one exists."""

    REQUEST_EXCEEDS_CONTEXT = "request_exceeds_context"
    INVALID_REQUEST = "invalid_request"
    MODEL_NOT_LOADED = "model_not_loaded"
    MODEL_ALREADY_LOADED = "model_already_loaded"
    LOAD_FAILED = "load_failed"
    MODEL_UNLOADED = "model_unloaded"
    ENGINE_CLOSED = "engine_closed"
    INTERNAL_ERROR = "internal_error"

    @property
    def is_client_error(self) -> bool:
        return self in (EngineFailure.REQUEST_EXCEEDS_CONTEXT, EngineFailure.INVALID_REQUEST)


class Calibrated(enum.StrEnum):
    """Where a figure measured at load came from (calibration.py, on the load's budget: budget.py)."""

    MEASURED = "measured"  # timed at its full size
    EXTRAPOLATED = "extrapolated"  # from shorter timed passes (the budget had no room for the full size)
    FALLBACK = "fallback"  # the budget was spent first: the documented default
    SETTING = "setting"  # the operator's setting, nothing measured
    OFF = "off"  # not measured for this model: solo prefill off or a head that does not split; a vision model


class LoadPhase(enum.StrEnum):
    """A step of a load on the engine thread, reported as it ends (`Engine.load(on_progress=)`): a
    load that reports steps is making progress (the model manager keeps its waiters)."""

    WEIGHTS = "weights"  # a part of the weights read (one per WEIGHT_PART_BYTES)
    WEIGHTS_READ = "weights_read"  # every weight read; the generator made
    SOLO_CALIBRATED = "solo_calibrated"  # the split probe and the pass costs (calibration.py)
    WARM_SHAPE = "warm_shape"  # one shape of the warm-up served (warmup.py)
    RATES_TIMED = "rates_timed"  # register's rates (calibration.py)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request generation settings (OpenAI defaults: temperature 1, top_p 1)."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")


@dataclass(frozen=True, slots=True)
class ToolCallConstraint:
    """The output must be a tool call (`tool_choice` `required`, or a named function). The intake
    turns it into the request's grammar (`provider.request.output`: `ChatRequest.constraint`), which
    the engine enforces; the call is read from the text as for `auto`.

    `format` is mlx-lm's parser module for the model's family (``json_tools``...), written between
    `start` and `end` (`provider.models.tools.ToolFormat`); `functions` are the OpenAI function
    definitions (`{"name", "description", "parameters"}`) the call may name — one for a named choice,
    every tool for `required`; `parallel`: more than one call may follow (`parallel_tool_calls`)."""

    format: str
    start: str
    end: str
    functions: tuple[Mapping[str, object], ...]
    parallel: bool = True


@dataclass(frozen=True, slots=True)
class ChatRequest:
    """One chat completion to run. `messages` are OpenAI-style dicts for the chat template.

    For a vision model: `images` are the decoded RGB images (PIL), in the order of the messages'
    image markers, and `kv_tokens` is the KV span reserved for the request: the output is clamped
    so the processed prompt plus output never exceeds it.

    `prompt_ids`: the templated prompt already tokenized by the caller (`provider.request`'s counter,
    with the same tokenizer and template the model loads with), so the engine thread never spends a
    step on tokenizing; None: the worker renders and tokenizes `messages` itself (always for a
    vision request, whose processor places the image tokens).

    `tools`: the function tools the chat template renders with `messages` (wherever the worker renders
    them: without `prompt_ids`, and when it prepares the next turn); `tool_call`: a call the output must
    be (`ToolCallConstraint`), None when the model may answer freely."""

    request_id: str
    messages: Sequence[Mapping[str, object]]
    params: SamplingParams
    images: tuple[Any, ...] = field(default=(), repr=False)
    kv_tokens: int | None = None
    prompt_ids: Sequence[int] | None = None
    # The local front's conversations: once this finishes, prefill the prompt's next turn up to the
    # answer as the chat template renders it back, while the engine is idle (next_turn.py).
    prepare_next_turn: bool = False
    # The request's grammar (`provider.grammar.Constraint`: the engine masks each token by it
    # and releases its memory reservation when the request leaves), and its log-probabilities (None:
    # not asked; else the number of alternatives per token, 0-20).
    constraint: Any = field(default=None, repr=False)
    top_logprobs: int | None = None
    tools: tuple[Mapping[str, object], ...] = field(default=(), repr=False)
    tool_call: ToolCallConstraint | None = field(default=None, repr=False)


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One sampled token's log-probability and its best alternatives (`ChatRequest.top_logprobs` of
    them, best first), from the distribution it was sampled from: the model's, renormalized over
    what the request's grammar allows; before temperature."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class TextDelta:
    """New completion text. Never empty, never ends inside a UTF-8 character.

    `logprobs` (requests that asked): one entry per token sampled since the last delta whose text
    this one carries (an EOS token has none; a token whose text a stop string cut has none)."""

    text: str
    logprobs: tuple[TokenLogprob, ...] = field(default=(), repr=False)


@dataclass(frozen=True, slots=True)
class EngineTimes:
    """When the engine thread saw a request (`time.monotonic()`): its Submit handled, its prefill or
    batch insert started, its first token sampled. Numbers for the request's log line, which splits
    the time to first token between the front, the engine's queue, the prefill and the delivery."""

    received: float
    started: float
    first_token: float


@dataclass(frozen=True, slots=True)
class Finished:
    """Terminal: the completion ended normally.

    `completion_ids` are the sampled token ids, including a final EOS token when the model
    produced one; `usage.completion_tokens == len(completion_ids)`.
    """

    reason: FinishReason
    usage: Usage
    completion_ids: tuple[int, ...] = field(repr=False)
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache: its prefill was not all computed
    times: EngineTimes | None = field(default=None, compare=False)


@dataclass(frozen=True, slots=True)
class Failed:
    """Terminal: the request did not complete. Carries a code, never an exception string."""

    code: EngineFailure


Event = TextDelta | Finished | Failed


@dataclass(frozen=True, slots=True)
class LoadedModelInfo:
    model_id: str
    path: Path
    weights_bytes: int  # measured growth of MLX active memory while loading
    context_length: int | None  # None: the config names none, so no limit is enforced
    eos_token_ids: frozenset[int]
    vocab_size: int
    load_seconds: float
    # Prompts with at least this many tokens left to prefill are prefilled alone, their first token
    # out at once (engine/prefill.py); None: never (a vision model, or a model whose head cannot be split).
    solo_min_tokens: int | None = None
    transposed_weights: int = 0  # dense linear weights stored transposed for the CPU's BLAS (layout.py)
    cpu_attention: bool = False  # served with the vectorised CPU softmax (attention.py)
    vision: bool = False  # served through mlx-vlm: takes images
    image_text_tokens: int = 0  # vision: text tokens the processor adds around each image (measured)
    prefill_tps: float = 0.0  # timed at load (engine/calibration.py); 0: not measured
    decode_tps: float = 0.0
    # Where load_seconds went: reading the weights, the measurements at load, serving once (warmup.py).
    weights_seconds: float = 0.0
    measure_seconds: float = 0.0
    warm_seconds: float = 0.0
    # The measurements' budget (budget.py) and where each figure came from within it.
    measure_budget_seconds: float = 0.0
    solo_from: Calibrated = Calibrated.OFF
    rates_from: Calibrated = Calibrated.OFF
    warm_shapes: int = 0  # warm-up shapes served (warmup.py)
    warm_skipped: int = 0  # ... and left to the first requests (the budget was spent)
    kv_bits: KvBits | None = None  # the form its KV is kept quantized in inside the batch; None: the model's dtype
    # Its activation reserve's figures, measured over the load's timed passes (activation.py); None: not
    # measured (a vision model, no pass ran, a config without the shape).
    activation: ActivationProfile | None = None


@dataclass(frozen=True, slots=True)
class ModelStats:
    """A cheap snapshot for heartbeats, refreshed by the worker after every step."""

    num_running: int  # decoding
    num_waiting: int  # queued or in prefill
    active_tokens: int  # prompt + generated tokens of every request in the batch


class EngineError(Exception):
    """A load/unload/count call failed. `code` is safe to log and put on the wire."""

    def __init__(self, code: EngineFailure):
        super().__init__(code.value)
        self.code = code
