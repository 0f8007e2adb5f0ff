"""The MLX worker: the only code that touches MLX, run on one dedicated thread.

Theory of operation. `Worker.run` blocks on the command queue while no request is active.
While requests are active it drains whatever commands are queued without blocking, advances
every model that has work by one step (a chunk of a prompt prefilled alone, or one
`BatchGenerator.next()` call: one decode step plus one prefill pass (decode.py, "Prefill waves");
round-robin across models), then hands the step's events to the asyncio loop in one
`call_soon_threadsafe` per loop (delivery.py). So a command (a cancel, a new request) waits for at
most one step, and requests join and leave the running batch between any two steps. Between steps,
and when the prefix cache has a conversation turn due on its SSD tier while idle (the blocking wait
then ends at that time), it writes the turns that went quiet (reuse.py). While idle it may prepare a
local conversation's next turn (next_turn.py). The C heap's free pages go back to the system at most
every 30 s while it works and when it has nothing left to do (memory/heap.py).

Solo prefill (`prefill.py`). A prompt whose part still to prefill (after the prefix cache) is at
least the model's `solo_min_tokens` is prefilled by itself, a chunk per loop, its first token out
at once; it then waits in `ready` and joins the batch with that token as its input. While such
prompts wait, the batch does not step until `prefill.PREFILL_STEP` prompt tokens have been
prefilled alone since its last step, the most mlx-lm itself prefills between two decode steps.
Prompts with less left to prefill go to the `BatchGenerator` as they are (its batched prefill
waves); the two kinds are never inserted into it between the same two steps (`active.unmerged`).

Each text request has one state (lifecycle.py): WAITING in its model's queue, PREFILLING (alone, or
in the batch before its first token), DECODING, FINISHING, RELEASED; the transitions are that table's
and the worker steps them where they happen (`_start`, `_on_token`, `_finish`, `_retire`).

Intake during a step. A decode step's host work ends when it is scheduled; then the engine thread
waits for the device. In that time (`DecodeBatch.while_computing`) it takes the Submits queued since
the loop last drained and starts them, so a request that arrives during the step joins the prefill
wave of the same call instead of waiting a whole call. Any other command (a cancel, a load) changes
the batch and waits for the step's end, and every command after it too, so their order holds.

Vision-language models (`vision.VisionSlot`, loaded with mlx-vlm) are stepped in the same loop,
after the text batches: every vision request past its prompt decodes one token per loop; the
oldest one still before its first token (template + processor, vision encoder, prefill chunks)
gets one step per loop, within a time share (`vision.DutyCycle`) while text requests decode, so
text keeps streaming while an image is encoded.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Mapping, Sequence

import mlx.core as mx
from mlx_lm.generate import BatchGenerator

from memory.heap import Trimmer
from memory.settle import clear_buffer_cache, reclaim
from provider.engine import attention, guided
from provider.engine.active import Active, PrefixCacheLookup, Slot, unmerged
from provider.engine.commands import (
    Cancel,
    Command,
    CountPromptTokens,
    KvBytesPerToken,
    KvCacheBytes,
    Load,
    MemoryReading,
    Reclaim,
    Stop,
    Submit,
    Unload,
    answer,
    notify_released,
)
from provider.engine.decode import new_generator, prefill_tokens_for_device
from provider.engine.delivery import Delivery
from provider.engine.device import DeviceLimits
from provider.engine.lifecycle import RequestEvent, RequestState
from provider.engine.loading import kv_bytes_per_token, load_text, load_vision, on_cpu_unless
from provider.engine.next_turn import NextTurns
from provider.engine.options import EngineOptions
from provider.engine.prefill import PREFILL_STEP, SoloPrefill, for_batch
from provider.engine.reuse import PrefixReuse
from provider.engine.sampling import sampler_for
from provider.engine.textstream import CompletionText
from provider.engine.types import (
    EngineError,
    EngineFailure,
    EngineTimes,
    Failed,
    Finished,
    FinishReason,
    LoadedModelInfo,
    ModelStats,
    TokenLogprob,
    Usage,
)
from provider.engine.vision import DutyCycle, Trace, VisionSlot, step_vision_slots
from provider.telemetry import get_logger

log = get_logger("provider.engine")

class Worker:
    def __init__(self, commands: queue.SimpleQueue[Command], options: EngineOptions, *,
                 prefix_cache: PrefixCacheLookup | None = None, trace: Trace | None = None):
        self._commands = commands
        self._options = options
        self._trace = trace
        self._duty = DutyCycle()
        self.batch_size = options.batch_size
        self._device = DeviceLimits(options.limits)  # MLX's memory/cache limits, and the wired limit (device.py)
        self._slots: dict[str, Slot] = {}
        self._vision: dict[str, VisionSlot] = {}
        self._where: dict[str, tuple[Slot, Active]] = {}  # request_id -> (slot, request)
        self._delivery = Delivery(options.stream_interval_s, running=lambda: len(self._where))
        self._reuse = PrefixReuse(prefix_cache)
        self._next_turns = NextTurns(options.next_turn_scratch_bytes, self._reuse, trace)
        self._deferred: list[Command] = []  # taken during a step, handled at its end (see "Intake during a step")
        self._stopped = False
        self._heap = Trimmer()  # the heap's free pages back to the system now and then (memory/heap.py)
        # Read by other threads; only ever replaced item by item (atomic under the GIL).
        self.stats: dict[str, ModelStats] = {}

    # -- main loop -------------------------------------------------------------------------

    def serve(self) -> None:
        """The engine thread: `run` under MLX's memory settings, put back as found when it ends."""
        self._device.start()
        if on_cpu_unless(self._options.cpu_attention):
            attention.enable()  # this thread's attention calls only (attention.py)
        elif not attention.quantized_kernels():
            attention.enable_dequantized_kv()  # MLX's CUDA backend: no quantized attention (attention.py)
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
                self._delivery.flush()  # every token of the step goes out before the stores below
                self._reuse.store_kept(self._delivery.emit)
                self._delivery.flush()
                self._reuse.write_quiet(self._slots.values())
                self._heap.working()
                continue
            if self._deferred:  # taken during the step that ended the last request: handled before idling
                self._drain_commands()
                continue
            wait = self._reuse.write_quiet(self._slots.values())
            due = self._next_turns.due_in()  # wake when the next-turn preparation is due (at once while it runs)
            if due is not None:
                wait = due if wait is None else min(wait, due)
            if wait is None:  # nothing left to do: what the work freed goes back before the engine sleeps
                self._heap.idle()
            try:  # idle: wake for the next command, or when a cached turn is due on SSD
                command = self._commands.get(timeout=wait)
            except queue.Empty:
                self._next_turns.step(self._slots)
                self._heap.working()
                continue
            self._handle(command)
            self._delivery.flush()

    def _drain_commands(self) -> None:
        """Handle every queued command. Consecutive cancels are removed from their batches in one
        `remove` per model: after a mass disconnect, one filter of the batch KV instead of one per
        request (each copies the whole batch), so the ledger hears of every release within a step."""
        cancels: list[str] = []
        while not self._stopped:
            if self._deferred:
                command = self._deferred.pop(0)
            else:
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

    def _intake(self) -> None:
        """The Submits queued since the last drain, taken while a decode step computes (see "Intake
        during a step"); the first other command, and all after it, wait for the step's end."""
        while not self._deferred and not self._stopped:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if not isinstance(command, Submit):
                self._deferred.append(command)
                return
            try:
                self._handle(command)
                slot = self._slots.get(command.model_id)
                if slot is not None:
                    self._start_queued(slot)
            except Exception:  # an edge: never the step's failure; the request is failed by _submit's own paths
                log.exception("intake_failed", model=command.model_id)

    def _handle(self, command: Command) -> None:
        if isinstance(command, (Submit, Load, Unload, Stop)):
            self._next_turns.clear()  # a request (or a load) never waits behind a guess
        match command:
            case Submit():
                self._submit(command)
            case Cancel(request_id):
                self._cancel(request_id)
            case CountPromptTokens(model_id, messages, reply):
                answer(reply, lambda: self._count_prompt(model_id, messages))
            case KvCacheBytes(model_id, reply):
                answer(reply, lambda: self._kv_cache_bytes(model_id))
            case MemoryReading(reply):
                answer(reply, self._memory_reading)
            case KvBytesPerToken(model_id, reply):
                answer(reply, lambda: self._kv_bytes_per_token(model_id))
            case Load():
                answer(command.reply, lambda: self._load(command))
            case Unload(model_id, reply):
                answer(reply, lambda: self._unload(model_id))
            case Reclaim(reply, collect):
                answer(reply, reclaim if collect else clear_buffer_cache)
            case Stop(reply):
                answer(reply, self._stop)

    def _slot(self, model_id: str) -> Slot:
        slot = self._slots.get(model_id)
        if slot is None:
            raise EngineError(EngineFailure.MODEL_NOT_LOADED)
        return slot

    def _count_prompt(self, model_id: str, messages: Sequence[Mapping[str, object]]) -> int:
        vision = self._vision.get(model_id)
        if vision is not None:
            return vision.count_prompt(messages)
        return len(self._slot(model_id).render(messages))

    def _memory_reading(self) -> tuple[int, int]:
        """(MLX active bytes, Σ KV held by every model's batch), between two steps: consistent."""
        kv = sum(self._kv_cache_bytes(model_id) for model_id in [*self._slots, *self._vision])
        return mx.get_active_memory(), kv

    def _kv_cache_bytes(self, model_id: str) -> int:
        vision = self._vision.get(model_id)
        if vision is not None:
            return vision.cache_nbytes()
        return self._slot(model_id).kv_bytes()

    # -- load / unload -----------------------------------------------------------------------

    def _load(self, cmd: Load) -> LoadedModelInfo:
        if cmd.model_id in self._slots or cmd.model_id in self._vision:
            raise EngineError(EngineFailure.MODEL_ALREADY_LOADED)
        if cmd.vision:
            if cmd.kv_bits is not None:  # mlx-vlm's own loop keeps its KV as the model's dtype
                raise EngineError(EngineFailure.LOAD_FAILED)
            info, vlm = load_vision(cmd)
            self._vision[cmd.model_id] = VisionSlot(info, vlm, emit=self._delivery.emit, notify=notify_released,
                                                    prefill_step=self._options.vision_prefill_step, trace=self._trace)
            self._device.wire()  # a vision model is resident too (its steps are ours: nothing else wires)
        else:
            slot = load_text(cmd, self._generator, weight_layout=self._options.weight_layout,
                             solo_min_tokens=self._options.solo_min_tokens,
                             measure_budget_s=self._options.measure_budget_s)
            slot.generator.while_computing = self._intake  # after the load's own steps
            self._slots[cmd.model_id] = slot
            info = slot.info
        self.stats[cmd.model_id] = ModelStats(0, 0, 0)
        return info

    def _generator(self, model, eos_token_ids: frozenset[int]) -> BatchGenerator:
        """A model's generator, under the engine's wired limit: wired before (so the generator records
        it as the value its `close()` restores) and again after (it has just wired its own)."""
        self._device.wire()
        try:
            generator = new_generator(model, eos_token_ids, self.batch_size,
                                       prefill_tokens_for_device(self._options.prefill_tokens))
        except BaseException:
            self._unwire_if_empty()
            raise
        self._device.wire()
        return generator

    def _unwire_if_empty(self) -> None:
        if not self._slots and not self._vision:
            self._device.unwire()  # no model resident: the wired limit found before the first one

    def _kv_bytes_per_token(self, model_id: str) -> int:
        vision = self._vision.get(model_id)
        if vision is not None:
            return vision.kv_bytes_per_token()
        slot = self._slot(model_id)
        if slot.busy():
            raise EngineError(EngineFailure.INVALID_REQUEST)  # a load-time check, never beside a batch
        return kv_bytes_per_token(slot)

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

    def _submit(self, cmd: Submit) -> None:
        request = cmd.request
        vision = self._vision.get(cmd.model_id)
        guided_request = request.constraint is not None or request.top_logprobs is not None
        if vision is not None and not self._known(request.request_id) and not guided_request:
            vision.submit(cmd)
            return
        try:
            if vision is not None or self._known(request.request_id):  # mlx-vlm's loop takes no guide
                raise EngineError(EngineFailure.INVALID_REQUEST)
            if request.images:  # a text model cannot take images
                raise EngineError(EngineFailure.INVALID_REQUEST)
            slot = self._slot(cmd.model_id)
            ids = list(request.prompt_ids) if request.prompt_ids else slot.render(request.messages, request.tools)
            ctx = slot.info.context_length
            room = request.params.max_tokens if ctx is None else ctx - len(ids)
            if room < 1:
                raise EngineError(EngineFailure.REQUEST_EXCEEDS_CONTEXT)
        except EngineError as exc:
            self._delivery.emit(cmd.sink, Failed(exc.code))
            if request.constraint is not None:
                request.constraint.release()
            notify_released(cmd.on_media_released, request.request_id)
            notify_released(cmd.on_released, request.request_id)
            return
        text = CompletionText(slot.tokenizer.detokenizer, request.params.stop)
        prepare = request.prepare_next_turn and self._next_turns.scratch_bytes > 0 and self._reuse.enabled
        active = Active(request.request_id, cmd.sink, cmd.on_released, text, len(ids),
                        max_tokens=min(request.params.max_tokens, room), sampler=sampler_for(request.params),
                        prompt_ids=ids, messages=request.messages if prepare else None,
                        answer=[] if prepare else None, tools=request.tools if prepare else (),
                        guide=guided.guide_for(request.constraint, request.top_logprobs))
        slot.queue.append(active)  # started by _advance: its prefix is looked up then (a burst shares it)
        self._where[request.request_id] = (slot, active)

    def _start_queued(self, slot: Slot) -> None:
        while slot.queue and slot.solo is None:
            active = slot.queue.popleft()
            if not self._start(slot, active):
                slot.queue.appendleft(active)
                break

    def _start(self, slot: Slot, active: Active) -> bool:
        """Take a queued request: alone when enough of its prompt is left to prefill, else into the
        batch; False when it must wait (it stays first in the queue)."""
        ids = active.prompt_ids
        cached = self._reuse.cached_tokens(slot.info.model_id, ids)
        solo = slot.split is not None and len(ids) - cached >= slot.solo_min_tokens
        if not solo and slot.joining and unmerged(slot.generator):
            return False  # see active.unmerged
        reuse = self._reuse.reuse(slot.info.model_id, ids, slot.kv_bits)
        active.reused_key, active.reused = reuse.key, reuse.matched
        rest = reuse.rest(ids)
        if solo and rest:
            cache = reuse.cache if reuse.cache is not None else slot.new_cache()
            active.solo = SoloPrefill(slot.model, slot.split, cache, rest, chunk=PREFILL_STEP)
            slot.solo = active
            active.step(RequestEvent.START)
            active.started = time.monotonic()
            return True
        slot.joining = False
        try:
            (active.uid,) = slot.generator.insert(
                [rest],
                max_tokens=[active.max_tokens],
                caches=[slot.new_cache() if reuse.cache is None else reuse.cache],
                all_tokens=None if reuse.cache is None else [ids[: reuse.matched]],
                samplers=[active.sampler],
                logits_processors=None if active.guide is None else [[active.guide]],
            )
        except Exception:  # an edge: this request fails, the batch goes on
            log.exception("batch_insert_failed", model=slot.info.model_id)
            self._delivery.emit(active.sink, Failed(EngineFailure.INTERNAL_ERROR))
            self._retire(slot, active)
            return True
        active.step(RequestEvent.START)
        slot.requests[active.uid] = active
        active.started = time.monotonic()
        return True

    def _known(self, request_id: str) -> bool:
        return request_id in self._where or any(request_id in v.runs for v in self._vision.values())

    def _cancel(self, request_id: str) -> None:
        self._cancel_many([request_id])

    def _cancel_many(self, request_ids: Sequence[str]) -> None:
        # Unknown ids are normal: the request may have finished in the previous step.
        by_slot: dict[str, tuple[Slot, list[Active]]] = {}
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

    def _fail_all(self, slot: Slot, code: EngineFailure) -> None:
        actives = slot.actives()
        uids = [a.uid for a in actives if a.uid is not None]
        if uids:
            slot.generator.remove(uids)
        for active in actives:
            self._delivery.emit(active.sink, Failed(code))
            self._retire(slot, active)

    def _retire(self, slot: Slot, active: Active) -> None:
        """Forget a request, wherever it is held (its cache has left the batch), and tell the ledger. Its
        end is decided here when nothing decided it before (a cancel, a failure)."""
        if active.state is not RequestState.FINISHING:
            active.step(RequestEvent.END)
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
            active.guide.constraint.release()  # its grammar's reservation (memory/grammar.py)
        active.step(RequestEvent.RELEASE)
        del self._where[active.request_id]
        self._publish_stats(slot)  # a cancel leaves no later step to refresh them
        notify_released(active.on_released, active.request_id)

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
        for vision in step_vision_slots(self._vision.values(), self._duty, text_running=bool(self._where)):
            self.stats[vision.info.model_id] = vision.stats()

    def _advance(self, slot: Slot) -> None:
        """One step of a model: a chunk of the prompt being prefilled alone while the batch may wait
        for it (module docstring, "Solo prefill"), else the ready requests join and the batch steps."""
        self._start_queued(slot)
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

    def _step_solo(self, slot: Slot, active: Active) -> None:
        try:
            with mx.stream(slot.generator.stream):
                done, token, record = active.solo_step()
        except Exception:  # an edge: this request fails, the others go on
            log.exception("prefill_failed", model=slot.info.model_id)
            self._delivery.emit(active.sink, Failed(EngineFailure.INTERNAL_ERROR))
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
        try:
            if finish is None:
                active.cache = cache
                slot.ready.append(active)
                self._reuse.share_prompt(slot, active, cache)
            self._on_token(slot, active, token, finish, cache if finish is not None else None, record)
        except Exception:  # an edge: as in the batch's step, this request fails and the engine goes on
            log.exception("first_token_failed", model=slot.info.model_id)
            if active.request_id in self._where:
                self._delivery.emit(active.sink, Failed(EngineFailure.INTERNAL_ERROR))
                self._retire(slot, active)

    def _join_ready(self, slot: Slot) -> None:
        """The ready requests join the batch, each with its first token as the next input."""
        if not slot.ready or (not slot.joining and unmerged(slot.generator)):
            return  # see active.unmerged: the batch steps first
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
                if any(a.guide for a in ready) else None,
            )
        except Exception:  # an edge: these requests fail, the batch goes on
            log.exception("batch_insert_failed", model=slot.info.model_id)
            for active in ready:
                self._delivery.emit(active.sink, Failed(EngineFailure.INTERNAL_ERROR))
                self._retire(slot, active)
            return
        for active, uid in zip(ready, uids, strict=True):
            active.uid, active.cache = uid, None
            slot.requests[uid] = active

    def _step(self, slot: Slot) -> None:
        try:
            _, responses = slot.generator.next()
            for r in responses:
                active = slot.requests.get(r.uid)
                if active is not None:
                    self._on_token(slot, active, r.token, r.finish_reason, r.prompt_cache, r.logprobs)
        except Exception:  # an edge: fail this model's requests, keep the worker alive
            log.exception("decode_step_failed", model=slot.info.model_id)
            self._fail_all(slot, EngineFailure.INTERNAL_ERROR)
            slot.generator.close()
            slot.generator = self._generator(slot.model, slot.info.eos_token_ids)
            slot.generator.while_computing = self._intake
        self._publish_stats(slot)

    def _on_token(self, slot: Slot, active: Active, token: int, finish: str | None,
                  cache: list | None = None, logprob: TokenLogprob | None = None) -> None:
        active.step(RequestEvent.TOKEN)
        active.completion_ids.append(token)
        if not active.first_token:
            active.first_token = time.monotonic()
        if logprob is not None and finish != "stop":  # an EOS token is no part of the text
            active.logprobs.append(logprob)
        if finish is not None:  # the batch handed back this request's cache: keep the sequence
            self._reuse.keep(slot.info.model_id, active, cache)
        if finish == "stop":  # an EOS token: never part of the text
            out = active.text.finish()
            self._delivery.request_text(active, out.text)
            self._finish(slot, active, FinishReason.STOP)
            return
        out = active.text.add(token)
        if out.stopped:
            self._delivery.request_text(active, out.text)
            if finish is None and active.uid is None:  # its first token: its cache is its own
                self._reuse.keep(slot.info.model_id, active, active.cache)
            elif finish is None:
                removed = slot.generator.remove([active.uid], return_prompt_caches=self._reuse.enabled)
                if active.uid in removed:
                    self._reuse.keep(slot.info.model_id, active, removed[active.uid][0])
            self._finish(slot, active, FinishReason.STOP)
        elif finish == "length":
            tail = active.text.finish()
            self._delivery.request_text(active, out.text + tail.text)
            self._finish(slot, active, FinishReason.STOP if tail.stopped else FinishReason.LENGTH)
        else:
            self._delivery.request_text(active, out.text)

    def _finish(self, slot: Slot, active: Active, reason: FinishReason) -> None:
        active.step(RequestEvent.END)
        if active.messages is not None and active.answer is not None:
            self._next_turns.finished(slot.info.model_id, active.messages, "".join(active.answer), active.tools)
        usage = Usage(active.prompt_tokens, len(active.completion_ids))
        times = EngineTimes(active.received, active.started or active.received, active.first_token or time.monotonic())
        event = Finished(reason, usage, tuple(active.completion_ids), cached_tokens=active.reused, times=times)
        keep = self._reuse.holds_finish_of(active)
        if keep is not None:
            self._delivery.send_held(active.sink)  # the text now, ahead of the stored Finished
            keep.finished = (active.sink, event)  # sent once its sequence is stored
        else:
            self._delivery.emit(active.sink, event)
        self._retire(slot, active)

    def _publish_stats(self, slot: Slot) -> None:
        self.stats[slot.info.model_id] = slot.model_stats()

__all__ = ["Worker"]
