"""A loaded vision-language model on the worker thread: its requests, stepped between text steps.

Each request is a `vlm.VisionRun` with its own KV cache (mlx-vlm runs one sequence per cache).
The worker calls, once per loop, after the text batch's step:

* `step_decoding()` — one decode step for every run that is past its prompt (they share the
  worker like members of a batch);
* `step_pretoken()` — one PREPARE / ENCODE / PREFILL step of the oldest run still before its first
  token, only when the worker's `DutyCycle` allows it while text requests are decoding, so a
  long image prefill costs running text streams at most `VISION_SHARE` of the worker's time.

Releases, each exactly once and only once the memory is really dropped (`VisionRun.close`, or the
rasters and pixel tensor after ENCODE): `on_media_released(request_id)` when the run no longer
holds media (after ENCODE, or on any earlier end), then `on_released(request_id)` (its KV) when the
run ends — finished, cancelled, failed or unloaded.

Output: the same events as the text path — `TextDelta`s through the model's streaming detokenizer
and stop strings, then `Finished` with exact usage (prompt tokens = the processed prompt, image
soft tokens included) — or `Failed(code)`. The output bound is the request's `max_tokens`, clamped
so the prompt plus output stays within the context window and within the KV span reserved for the
request (`ChatRequest.kv_tokens`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from provider.engine.commands import EventSink, ReleaseHook, Submit
from provider.engine.sampling import sampler_for
from provider.engine.textstream import CompletionText
from provider.engine.types import (
    EngineError,
    EngineFailure,
    Event,
    Failed,
    Finished,
    FinishReason,
    LoadedModelInfo,
    ModelStats,
    TextDelta,
    Usage,
)
from provider.engine.vlm import DEFAULT_PREFILL_STEP, LoadedVlm, Phase, VisionRun, kv_bytes_per_token, prompt_text_ids
from provider.telemetry import get_logger

log = get_logger("provider.engine")

# Of the worker's time, what image prefill may take while text decodes: text keeps ≥ 87.5 % of its
# rate (benchmarks/vision_bench.py asks for ≥ 80 %; the rest is margin for cache effects between the
# two models).
VISION_SHARE = 1 / 8
Emit = Callable[[EventSink, Event], None]
Trace = Callable[[str, str | None, str], None]  # (model id, request id or None for the text batch, phase)


class DutyCycle:
    """Time credit for pre-token vision work while text requests are decoding.

    Each text step earns `seconds × share / (1 − share)`; a vision step may start while the credit
    is positive and spends its own duration. So over time vision work takes at most `share` of the
    worker, whatever the length of one step. The credit is capped and the worker resets it whenever
    no text request is running or no vision work is waiting, so it never piles up into a burst.
    """

    def __init__(self, share: float = VISION_SHARE, max_credit_s: float = 0.05) -> None:
        if not 0 < share < 1:
            raise ValueError("share must be in (0, 1)")
        self._ratio = share / (1 - share)
        self._max = max_credit_s
        self._credit = 0.0

    def text_ran(self, seconds: float) -> None:
        self._credit = min(self._max, self._credit + seconds * self._ratio)

    def may_run(self) -> bool:
        return self._credit > 0

    def vision_ran(self, seconds: float) -> None:
        self._credit -= seconds

    def reset(self) -> None:
        self._credit = 0.0


def step_vision_slots(visions: Iterable[VisionSlot], duty: DutyCycle, *, text_running: bool) -> list[VisionSlot]:
    """One loop's vision work: every running request past its prompt decodes a token; the oldest one
    before its first token gets a step within the duty cycle while text runs. Returns the slots stepped."""
    visions = list(visions)
    if not any(v.has_pretoken for v in visions):
        duty.reset()  # credit is earned only while vision work waits: no burst when it arrives
    stepped = []
    for vision in visions:
        if not vision.runs:
            continue
        vision.step_decoding()
        if vision.has_pretoken and (not text_running or duty.may_run()):
            started = time.perf_counter()
            vision.step_pretoken()
            duty.vision_ran(time.perf_counter() - started)
        stepped.append(vision)
    return stepped


@dataclass(slots=True)
class _Active:
    request_id: str
    run: VisionRun
    sink: EventSink
    on_released: ReleaseHook | None
    on_media_released: ReleaseHook | None
    text: CompletionText
    max_tokens: int
    kv_tokens: int | None
    context_length: int | None
    room: int = 0  # output tokens allowed, known once the prompt is prepared
    completion_ids: list[int] = field(default_factory=list)


class VisionSlot:
    """One loaded VLM and its runs (by request id, in arrival order)."""

    def __init__(self, info: LoadedModelInfo, vlm: LoadedVlm, *, emit: Emit, notify: Callable[[ReleaseHook | None, str], None],
                 prefill_step: int = DEFAULT_PREFILL_STEP, trace: Trace | None = None) -> None:
        self.info = info
        self.vlm = vlm
        self._emit = emit
        self._notify = notify
        self._prefill_step = prefill_step
        self._trace = trace
        self.runs: dict[str, _Active] = {}

    # -- requests ----------------------------------------------------------------------------

    def submit(self, cmd: Submit) -> None:
        request = cmd.request
        run = VisionRun(self.vlm, request.messages, request.images, sampler=sampler_for(request.params),
                        prefill_step=self._prefill_step)
        text = CompletionText(self.vlm.tokenizer.detokenizer, request.params.stop)
        self.runs[request.request_id] = _Active(
            request.request_id, run, cmd.sink, cmd.on_released, cmd.on_media_released, text,
            request.params.max_tokens, request.kv_tokens, self.info.context_length)

    def cancel(self, request_id: str) -> bool:
        active = self.runs.get(request_id)
        if active is None:
            return False
        self._retire(active)
        return True

    def fail_all(self, code: EngineFailure) -> None:
        for active in list(self.runs.values()):
            self._emit(active.sink, Failed(code))
            self._retire(active)

    @property
    def has_pretoken(self) -> bool:
        return any(a.run.phase not in (Phase.DECODE, Phase.DONE) for a in self.runs.values())

    def stats(self) -> ModelStats:
        running = sum(1 for a in self.runs.values() if a.run.phase is Phase.DECODE)
        tokens = sum(len(a.run.prompt_ids) + len(a.completion_ids) for a in self.runs.values())
        return ModelStats(running, len(self.runs) - running, tokens)

    def count_prompt(self, messages) -> int:
        """Prompt text tokens (one marker per image; the policy adds the soft tokens)."""
        try:
            return len(prompt_text_ids(self.vlm.processor, self.vlm.config, messages))
        except (TypeError, ValueError, KeyError):
            raise EngineError(EngineFailure.INVALID_REQUEST) from None

    def kv_bytes_per_token(self) -> int:
        if self.runs:
            raise EngineError(EngineFailure.INVALID_REQUEST)  # a load-time check, never beside requests
        return kv_bytes_per_token(self.vlm.model)

    def cache_nbytes(self) -> int:
        return sum(c.nbytes for a in self.runs.values() for c in (a.run.cache or ()))

    # -- stepping ----------------------------------------------------------------------------

    def step_decoding(self) -> None:
        for active in [a for a in self.runs.values() if a.run.phase is Phase.DECODE]:
            self._advance(active)

    def step_pretoken(self) -> bool:
        """One step of the oldest run still before its first token; False if there is none."""
        for active in self.runs.values():
            if active.run.phase not in (Phase.DECODE, Phase.DONE):
                self._advance(active)
                return True
        return False

    def _advance(self, active: _Active) -> None:
        run = active.run
        phase = run.phase
        if self._trace is not None:
            self._trace(self.info.model_id, active.request_id, phase.value)
        try:
            token = run.step()
            if phase is Phase.PREPARE:
                active.room = self._room(active)
        except EngineError as exc:
            self._fail(active, exc.code)
            return
        except Exception:  # an edge: fail this request, keep the worker and the other runs alive
            log.exception("vision_step_failed", model=self.info.model_id, phase=phase)
            self._fail(active, EngineFailure.INTERNAL_ERROR)
            return
        if phase is Phase.ENCODE and not run.media_held:
            self._release_media(active)
        if token is not None:
            self._on_token(active, token)

    def _room(self, active: _Active) -> int:
        prompt = len(active.run.prompt_ids)
        room = active.max_tokens
        if active.context_length is not None:
            room = min(room, active.context_length - prompt)
            if room < 1:
                raise EngineError(EngineFailure.REQUEST_EXCEEDS_CONTEXT)
        if active.kv_tokens is not None:
            room = min(room, active.kv_tokens - prompt)
            if room < 1:  # the projection fell short of the real prompt: never grow past the reservation
                log.warning("vision_span_short", model=self.info.model_id, prompt_tokens=prompt,
                            kv_tokens=active.kv_tokens)
                raise EngineError(EngineFailure.INTERNAL_ERROR)
        return room

    def _on_token(self, active: _Active, token: int) -> None:
        active.completion_ids.append(token)
        if token in self.vlm.tokenizer.eos_token_ids:
            self._emit_text(active, active.text.finish().text)
            self._finish(active, FinishReason.STOP)
            return
        out = active.text.add(token)
        if out.stopped:
            self._emit_text(active, out.text)
            self._finish(active, FinishReason.STOP)
        elif len(active.completion_ids) >= active.room:
            tail = active.text.finish()
            self._emit_text(active, out.text + tail.text)
            self._finish(active, FinishReason.STOP if tail.stopped else FinishReason.LENGTH)
        else:
            self._emit_text(active, out.text)

    def _emit_text(self, active: _Active, text: str) -> None:
        if text:
            self._emit(active.sink, TextDelta(text))

    def _finish(self, active: _Active, reason: FinishReason) -> None:
        usage = Usage(len(active.run.prompt_ids), len(active.completion_ids))
        self._emit(active.sink, Finished(reason, usage, tuple(active.completion_ids)))
        self._retire(active)

    def _fail(self, active: _Active, code: EngineFailure) -> None:
        self._emit(active.sink, Failed(code))
        self._retire(active)

    def _release_media(self, active: _Active) -> None:
        hook, active.on_media_released = active.on_media_released, None
        self._notify(hook, active.request_id)

    def _retire(self, active: _Active) -> None:
        """Forget a run: drop its arrays, then give back its media (if still held) and its KV."""
        self.runs.pop(active.request_id, None)
        active.run.close()
        self._release_media(active)
        hook, active.on_released = active.on_released, None
        self._notify(hook, active.request_id)

