"""The MLX worker: the only code that touches MLX, run on one dedicated thread.

Theory of operation. `Worker.run` blocks on the command queue while no request is active.
While requests are active it drains whatever commands are queued without blocking, advances
every model that has work by one step (a chunk of a prompt prefilled alone, or one
`BatchGenerator.next()` call: one decode step plus at most one prefill chunk; round-robin across
models), then hands the step's events to the asyncio loop in
one `call_soon_threadsafe` per loop. So a command (a cancel, a new request) waits for at most
one step, and requests join and leave the running batch between any two steps. Between steps, and
when the prefix cache has a conversation turn due on its SSD tier while idle (the blocking wait
then ends at that time), it writes the turns that went quiet (`kvcache.ModelKvCache.write_quiet`).

Solo prefill (`prefill.py`). A prompt whose part still to prefill (after the prefix cache) is at
least the model's `solo_min_tokens` (measured at load) is prefilled by itself, a chunk per loop,
and its first token, sampled from that same pass, goes out at once; it then waits in `ready` and
joins the batch with that token as its input. While such prompts wait, the batch does not step
(its requests' next tokens wait) until `prefill.PREFILL_STEP` prompt tokens have been prefilled
alone since its last step, the most mlx-lm itself prefills between two decode steps: a burst is
prefilled one prompt at a time, each first token out as soon as its prompt is, and then decodes
as one batch. When its first token is out, a prompt whose KV a queued request shares (a burst on
one cold system prompt) is stored in the prefix cache, so the queued one reuses it. Prompts with
less left to prefill go to the `BatchGenerator` as they are (its own batched prefill); the two
kinds are never inserted into it between the same two steps (`_unmerged`).

Next turn. A local conversation's follow-up repeats the finished prompt and the answer, but as
the chat template renders the answer text back, which often is not the tokens the model generated
(a template that drops thinking blocks or trims whitespace, a tokenizer that splits the text
differently, a detokenizer that drops the answer's leading space), so the cached sequence matches
only up to the first token that differs. For requests marked `prepare_next_turn` (the local front's),
once the engine has been idle for `NEXT_TURN_QUIET_S` (a client that sends its next request at
once, a benchmark, an agent loop, never meets a preparation) it renders the conversation with the answer appended, reuses the longest
cached prefix of those tokens and prefills the rest (at most `NEXT_TURN_MAX_TOKENS`) in
`NEXT_TURN_CHUNK`-token steps, then stores the result in the prefix cache: the next turn then
prefills only the new user message. KV is only ever computed for exactly the tokens it is stored
under. Any command is handled between two of these steps; a new request drops the preparation
first. Its scratch (a copy of the prefix plus the new tokens) stands in for a step's activations,
which do not exist while the engine is idle, so it is bounded by half the activation reserve
(`next_turn_scratch_bytes`); the stored entry is reserved in the ledger like any other.

Delivery. A step's events go to the asyncio loop in one call per loop. With `stream_interval_s`
set, while more than `STREAM_INTERVAL_MIN_REQUESTS` requests run, the text a request generates after
its first text is held and handed over at most once per interval, a request's held text as one
`TextDelta` (several tokens): on a GPU a step takes a few ms, and the event loop's work per delivered
event (a wake-up, an SSE chunk, a write) competes with the engine thread for the GIL. First tokens,
terminal events (after the request's held text) and every event of a smaller batch go out at once.

Vision-language models (`vision.VisionSlot`, loaded with mlx-vlm) are stepped in the same loop,
after the text batches: every vision request past its prompt decodes one token per loop; the
oldest one still before its first token (template + processor, vision encoder, prefill chunks)
gets one step per loop, within a time share (`vision.DutyCycle`) while text requests decode, so
text keeps streaming while an image is encoded.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import queue
import time
from collections import defaultdict, deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import jinja2
import mlx.core as mx
import mlx_lm
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache, make_prompt_cache

from kvcache import state
from kvcache.manager import MISS, REUSE_MIN_TOKENS, ModelKvCache, Reuse
from memory.mlx_limits import MlxLimits
from memory.settle import clear_buffer_cache, reclaim
from provider.engine.commands import (
    Cancel,
    Command,
    CountPromptTokens,
    EventSink,
    KvBytesPerToken,
    KvCacheBytes,
    MemoryReading,
    Load,
    Reclaim,
    ReleaseHook,
    Stop,
    Submit,
    Unload,
)
from provider.engine import attention, guided
from provider.engine.calibration import Calibration, calibrate
from provider.engine.decode import DEFAULT_PREFILL_TOKENS, EngineBatchGenerator
from provider.engine.device import DeviceLimits
from provider.engine.layout import MAX_WEIGHT_BYTES, on_cpu, transpose_weights
from provider.engine.prefill import (
    PREFILL_STEP,
    SoloPrefill,
    SplitHead,
    for_batch,
    pass_costs,
    solo_threshold,
    split_head,
)
from provider.engine.sampling import sampler_for
from provider.engine.textstream import CompletionText
from provider.engine.vision import DutyCycle, Trace, VisionSlot
from provider.engine.vlm import DEFAULT_PREFILL_STEP
from provider.engine.types import (
    EngineError,
    EngineFailure,
    EngineTimes,
    Event,
    Failed,
    Finished,
    FinishReason,
    LoadedModelInfo,
    ModelStats,
    TextDelta,
    TokenLogprob,
    Usage,
)
from provider.models.kv import ALLOC_STEP
from provider.models.metadata import context_length
from provider.models.template import RendererUnavailable, TemplateExceeded, render_ids

log = logging.getLogger("provider.engine")

# A template renders in the bounded renderer (provider/models/template.py), never on this thread:
# its own errors (TemplateFailed is a ValueError) and its bounds both refuse the request.
_TEMPLATE_ERRORS = (jinja2.TemplateError, TypeError, ValueError, KeyError, TemplateExceeded, RendererUnavailable)
# Caches that grow with the sequence (recurrent state has a constant size and is not per token).
_GROWING_CACHES = (KVCache, RotatingKVCache, QuantizedKVCache)

# model id -> that model's prefix cache (kvcache.KvCacheManager.get), or None when reuse is off.
PrefixCacheLookup = Callable[[str], ModelKvCache | None]


@dataclass(slots=True, eq=False)
class _Active:
    """One request of a model: queued, prefilled alone (`solo`), `ready` to join, or in the batch (`uid`)."""

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
    text_sent: bool = False  # its first text is out (later text may be held: "Delivery")
    # Issue 31: its grammar and log-probabilities in the batch (guided.py), None for a plain request;
    # the log-probabilities of tokens whose text has not gone out yet.
    guide: guided.RowGuide | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    tools: Sequence[Mapping[str, object]] = ()  # rendered with the messages (kept only to prepare the next turn)
    # time.monotonic() of its Submit, of its prefill or insert, of its first token (types.EngineTimes)
    received: float = field(default_factory=time.monotonic)
    started: float = 0.0
    first_token: float = 0.0


@dataclass(slots=True)
class _NextTurn:
    """A finished conversation whose next prompt is being prepared (see "Next turn")."""

    model_id: str
    messages: Sequence[Mapping[str, object]]
    answer: str
    tools: Sequence[Mapping[str, object]] = ()  # the request's function tools, rendered as it was
    ids: list[int] = field(default_factory=list)  # the conversation with the answer rendered back
    cache: list | None = None  # the KV of ids[:done]
    done: int = 0
    extends: tuple[int, ...] | None = None  # the stored sequence it started from
    reused: int = 0  # how many of its tokens it starts from
    due: float = 0.0  # time.monotonic() after which it may start


@dataclass(slots=True)
class _Keep:
    """A finished request's cache waiting to be stored; its `Finished` event waits for the store, so
    whoever sees a request finish sees its sequence in the prefix cache."""

    model_id: str
    active: _Active
    cache: list
    finished: tuple[EventSink, Event] | None = None


@dataclass(slots=True)
class _Slot:
    """One loaded model, its batch, and the requests not in it yet."""

    info: LoadedModelInfo
    model: object
    tokenizer: object
    generator: BatchGenerator
    split: SplitHead | None = None  # None: no solo prefill for this model (prefill.split_head)
    solo_min_tokens: int = PREFILL_STEP
    requests: dict[int, _Active] = field(default_factory=dict)  # in the batch, by BatchGenerator uid
    queue: deque[_Active] = field(default_factory=deque)  # admitted, not started (first come first)
    solo: _Active | None = None  # the prompt being prefilled alone
    ready: list[_Active] = field(default_factory=list)  # first token out, waiting to join the batch
    held_tokens: int = 0  # prompt tokens prefilled alone since the batch last stepped
    joining: bool = False  # the generator's last insert was ready requests joining (see _unmerged)

    def actives(self) -> list[_Active]:
        return [*self.queue, *([self.solo] if self.solo is not None else []), *self.ready,
                *self.requests.values()]

    def busy(self) -> bool:
        return bool(self.requests or self.queue or self.ready or self.solo is not None)


DEFAULT_BATCH_SIZE = 32  # mlx-lm's own BatchGenerator default (completion_batch_size)
NEXT_TURN_CHUNK = 64  # tokens per idle step of a next-turn preparation: what a new request may wait for
NEXT_TURN_QUIET_S = 0.25  # idle this long after an answer before preparing: a person takes longer to reply
NEXT_TURN_MAX_TOKENS = 1024  # tokens to prefill past the cached prefix; more is not a re-rendered answer
SHARE_MIN_TOKENS = 32  # a queued prompt sharing at least this many more tokens gets the prompt stored
GPU_PREFILL_TOKENS = 8192  # a GPU's pass: a burst of short prompts at once, half what mlx-lm's 8 x 2048 may take
STREAM_INTERVAL_MIN_REQUESTS = 8  # text is held for `stream_interval_s` only while more requests than this run


def _new_generator(model, eos_token_ids: frozenset[int], batch_size: int, prefill_tokens: int) -> BatchGenerator:
    # completion_batch_size is how many sequences decode at once; admission never admits more
    # concurrent requests per model than this, so no admitted request waits without tokens.
    return EngineBatchGenerator(model, stop_tokens=[[t] for t in sorted(eos_token_ids)] or None,
                                completion_batch_size=batch_size, prefill_batch_size=batch_size,
                                prefill_tokens=prefill_tokens)


def prefill_tokens_for_device(setting: int | None) -> int:
    """A prefill pass's token budget (decode.py, "Prefill waves"): the setting, else by device."""
    if setting is not None:
        return setting
    return DEFAULT_PREFILL_TOKENS if on_cpu() else GPU_PREFILL_TOKENS


class Worker:
    def __init__(self, commands: queue.SimpleQueue[Command], *, prefix_cache: PrefixCacheLookup | None = None,
                 vision_prefill_step: int = DEFAULT_PREFILL_STEP, trace: Trace | None = None,
                 batch_size: int = DEFAULT_BATCH_SIZE, limits: MlxLimits | None = None,
                 next_turn_scratch_bytes: int = 0, solo_min_tokens: int | None = None,
                 weight_layout: bool | None = None, cpu_attention: bool | None = None,
                 stream_interval_s: float = 0.0, prefill_tokens: int | None = None):
        self._commands = commands
        self._prefill_tokens = prefill_tokens  # None: by device, when the first model loads
        self._stream_interval = stream_interval_s  # see "Delivery"
        self._held: dict[int, tuple[EventSink, TextDelta]] = {}  # id(sink) -> its text not yet handed over
        self._released_at = 0.0
        self._weight_layout = weight_layout  # None: on the CPU device (layout.py)
        self._cpu_attention = cpu_attention  # None: on the CPU device (attention.py)
        self._solo_min_tokens = solo_min_tokens  # None: measured per model at load (prefill.py)
        self._next_turn_scratch = next_turn_scratch_bytes  # 0: never prepare a next turn
        self._next_turns: dict[str, _NextTurn] = {}  # by model: its latest finished conversation
        self._prefix_cache = prefix_cache
        self._vision_prefill_step = vision_prefill_step
        self._trace = trace
        self._duty = DutyCycle()
        self.batch_size = batch_size
        self._device = DeviceLimits(limits)  # MLX's memory/cache limits, and the wired limit (device.py)
        self._slots: dict[str, _Slot] = {}
        self._vision: dict[str, VisionSlot] = {}
        self._where: dict[str, tuple[_Slot, _Active]] = {}  # request_id -> (slot, request)
        self._outbox: list[tuple[EventSink, Event]] = []
        self._kept: list[_Keep] = []  # finished sequences to store once the step's tokens are out
        self._stopped = False
        # Read by other threads; only ever replaced item by item (atomic under the GIL).
        self.stats: dict[str, ModelStats] = {}

    # -- main loop -------------------------------------------------------------------------

    def serve(self) -> None:
        """The engine thread: `run` under MLX's memory settings, put back as found when it ends."""
        self._device.start()
        if _on_cpu_unless(self._cpu_attention):
            attention.enable()  # this thread's attention calls only (attention.py)
        try:
            self.run()
        finally:
            attention.disable()
            self._device.stop()

    def run(self) -> None:
        while not self._stopped:
            if self._where or self._vision_busy():
                self._drain_commands()
                self._step_all()
                self._step_vision()
                self._flush_outbox()  # every token of the step goes out before the stores below
                self._store_kept()
                self._flush_outbox()
                self._write_quiet()
                continue
            wait = self._write_quiet()
            if self._next_turns:  # wake when the next-turn preparation is due (at once while it runs)
                due = max(0.0, next(reversed(self._next_turns.values())).due - time.monotonic())
                wait = due if wait is None else min(wait, due)
            try:  # idle: wake for the next command, or when a cached turn is due on SSD
                command = self._commands.get(timeout=wait)
            except queue.Empty:
                if self._next_turns and next(reversed(self._next_turns.values())).due <= time.monotonic():
                    self._prepare_next_turn()
                continue
            self._handle(command)
            self._flush_outbox()

    def _drain_commands(self) -> None:
        """Handle every queued command. Consecutive cancels are removed from their batches in one
        `remove` per model: after a mass disconnect, one filter of the batch KV instead of one per
        request (each copies the whole batch), so the ledger hears of every release within a step."""
        cancels: list[str] = []
        while not self._stopped:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, Cancel):
                cancels.append(command.request_id)
                continue
            if cancels:
                self._cancel_many(cancels)
                cancels = []
            self._handle(command)
        if cancels:
            self._cancel_many(cancels)

    def _handle(self, command: Command) -> None:
        if isinstance(command, (Submit, Load, Unload, Stop)):
            self._next_turns.clear()  # a request (or a load) never waits behind a guess; its scratch goes
        match command:
            case Submit():
                self._submit(command)
            case Cancel(request_id):
                self._cancel(request_id)
            case CountPromptTokens(model_id, messages, reply):
                self._reply(reply, lambda: self._count_prompt(model_id, messages))
            case KvCacheBytes(model_id, reply):
                self._reply(reply, lambda: self._kv_cache_bytes(model_id))
            case MemoryReading(reply):
                self._reply(reply, self._memory_reading)
            case KvBytesPerToken(model_id, reply):
                self._reply(reply, lambda: self._kv_bytes_per_token(model_id))
            case Load():
                self._reply(command.reply, lambda: self._load(command))
            case Unload(model_id, reply):
                self._reply(reply, lambda: self._unload(model_id))
            case Reclaim(reply, collect):
                self._reply(reply, reclaim if collect else clear_buffer_cache)
            case Stop(reply):
                self._reply(reply, self._stop)

    @staticmethod
    def _reply(reply: Future, fn) -> None:
        if not reply.set_running_or_notify_cancel():
            return
        try:
            reply.set_result(fn())
        except EngineError as exc:
            reply.set_exception(exc)
        except Exception:  # an edge: report a fixed code, keep the worker alive
            log.exception("engine command failed")
            reply.set_exception(EngineError(EngineFailure.INTERNAL_ERROR))

    def _slot(self, model_id: str) -> _Slot:
        slot = self._slots.get(model_id)
        if slot is None:
            raise EngineError(EngineFailure.MODEL_NOT_LOADED)
        return slot

    def _count_prompt(self, model_id: str, messages: Sequence[Mapping[str, object]]) -> int:
        vision = self._vision.get(model_id)
        if vision is not None:
            return vision.count_prompt(messages)
        return len(self._prompt_ids(self._slot(model_id), messages))

    def _memory_reading(self) -> tuple[int, int]:
        """(MLX active bytes, Σ KV held by every model's batch), between two steps: consistent."""
        kv = sum(self._kv_cache_bytes(model_id) for model_id in [*self._slots, *self._vision])
        return mx.get_active_memory(), kv

    def _kv_cache_bytes(self, model_id: str) -> int:
        vision = self._vision.get(model_id)
        if vision is not None:
            return vision.cache_nbytes()
        slot = self._slot(model_id)
        waiting = [a.solo.cache if a.solo is not None else a.cache for a in (slot.solo, *slot.ready) if a is not None]
        return slot.generator.prompt_cache_nbytes + sum(c.nbytes for cache in waiting if cache for c in cache)

    # -- load / unload -----------------------------------------------------------------------

    def _load(self, cmd: Load) -> LoadedModelInfo:
        if cmd.model_id in self._slots or cmd.model_id in self._vision:
            raise EngineError(EngineFailure.MODEL_ALREADY_LOADED)
        if cmd.vision:
            return self._load_vision(cmd)
        before = mx.get_active_memory()
        started = time.monotonic()
        try:
            model, tokenizer, config = mlx_lm.load(str(cmd.path), lazy=True, return_config=True)
            mx.eval(model.parameters())
            # One weight's copy at a time, within the load's estimate (on-disk bytes x 1.2).
            bound = min(MAX_WEIGHT_BYTES, (mx.get_active_memory() - before) // 10)
            transposed = transpose_weights(model, max_bytes=bound) if _on_cpu_unless(self._weight_layout) else 0
            ctx = context_length(config)
        except Exception:  # an edge: any broken model folder must not kill the worker
            log.exception("model load failed", extra={"model_id": cmd.model_id})
            gc.collect()
            mx.clear_cache()
            raise EngineError(EngineFailure.LOAD_FAILED) from None
        if cmd.eos_token_ids is not None:
            tokenizer.eos_token_ids = set(cmd.eos_token_ids)
        eos = frozenset(tokenizer.eos_token_ids)
        info = LoadedModelInfo(
            model_id=cmd.model_id,
            path=cmd.path,
            weights_bytes=mx.get_active_memory() - before,
            context_length=ctx,
            eos_token_ids=eos,
            vocab_size=int(config.get("vocab_size") or len(tokenizer)),
            load_seconds=time.monotonic() - started,
            transposed_weights=transposed,
            cpu_attention=attention.enabled(),
        )
        slot = _Slot(info, model, tokenizer, self._generator(model, eos))
        self._calibrate(slot)
        rates = self._timed_rates(slot)
        slot.info = info = dataclasses.replace(
            info, solo_min_tokens=slot.solo_min_tokens if slot.split is not None else None,
            prefill_tps=rates.prefill_tps, decode_tps=rates.decode_tps)
        self._slots[cmd.model_id] = slot
        self.stats[cmd.model_id] = ModelStats(0, 0, 0)
        return info

    def _calibrate(self, slot: _Slot) -> None:
        """Whether and from how many tokens a prompt is prefilled alone (module docstring, prefill.py)."""
        if self._solo_min_tokens == 0:
            return  # solo prefill off
        try:
            with mx.stream(slot.generator.stream):
                slot.split = split_head(slot.model)
                if slot.split is None:
                    return
                if self._solo_min_tokens is not None:
                    slot.solo_min_tokens = self._solo_min_tokens
                    return
                costs = pass_costs(slot.model)
                slot.solo_min_tokens = solo_threshold(costs)
        except Exception:  # an edge: without the measurement the model is served as mlx-lm serves it
            log.exception("prefill calibration failed", extra={"model_id": slot.info.model_id})
            slot.split = None
            return
        finally:
            clear_buffer_cache()

    def _timed_rates(self, slot: _Slot) -> Calibration:
        """register's prefill_tps / decode_tps: a short timed pass (calibration.py)."""
        try:
            with mx.stream(slot.generator.stream):
                return calibrate(slot.model, slot.split)
        except Exception:  # an edge: without the pass the rates stay unreported (0)
            log.exception("rate calibration failed", extra={"model_id": slot.info.model_id})
            return Calibration(0.0, 0.0)
        finally:
            clear_buffer_cache()

    def _load_vision(self, cmd: Load) -> LoadedModelInfo:
        from provider.engine.vlm import image_text_tokens, load_vlm  # mlx-vlm: only when a model is a VLM

        before = mx.get_active_memory()
        started = time.monotonic()
        try:
            vlm = load_vlm(cmd.path, cmd.eos_token_ids)
            ctx = context_length(vlm.config)
            wrapper = image_text_tokens(vlm)
        except Exception:  # an edge: a broken folder (or no mlx-vlm) must not kill the worker
            log.exception("vision model load failed", extra={"model_id": cmd.model_id})
            gc.collect()
            mx.clear_cache()
            raise EngineError(EngineFailure.LOAD_FAILED) from None
        text = vlm.config.get("text_config") if isinstance(vlm.config.get("text_config"), dict) else {}
        info = LoadedModelInfo(
            model_id=cmd.model_id, path=cmd.path, weights_bytes=mx.get_active_memory() - before,
            context_length=ctx, eos_token_ids=frozenset(vlm.tokenizer.eos_token_ids),
            vocab_size=int(text.get("vocab_size") or vlm.config.get("vocab_size") or len(vlm.tokenizer)),
            load_seconds=time.monotonic() - started, vision=True, image_text_tokens=wrapper,
            cpu_attention=attention.enabled())
        self._vision[cmd.model_id] = VisionSlot(info, vlm, emit=self._emit, notify=self._notify_released,
                                                prefill_step=self._vision_prefill_step, trace=self._trace)
        self._device.wire()  # a vision model is resident too (its steps are ours: nothing else wires)
        self.stats[cmd.model_id] = ModelStats(0, 0, 0)
        return info

    def _generator(self, model, eos_token_ids: frozenset[int]) -> BatchGenerator:
        """A model's generator, under the engine's wired limit: wired before (so the generator records
        it as the value its `close()` restores) and again after (it has just wired its own)."""
        self._device.wire()
        try:
            generator = _new_generator(model, eos_token_ids, self.batch_size,
                                       prefill_tokens_for_device(self._prefill_tokens))
        except BaseException:
            self._unwire_if_empty()
            raise
        self._device.wire()
        return generator

    def _unwire_if_empty(self) -> None:
        if not self._slots and not self._vision:
            self._device.unwire()  # no model resident: the wired limit found before the first one

    def _kv_bytes_per_token(self, model_id: str) -> int:
        """Bytes per token the model's own caches allocate: one token into a fresh prompt cache makes
        every growing layer allocate its first ALLOC_STEP-token block; that block's bytes / ALLOC_STEP."""
        vision = self._vision.get(model_id)
        if vision is not None:
            return vision.kv_bytes_per_token()
        slot = self._slot(model_id)
        if slot.busy():
            raise EngineError(EngineFailure.INVALID_REQUEST)  # a load-time check, never beside a batch
        cache = make_prompt_cache(slot.model)
        logits = slot.model(mx.array([[0]]), cache=cache)
        mx.eval(logits, [c.state for c in cache if not c.empty()])
        nbytes = sum(c.nbytes for c in cache if isinstance(c, _GROWING_CACHES))
        del cache, logits
        return nbytes // ALLOC_STEP

    def _unload(self, model_id: str) -> None:
        vision = self._vision.pop(model_id, None)
        if vision is not None:
            vision.fail_all(EngineFailure.MODEL_UNLOADED)
            self.stats.pop(model_id, None)
            vision.vlm = None
            del vision
            self._unwire_if_empty()
            reclaim()  # the dropped weights: gc, MLX's cache, glibc's heap
            return
        slot = self._slot(model_id)
        self._fail_all(slot, EngineFailure.MODEL_UNLOADED)
        slot.generator.close()
        del self._slots[model_id]
        self.stats.pop(model_id, None)
        slot.model = slot.tokenizer = slot.generator = None
        del slot
        self._unwire_if_empty()
        reclaim()  # the dropped weights: gc, MLX's cache, glibc's heap

    def _stop(self) -> None:
        for model_id in list(self._vision):
            self._vision[model_id].fail_all(EngineFailure.ENGINE_CLOSED)
            self._unload(model_id)
        for model_id in list(self._slots):
            slot = self._slots[model_id]
            self._fail_all(slot, EngineFailure.ENGINE_CLOSED)
            self._unload(model_id)
        self._stopped = True

    # -- requests ----------------------------------------------------------------------------

    def _prompt_ids(self, slot: _Slot, messages: Sequence[Mapping[str, object]],
                    tools: Sequence[Mapping[str, object]] = ()) -> list[int]:
        try:
            ids = render_ids(slot.tokenizer, messages, add_generation_prompt=True, tools=tools)
        except _TEMPLATE_ERRORS:
            raise EngineError(EngineFailure.INVALID_REQUEST) from None
        if not ids:
            raise EngineError(EngineFailure.INVALID_REQUEST)
        return list(ids)

    def _submit(self, cmd: Submit) -> None:
        request = cmd.request
        vision = self._vision.get(cmd.model_id)
        guided_request = request.constraint is not None or request.top_logprobs is not None  # issue 31
        if vision is not None and not self._known(request.request_id) and not guided_request:
            vision.submit(cmd)
            return
        try:
            if vision is not None or self._known(request.request_id):  # mlx-vlm's loop takes no guide
                raise EngineError(EngineFailure.INVALID_REQUEST)
            if request.images:  # a text model cannot take images
                raise EngineError(EngineFailure.INVALID_REQUEST)
            slot = self._slot(cmd.model_id)
            ids = list(request.prompt_ids) if request.prompt_ids else self._prompt_ids(slot, request.messages,
                                                                                       request.tools)
            ctx = slot.info.context_length
            room = request.params.max_tokens if ctx is None else ctx - len(ids)
            if room < 1:
                raise EngineError(EngineFailure.REQUEST_EXCEEDS_CONTEXT)
        except EngineError as exc:
            self._emit(cmd.sink, Failed(exc.code))
            if request.constraint is not None:
                request.constraint.release()  # issue 31
            self._notify_released(cmd.on_media_released, request.request_id)
            self._notify_released(cmd.on_released, request.request_id)
            return
        text = CompletionText(slot.tokenizer.detokenizer, request.params.stop)
        prepare = request.prepare_next_turn and self._next_turn_scratch > 0 and self._prefix_cache is not None
        active = _Active(request.request_id, cmd.sink, cmd.on_released, text, len(ids),
                         max_tokens=min(request.params.max_tokens, room), sampler=sampler_for(request.params),
                         prompt_ids=ids, messages=request.messages if prepare else None,
                         answer=[] if prepare else None, tools=request.tools if prepare else (),
                         guide=guided.guide_for(request.constraint, request.top_logprobs))
        slot.queue.append(active)  # started by _advance: its prefix is looked up then (a burst shares it)
        self._where[request.request_id] = (slot, active)

    def _start(self, slot: _Slot, active: _Active) -> bool:
        """Take a queued request: alone when enough of its prompt is left to prefill, else into the
        batch; False when it must wait (it stays first in the queue)."""
        ids = active.prompt_ids
        solo = slot.split is not None and len(ids) - self._cached_tokens(slot, ids) >= slot.solo_min_tokens
        if not solo and slot.joining and _unmerged(slot.generator):
            return False  # see _unmerged
        reuse = self._reuse(slot.info.model_id, ids)
        active.reused_key, active.reused = reuse.key, reuse.matched
        rest = reuse.rest(ids)
        if solo and rest:
            cache = reuse.cache if reuse.cache is not None else make_prompt_cache(slot.model)
            active.solo = SoloPrefill(slot.model, slot.split, cache, rest, chunk=PREFILL_STEP)
            slot.solo = active
            active.started = time.monotonic()
            return True
        slot.joining = False
        try:
            (active.uid,) = slot.generator.insert(
                [rest],
                max_tokens=[active.max_tokens],
                caches=None if reuse.cache is None else [reuse.cache],
                all_tokens=None if reuse.cache is None else [ids[: reuse.matched]],
                samplers=[active.sampler],
                logits_processors=None if active.guide is None else [[active.guide]],  # issue 31
            )
        except Exception:  # an edge: this request fails, the batch goes on
            log.exception("batch insert failed", extra={"model_id": slot.info.model_id})
            self._emit(active.sink, Failed(EngineFailure.INTERNAL_ERROR))
            self._retire(slot, active)
            return True
        slot.requests[active.uid] = active
        active.started = time.monotonic()
        return True

    def _cached_tokens(self, slot: _Slot, ids: list[int]) -> int:
        kv = self._kv(slot.info.model_id)
        if kv is None:
            return 0
        try:
            matched = kv.longest_match(ids)
        except Exception:  # an edge: see _reuse
            log.exception("prefix cache lookup failed")
            return 0
        return matched if matched >= min(REUSE_MIN_TOKENS, len(ids) - 1) else 0  # what `_reuse` would take

    # -- prefix cache (kvcache/) -------------------------------------------------------------

    def _kv(self, model_id: str) -> ModelKvCache | None:
        """The model's prefix cache, or None (no prefix cache, or none for this model)."""
        return self._prefix_cache(model_id) if self._prefix_cache is not None else None

    def _reuse(self, model_id: str, ids: list[int]) -> Reuse:
        """The longest cached prefix of the prompt (a private copy), or MISS."""
        kv = self._kv(model_id)
        if kv is None:
            return MISS
        try:
            return kv.fetch(ids, min_tokens=REUSE_MIN_TOKENS)
        except Exception:  # an edge: the cache is an optimisation, never a reason to fail
            log.exception("prefix cache fetch failed")
            return MISS

    def _keep_prefix(self, slot: _Slot, active: _Active, cache: list | None) -> None:
        """Keep the finished request's whole sequence (prompt + completion) for the next turn.

        mlx-lm's `BatchGenerator` feeds every token it returns through the model in the same step
        (and `extract` drops the batch's left padding), so the returned cache holds exactly
        prompt + completion, EOS included; `store` keeps it under as many of those tokens as the
        cache holds, so KV is only ever kept under the tokens it was made from."""
        if self._prefix_cache is not None and cache:
            self._kept.append(_Keep(slot.info.model_id, active, cache))

    def _store_kept(self) -> None:
        kept, self._kept = self._kept, []
        for keep in kept:
            kv = self._kv(keep.model_id)
            try:
                if kv is not None:
                    kv.store(keep.active.prompt_ids + keep.active.completion_ids, keep.cache,
                             extends=keep.active.reused_key, reused=keep.active.reused)
            except Exception:  # an edge: see _reuse
                log.exception("prefix cache store failed")
            if keep.finished is not None:
                self._emit(*keep.finished)

    def _prepare_next_turn(self) -> None:
        """One idle step of the newest next-turn preparation (see "Next turn")."""
        model_id = next(reversed(self._next_turns))
        turn = self._next_turns[model_id]
        slot = self._slots.get(model_id)
        kv = self._kv(model_id)
        try:
            if slot is None or kv is None or (turn.cache is None and not self._start_next_turn(slot, kv, turn)):
                del self._next_turns[model_id]
                return
            if self._trace is not None:
                self._trace(model_id, None, "next_turn")
            chunk = turn.ids[turn.done: turn.done + NEXT_TURN_CHUNK]
            slot.model(mx.array([chunk]), cache=turn.cache)
            mx.eval([c.state for c in turn.cache])
            turn.done += len(chunk)
            if turn.done == len(turn.ids):
                del self._next_turns[model_id]
                outcome = kv.store(turn.ids, turn.cache, extends=turn.extends, reused=turn.reused)
                if self._trace is not None:
                    self._trace(model_id, None, f"next_turn_{outcome.value}")
        except Exception:  # an edge: the preparation is an optimisation, never a reason to fail
            log.exception("next turn preparation failed")
            self._next_turns.pop(model_id, None)

    def _start_next_turn(self, slot: _Slot, kv: ModelKvCache, turn: _NextTurn) -> bool:
        """Render the conversation with the answer, and take a copy of its longest cached prefix."""
        messages = [*turn.messages, {"role": "assistant", "content": turn.answer}]
        try:
            ids = render_ids(slot.tokenizer, messages, add_generation_prompt=False, tools=turn.tools)
        except _TEMPLATE_ERRORS:
            return False
        ctx = slot.info.context_length
        if len(ids) < 2 or (ctx is not None and len(ids) >= ctx):
            return False
        matched = kv.longest_match(ids)
        if matched < 1 or matched >= len(ids) - 1 or len(ids) - matched > NEXT_TURN_MAX_TOKENS:
            # Nothing of it cached (a guess from scratch), all of it (the answer renders back as
            # generated: the next turn reuses it as it is), or too much for a re-rendered answer.
            return False
        reuse = kv.fetch(ids, count=False)
        if reuse.cache is None:
            return False
        per_token = state.cache_nbytes(reuse.cache) // reuse.matched
        if per_token * (len(ids) + KVCache.step) > self._next_turn_scratch:
            return False  # the copy is dropped on return
        turn.ids, turn.cache, turn.done, turn.extends = ids, reuse.cache, reuse.matched, reuse.key
        turn.reused = reuse.matched
        return True

    def _write_quiet(self) -> float | None:
        """Let each model's prefix cache write its quiet turns to SSD; seconds until the next is due."""
        if self._prefix_cache is None:
            return None
        waits = []
        for slot in self._slots.values():
            kv = self._kv(slot.info.model_id)
            if kv is None:
                continue
            in_use = {a.reused_key for a in slot.actives() if a.reused_key is not None}
            try:
                wait = kv.write_quiet(in_use)
            except Exception:  # an edge: see _reuse
                log.exception("prefix cache write failed")
                continue
            if wait is not None:
                waits.append(max(wait, 0.0))
        return min(waits, default=None)

    def _known(self, request_id: str) -> bool:
        return request_id in self._where or any(request_id in v.runs for v in self._vision.values())

    def _cancel(self, request_id: str) -> None:
        self._cancel_many([request_id])

    def _cancel_many(self, request_ids: Sequence[str]) -> None:
        # Unknown ids are normal: the request may have finished in the previous step.
        by_slot: dict[str, tuple[_Slot, list[_Active]]] = {}
        for request_id in dict.fromkeys(request_ids):
            found = self._where.get(request_id)
            if found is not None:
                slot, active = found
                by_slot.setdefault(slot.info.model_id, (slot, []))[1].append(active)
                continue
            for vision in self._vision.values():
                if vision.cancel(request_id):
                    self.stats[vision.info.model_id] = vision.stats()
                    break
        for slot, actives in by_slot.values():
            uids = [a.uid for a in actives if a.uid is not None]
            if uids:
                slot.generator.remove(uids)
            for active in actives:
                self._retire(slot, active)

    def _fail_all(self, slot: _Slot, code: EngineFailure) -> None:
        actives = slot.actives()
        uids = [a.uid for a in actives if a.uid is not None]
        if uids:
            slot.generator.remove(uids)
        for active in actives:
            self._emit(active.sink, Failed(code))
            self._retire(slot, active)

    def _retire(self, slot: _Slot, active: _Active) -> None:
        """Forget a request, wherever it is (its cache has left the batch), and tell the ledger."""
        if active.uid is not None:
            slot.requests.pop(active.uid, None)
        elif slot.solo is active:
            slot.solo = None
        elif active in slot.ready:
            slot.ready.remove(active)
        elif active in slot.queue:
            slot.queue.remove(active)
        active.solo = active.cache = None
        if active.guide is not None and active.guide.constraint is not None:
            active.guide.constraint.release()  # issue 31: its grammar's reservation (memory/grammar.py)
        del self._where[active.request_id]
        self._publish_stats(slot)  # a cancel leaves no later step to refresh them
        self._notify_released(active.on_released, active.request_id)

    @staticmethod
    def _notify_released(hook: ReleaseHook | None, request_id: str) -> None:
        if hook is None:
            return
        try:
            hook(request_id)
        except Exception:  # an edge: a broken hook must not kill the worker
            log.exception("on_released hook failed")

    # -- stepping ----------------------------------------------------------------------------

    def _step_all(self) -> None:
        started = time.perf_counter()
        stepped = False
        for slot in list(self._slots.values()):
            if slot.busy():
                self._advance(slot)
                stepped = True
        if stepped:
            self._duty.text_ran(time.perf_counter() - started)
        else:
            self._duty.reset()  # no text is decoding: vision work runs freely

    def _vision_busy(self) -> bool:
        return any(v.runs for v in self._vision.values())

    def _step_vision(self) -> None:
        text_running = bool(self._where)
        if not any(v.has_pretoken for v in self._vision.values()):
            self._duty.reset()  # credit is earned only while vision work waits: no burst when it arrives
        for vision in list(self._vision.values()):
            if not vision.runs:
                continue
            vision.step_decoding()
            if vision.has_pretoken and (not text_running or self._duty.may_run()):
                started = time.perf_counter()
                vision.step_pretoken()
                self._duty.vision_ran(time.perf_counter() - started)
            self.stats[vision.info.model_id] = vision.stats()

    def _advance(self, slot: _Slot) -> None:
        """One step of a model: a chunk of the prompt being prefilled alone while the batch may wait
        for it (module docstring, "Solo prefill"), else the ready requests join and the batch steps."""
        while slot.queue and slot.solo is None:
            active = slot.queue.popleft()
            if not self._start(slot, active):
                slot.queue.appendleft(active)
                break
        if slot.solo is not None and (slot.held_tokens < PREFILL_STEP or not (slot.requests or slot.ready)):
            if self._trace is not None:
                self._trace(slot.info.model_id, slot.solo.request_id, "solo")
            self._step_solo(slot, slot.solo)
            self._publish_stats(slot)
            return
        self._join_ready(slot)
        slot.held_tokens = 0
        if slot.requests:
            if self._trace is not None:
                self._trace(slot.info.model_id, None, "batch")
            self._step(slot)

    def _step_solo(self, slot: _Slot, active: _Active) -> None:
        try:
            with mx.stream(slot.generator.stream):
                done, logprobs = active.solo.step()
                record = None
                if logprobs is None:
                    token = None
                elif active.guide is None:
                    token = int(active.sampler(logprobs).item())
                else:  # issue 31: its grammar's first mask, its log-probabilities
                    token, record = guided.first_token(active.guide, active.sampler, logprobs)
        except Exception:  # an edge: this request fails, the others go on
            log.exception("prefill failed", extra={"model_id": slot.info.model_id})
            self._emit(active.sink, Failed(EngineFailure.INTERNAL_ERROR))
            self._retire(slot, active)
            return
        slot.held_tokens += done
        if token is None:
            return
        cache, active.solo, slot.solo = active.solo.cache, None, None
        # The batch's rules for a token (GenerationBatch.next): max_tokens, then a stop token wins.
        finish = "length" if active.max_tokens <= 1 else None
        if token in slot.info.eos_token_ids:
            finish = "stop"
        if finish is None:
            active.cache = cache
            slot.ready.append(active)
            self._share_prompt(slot, active, cache)
        self._on_token(slot, active, token, finish, cache if finish is not None else None, record)

    def _share_prompt(self, slot: _Slot, active: _Active, cache: list) -> None:
        """Store a prompt whose KV a queued request would reuse beyond what the cache holds for it."""
        kv = self._kv(slot.info.model_id)
        if kv is None:
            return
        ids = active.prompt_ids
        need = active.reused + SHARE_MIN_TOKENS
        if not any(_common_prefix(ids, q.prompt_ids, need) >= need for q in slot.queue):
            return
        try:
            kv.store(ids, cache, extends=active.reused_key, reused=active.reused)
        except Exception:  # an edge: see _reuse
            log.exception("prefix cache store failed")

    def _join_ready(self, slot: _Slot) -> None:
        """The ready requests join the batch, each with its first token as the next input."""
        if not slot.ready or (not slot.joining and _unmerged(slot.generator)):
            return  # see _unmerged: the batch steps first
        ready, slot.ready = slot.ready, []
        slot.joining = True
        try:
            uids = slot.generator.insert(
                [[a.completion_ids[-1]] for a in ready],
                max_tokens=[a.max_tokens - 1 for a in ready],
                caches=[for_batch(a.cache) for a in ready],
                all_tokens=[list(a.prompt_ids) for a in ready],  # a copy: mlx-lm appends to it
                samplers=[a.sampler for a in ready],
                logits_processors=[[a.guide] if a.guide else [] for a in ready]
                if any(a.guide for a in ready) else None,  # issue 31
            )
        except Exception:  # an edge: these requests fail, the batch goes on
            log.exception("batch insert failed", extra={"model_id": slot.info.model_id})
            for active in ready:
                self._emit(active.sink, Failed(EngineFailure.INTERNAL_ERROR))
                self._retire(slot, active)
            return
        for active, uid in zip(ready, uids, strict=True):
            active.uid, active.cache = uid, None
            slot.requests[uid] = active

    def _step(self, slot: _Slot) -> None:
        try:
            _, responses = slot.generator.next()
            for r in responses:
                active = slot.requests.get(r.uid)
                if active is not None:
                    self._on_token(slot, active, r.token, r.finish_reason, r.prompt_cache, r.logprobs)
        except Exception:  # an edge: fail this model's requests, keep the worker alive
            log.exception("decode step failed", extra={"model_id": slot.info.model_id})
            self._fail_all(slot, EngineFailure.INTERNAL_ERROR)
            slot.generator.close()
            slot.generator = self._generator(slot.model, slot.info.eos_token_ids)
        self._publish_stats(slot)

    def _on_token(self, slot: _Slot, active: _Active, token: int, finish: str | None,
                  cache: list | None = None, logprob: TokenLogprob | None = None) -> None:
        active.completion_ids.append(token)
        if not active.first_token:
            active.first_token = time.monotonic()
        if logprob is not None and finish != "stop":  # issue 31; an EOS token is no part of the text
            active.logprobs.append(logprob)
        if finish is not None:  # the batch handed back this request's cache: keep the sequence
            self._keep_prefix(slot, active, cache)
        if finish == "stop":  # an EOS token: never part of the text
            out = active.text.finish()
            self._emit_text(active, out.text)
            self._finish(slot, active, FinishReason.STOP)
            return
        out = active.text.add(token)
        if out.stopped:
            self._emit_text(active, out.text)
            if finish is None and active.uid is None:  # its first token: its cache is its own
                self._keep_prefix(slot, active, active.cache)
            elif finish is None:
                removed = slot.generator.remove([active.uid], return_prompt_caches=self._prefix_cache is not None)
                if active.uid in removed:
                    self._keep_prefix(slot, active, removed[active.uid][0])
            self._finish(slot, active, FinishReason.STOP)
        elif finish == "length":
            tail = active.text.finish()
            self._emit_text(active, out.text + tail.text)
            self._finish(slot, active, FinishReason.STOP if tail.stopped else FinishReason.LENGTH)
        else:
            self._emit_text(active, out.text)

    def _emit_text(self, active: _Active, text: str) -> None:
        if text:
            if active.answer is not None:
                active.answer.append(text)
            if active.logprobs:  # issue 31: the log-probabilities of the tokens this text is from
                logprobs, active.logprobs = tuple(active.logprobs), []
                delta = TextDelta(text, logprobs)
            else:
                delta = TextDelta(text)
            if active.text_sent and self._holding():
                self._hold(active.sink, delta)
            else:
                self._emit(active.sink, delta)
            active.text_sent = True

    def _finish(self, slot: _Slot, active: _Active, reason: FinishReason) -> None:
        if active.messages is not None and active.answer is not None:
            self._next_turns.pop(slot.info.model_id, None)  # newest last: it is prepared first
            self._next_turns[slot.info.model_id] = _NextTurn(slot.info.model_id, active.messages,
                                                             "".join(active.answer), tools=active.tools,
                                                             due=time.monotonic() + NEXT_TURN_QUIET_S)
        usage = Usage(active.prompt_tokens, len(active.completion_ids))
        times = EngineTimes(active.received, active.started or active.received, active.first_token or time.monotonic())
        event = Finished(reason, usage, tuple(active.completion_ids), cached_tokens=active.reused, times=times)
        if self._kept and self._kept[-1].active is active:
            self._send_held(active.sink)  # the text now; `_retire` below would drop it
            self._kept[-1].finished = (active.sink, event)  # sent once its sequence is stored
        else:
            self._emit(active.sink, event)
        self._retire(slot, active)

    def _publish_stats(self, slot: _Slot) -> None:
        actives = slot.actives()
        running = sum(1 for a in actives if a.completion_ids)
        tokens = sum(a.prompt_tokens + len(a.completion_ids) for a in actives)
        self.stats[slot.info.model_id] = ModelStats(running, len(actives) - running, tokens)

    # -- delivery ----------------------------------------------------------------------------

    def _emit(self, sink: EventSink, event: Event) -> None:
        self._send_held(sink)  # the text held for this request goes first
        self._outbox.append((sink, event))

    def _send_held(self, sink: EventSink) -> None:
        held = self._held.pop(id(sink), None)
        if held is not None:
            self._outbox.append(held)

    def _holding(self) -> bool:
        """Whether text after a request's first token may wait for the next release (see "Delivery")."""
        return self._stream_interval > 0 and len(self._where) > STREAM_INTERVAL_MIN_REQUESTS

    def _hold(self, sink: EventSink, delta: TextDelta) -> None:
        held = self._held.get(id(sink))
        if held is not None:
            delta = TextDelta(held[1].text + delta.text, held[1].logprobs + delta.logprobs)
        self._held[id(sink)] = (sink, delta)

    def _release_held(self) -> None:
        now = time.monotonic()
        if self._held and (now - self._released_at >= self._stream_interval or not self._holding()):
            self._outbox.extend(self._held.values())
            self._held.clear()
            self._released_at = now

    def _flush_outbox(self) -> None:
        self._release_held()
        if not self._outbox:
            return
        by_loop: dict[object, list[tuple[EventSink, Event]]] = defaultdict(list)
        for sink, event in self._outbox:
            by_loop[sink.loop].append((sink, event))
        self._outbox = []
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # that loop is closed: nobody is listening any more
                pass


def _deliver(items: list[tuple[EventSink, Event]]) -> None:
    for sink, event in items:
        sink.push(event)


def _on_cpu_unless(setting: bool | None) -> bool:
    """A CPU-device tuning's setting: None = on the CPU device only (layout.py, attention.py)."""
    return on_cpu() if setting is None else setting


def _common_prefix(a: Sequence[int], b: Sequence[int], enough: int) -> int:
    """Length of the common prefix of `a` and `b`, counted no further than `enough`."""
    n = min(len(a), len(b), enough)
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _unmerged(generator: BatchGenerator) -> bool:
    """Inserted sequences the generator has not yet taken into a batch (mlx-lm 0.32.x keeps them in
    `_unprocessed_sequences`). It merges them in insertion order with the first one's cache type, so
    ready requests (`prefill.for_batch`: block-rounded buffers) are never inserted beside requests
    inserted as they are, or the merged batch would lose the block rounding the ledger counts on."""
    return bool(generator._unprocessed_sequences)
