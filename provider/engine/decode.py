"""The decode step, owned by the engine.

mlx-lm's `BatchGenerator` still schedules the batch (inserts, batched prefill, joins, removals); its
generation batch, which runs every decode step, is ours: `DecodeBatch`. Per step mlx-lm's does the
model's forward pass, samples, schedules the next step (`mx.async_eval`) and reads the current
tokens, and besides that splits the batch's log-probabilities into one array per sequence, schedules
those B arrays with the tokens and waits for them before it reads the tokens: B more graph outputs a
step, for values the engine never reads. `DecodeBatch` schedules and reads the tokens only.

Token identity: the same forward pass, the same log-probabilities (`logits - logsumexp`) and the same
sampler calls in the same order as mlx-lm's `GenerationBatch._step`, so every sequence gets the tokens
mlx-lm would give it. A batch with logits processors takes mlx-lm's own step (they need the token
context it keeps). `Response.logprobs` is None for the steps taken here. A batch whose only
processors are the engine's own `guided.RowGuide`s (a grammar's masks, log-probabilities)
takes `guided.step` instead, which keeps the plain rows' arithmetic as it is here.

Joining the batch (`PrefillBatch`, mlx-lm's prompt batch with three steps changed). When requests
arrive while a batch decodes (a server's steady state: at 32 concurrent requests of 64 tokens one
joins almost every step) mlx-lm's prompt batch waited on the host for each prefill (`mx.eval`, behind
the decode step in flight), cleared MLX's buffer cache after it (on a GPU the next steps then allocate
afresh), deep-copied the whole prompt cache whenever some of its sequences moved on to decoding, and
took their first decode step with mlx-lm's step, which waits again. Here a prompt's last prefill
chunk is scheduled, not waited for (a long prompt's earlier chunks still are, one chunk's activations
at a time), the buffer cache stays (the engine bounds it: `memory.mlx_limits`), the split copies only
the cache objects (mlx-lm's `BatchKVCache.filter` rebinds every array it keeps; other cache kinds
are deep-copied as before), and the first step is a `DecodeBatch`'s. The values computed are the
same; only when the host waits for them changes.

Leaving the batch. When sequences end, mlx-lm's batch cache reads the batch's left padding back from
the device once per layer to extract each finished sequence's cache, and once more per layer to
filter the batch: 2 x layers reads (64 on an 8B) per departure, the first of which waits for the
step just scheduled, since the padding it reads is computed behind that step. Every layer holds the
same padding, so `DecodeBatch` reads it once (`_left_padding`), does the filter's arithmetic on the
host, and gives every layer its new padding as an array made from those host values, which it
keeps: the next departure reads nothing from the device unless sequences joined since, and a join
schedules the joined padding ahead of the next step, so that read finds it computed. The arrays are
mlx-lm's.

Prefill waves. mlx-lm's `BatchGenerator._next` decodes, then tops its prompt batch up to
`prefill_batch_size` (8) prompts, then moves the prompts prefilled by the *previous* call to decoding,
then prefills the rest. A server's first request wakes the engine alone, so its first wave is one
prompt, and from then on the top-up before the move makes the waves alternate 7 / 1 / 7 / 1; each
prompt waits a whole call between its prefill and its first decode, and on a GPU a pass of one short
prompt costs about what a pass of eight does. `EngineBatchGenerator.step` instead takes every waiting
prompt whose place in the pass keeps it within `prefill_tokens` (padding included: the pass is
`rows x longest chunk` tokens), prefills them in one pass, and moves each prompt that pass finished to
decoding in the same call: its last token's pass is scheduled right behind the prefill, and the next
decode step reads the first token. A burst on a GPU is one pass; on the CPU, where a pass costs what
its tokens cost, `prefill_tokens` stays at mlx-lm's own per-prompt pass so a wave never holds the
running batch longer than one of mlx-lm's passes would. The arithmetic per prompt is mlx-lm's (the
same prefill, the same last-token pass, the same decode step); only which prompts share a pass, and
when, changes.

`EngineBatchGenerator` is mlx-lm's `BatchGenerator` with a `PrefillBatch` as its prompt batch and a
`DecodeBatch` as its generation batch: `extend` merges the batches mlx-lm builds into them. The parts
of mlx-lm's that are private (the step and copy hooks, the batches' state, how it lays out a waiting or
prefilling sequence, a batch cache's end) are reached through provider/mlxlm.py, by public names.
"""

from __future__ import annotations

import copy
import itertools
import time
from collections.abc import Callable

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, GenerationBatch, PromptProcessingBatch
from mlx_lm.models.cache import BatchKVCache, KVCache

from provider.engine import guided
from provider.engine.layout import on_cpu
from provider.mlxlm import (
    BatchGeneratorBase,
    GenerationBatchBase,
    PromptBatchBase,
    kv_end,
    last_token_only,
    prefill_segments,
    prompt_tokens_total,
    right_pad_prompts,
    set_kv_end,
    take_chunk,
    waiting_segments,
)

DEFAULT_PREFILL_TOKENS = 2048  # mlx-lm's prefill_step_size: one prompt's pass at most, there


class DecodeBatch(GenerationBatchBase):
    def __init__(self, *args, **kwargs) -> None:
        self._padding_read: tuple[mx.array | None, list[int]] = (None, [])  # see `_left_padding`
        # Called once a step is scheduled, before its tokens are read: the host's time while the device
        # computes (the engine takes new requests then: worker.py, "Intake during a step").
        self.while_computing: Callable[[], None] | None = None
        super().__init__(*args, **kwargs)

    def step(self) -> tuple[list[int], list[None]]:
        if any(self.logits_processors):
            if guided.only_guides(self.logits_processors):  # grammar masks, log-probabilities
                return guided.step(self)
            return super().step()
        self.current_tokens, self.current_logprobs = self.next_tokens, self.next_logprobs
        inputs = self.current_tokens
        logits = self.model(inputs[:, None], cache=self.prompt_cache)[:, -1, :]
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        samplers = [self.fallback_sampler if s is None else s for s in (self.samplers or [None] * len(self.uids))]
        if not samplers or all(s is samplers[0] for s in samplers):
            sampled = (samplers[0] if samplers else self.fallback_sampler)(logprobs)
        else:
            sampled = mx.concatenate([s(logprobs[e: e + 1]) for e, s in enumerate(samplers)], axis=0)
        self.next_tokens = sampled
        self.next_logprobs = [None] * len(self.uids)  # kept aligned for mlx-lm's filter / extend
        mx.async_eval(sampled)  # the next step runs while this one's tokens are read and delivered
        if self.while_computing is not None:
            self.while_computing()
        tokens = inputs.tolist()
        for sequence, token in zip(self.tokens, tokens):
            sequence.append(token)
        return tokens, [None] * len(tokens)

    def extend(self, batch: GenerationBatch) -> None:
        """mlx-lm's, and the joined batch's padding scheduled now, ahead of the next step: the departure
        that reads it (`_left_padding`) then finds it computed instead of waiting for a step."""
        super().extend(batch)
        if _batch_kv(self.prompt_cache):
            mx.async_eval(self.prompt_cache[0].left_padding)

    def _left_padding(self) -> list[int]:
        """The batch's left padding, every layer's (see "Leaving the batch"), read once per change."""
        padding = self.prompt_cache[0].left_padding
        if self._padding_read[0] is not padding:
            self._padding_read = (padding, padding.tolist())
        return self._padding_read[1]

    def extract_cache(self, idx: int) -> list:
        """mlx-lm's `BatchKVCache.extract` for every layer, the padding read once."""
        if not _batch_kv(self.prompt_cache):
            return super().extract_cache(idx)
        start = self._left_padding()[idx]
        out = []
        for layer in self.prompt_cache:
            c = KVCache()
            end = kv_end(layer)
            c.keys = mx.contiguous(layer.keys[idx: idx + 1, :, start: end])
            c.values = mx.contiguous(layer.values[idx: idx + 1, :, start: end])
            c.offset = c.keys.shape[2]
            out.append(c)
        return out

    def filter(self, keep: list[int]) -> None:
        """mlx-lm's `GenerationBatch.filter`, with `BatchKVCache.filter`'s padding arithmetic on the host."""
        caches = self.prompt_cache
        if not keep or not _batch_kv(caches):
            return super().filter(keep)
        padding = [self._left_padding()[i] for i in keep]
        self.prompt_cache = []  # mlx-lm's filter of everything else; the caches below
        try:
            super().filter(keep)
        finally:
            self.prompt_cache = caches
        shift = min(padding)  # the padding every kept sequence has: dropped
        kept = [p - shift for p in padding]
        for layer in caches:
            if layer.keys is not None:
                layer.keys, layer.values = layer.keys[keep], layer.values[keep]
                if shift:
                    layer.keys, layer.values = layer.keys[..., shift:, :], layer.values[..., shift:, :]
            layer.offset = layer.offset[keep]
            set_kv_end(layer, kv_end(layer) - shift)
            layer.left_padding = mx.array(kept)  # from the host: nothing behind it to wait for
        self._padding_read = (caches[0].left_padding, kept)


def _batch_kv(cache: list) -> bool:
    return bool(cache) and all(type(c) is BatchKVCache for c in cache)


class PrefillBatch(PromptBatchBase):
    def prompt(self, tokens: list[list[int]]) -> None:
        """mlx-lm's `PromptProcessingBatch.prompt`, the last chunk scheduled and the buffer cache kept."""
        if len(self.uids) != len(tokens):
            raise ValueError("The batch length doesn't match the number of inputs")
        if not tokens:
            return
        for sequence, more in zip(self.tokens, tokens):
            sequence += more
        lengths = [len(p) for p in tokens]
        longest = max(lengths)
        padding = [longest - n for n in lengths]
        if max(padding) > 0:
            inputs = right_pad_prompts(tokens, max_length=longest)
            for c in self.prompt_cache:
                c.prepare(lengths=lengths, right_padding=padding)
        else:
            inputs = mx.array(tokens)
        while inputs.shape[1] > 0:
            n = min(self.prefill_step_size, inputs.shape[1])
            self.model(inputs[:, :n], cache=self.prompt_cache)
            inputs = inputs[:, n:]
            if inputs.shape[1] > 0:
                mx.eval([c.state for c in self.prompt_cache])  # one chunk's activations at a time
        if max(padding) > 0:
            for c in self.prompt_cache:
                c.finalize()
        mx.async_eval([c.state for c in self.prompt_cache])

    def copy_for_split(self) -> PrefillBatch:
        """mlx-lm's copy for `split`, with the batch caches' objects copied instead of their arrays."""
        cache = self.prompt_cache
        self.prompt_cache = []
        try:
            new = super().copy_for_split()
        finally:
            self.prompt_cache = cache
        new.prompt_cache = [copy.copy(c) if type(c) is BatchKVCache else copy.deepcopy(c) for c in cache]
        return new

    def generate(self, tokens: list[list[int]]) -> DecodeBatch:
        """mlx-lm's transition to decoding, its first step a `DecodeBatch`'s."""
        if any(len(t) > 1 for t in tokens):
            self.prompt([t[:-1] for t in tokens])
        batch = DecodeBatch(self.model, self.uids, mx.array([t[-1] for t in tokens]), self.prompt_cache,
                            self.tokens, self.samplers, self.fallback_sampler, self.logits_processors,
                            self.stop_sequences, self.max_tokens)
        self.uids, self.prompt_cache, self.tokens = [], [], []
        self.samplers, self.logits_processors, self.max_tokens = [], [], []
        return batch


class EngineBatchGenerator(BatchGeneratorBase):
    """mlx-lm's `BatchGenerator` with the engine's prompt and decode batches and its own schedule
    (`step`, "Prefill waves" in the module docstring). `prefill_tokens`: the most prompt tokens one
    pass prefills (padding included), whatever number of prompts that is."""

    def __init__(self, model, *, prefill_tokens: int = DEFAULT_PREFILL_TOKENS, **kwargs) -> None:
        super().__init__(model, **kwargs)
        if prefill_tokens < 1:
            raise ValueError("prefill_tokens must be at least 1")
        self.prefill_tokens = prefill_tokens
        self.prompt_batch = PrefillBatch.empty(self.model, self.sampler, prefill_step_size=self.prefill_step_size)
        self.generation_batch = DecodeBatch.empty(self.model, self.sampler)

    @property
    def while_computing(self) -> Callable[[], None] | None:
        """Called once each decode step is scheduled, before its tokens are read (`DecodeBatch`)."""
        return self.generation_batch.while_computing

    @while_computing.setter
    def while_computing(self, call: Callable[[], None] | None) -> None:
        self.generation_batch.while_computing = call

    def step(self):
        """One decode step of the running batch, then one prefill pass over every waiting prompt that
        fits `prefill_tokens`; the prompts that pass finishes move to decoding at once."""
        generation_responses = []
        prompt_responses = []
        counters = self.counters
        if len(self.generation_batch) > 0:
            tic = time.perf_counter()
            generation_responses = self.generation_batch.next()
            counters.decode_time += time.perf_counter() - tic
            counters.generation_tokens += len(generation_responses)
            counters.generation_steps += 1
            if counters.generation_steps % 512 == 0:
                mx.clear_cache()
        if len(self.generation_batch) >= self.completion_batch_size:
            return prompt_responses, generation_responses
        n = self._wave()
        if n > 0:
            self.prompt_batch.extend(self.make_batch(n))
        prompt_responses += self._to_decoding()  # prompts with nothing left to prefill (a cache was given)
        prompts = []
        for uid, entry in zip(self.prompt_batch.uids, self.prefilling):
            chunk, progress, ended = take_chunk(entry, self.prefill_step_size)
            prompts.append(chunk)
            prompt_responses.append(PromptProcessingBatch.Response(uid, progress, ended, False))
        if prompts:
            counters.prompt_tokens += sum(len(p) for p in prompts)
            tic = time.perf_counter()
            self.prompt_batch.prompt(prompts)
            counters.prompt_time += time.perf_counter() - tic
            prompt_responses += self._to_decoding()  # the prompts this pass finished, without waiting a call
        return prompt_responses, generation_responses

    def _wave(self) -> int:
        """How many waiting prompts join the prompt batch: first come first, while the batch's padded
        pass stays within `prefill_tokens` (at least one prompt when the prompt batch is empty) and
        every prompt has a place in the decode batch."""
        room = self.completion_batch_size - len(self.generation_batch) - len(self.prompt_batch)
        rows = len(self.prompt_batch)
        longest = max((_chunk(prefill_segments(e), self.prefill_step_size) for e in self.prefilling), default=0)
        n = 0
        for entry in itertools.islice(self.waiting, max(0, room)):
            segments = [s for s in waiting_segments(entry) if s]
            wider = max(longest, _chunk(segments, self.prefill_step_size))
            if rows and (rows + 1) * wider > self.prefill_tokens:
                break
            rows, longest, n = rows + 1, wider, n + 1
        return n

    def _to_decoding(self) -> list[PromptProcessingBatch.Response]:
        """mlx-lm's split: the prompts left with only their last token start decoding (that token's
        pass is scheduled now; its output is read by the next decode step)."""
        split = [i for i, entry in enumerate(self.prefilling) if last_token_only(entry)]
        if not split:
            return []
        last_inputs = [prefill_segments(self.prefilling[i])[0] for i in split]
        progress = [(prompt_tokens_total(self.prefilling[i]),) * 2 for i in split]
        keep = set(split)
        self.prefilling = [e for i, e in enumerate(self.prefilling) if i not in keep]
        if len(split) == len(self.prompt_batch):
            batch, self.prompt_batch = self.prompt_batch, PrefillBatch.empty(
                self.model, self.sampler, prefill_step_size=self.prefill_step_size)
        else:
            batch = self.prompt_batch.split(split)
        generation = batch.generate(last_inputs)
        self.generation_batch.extend(generation)
        return [PromptProcessingBatch.Response(uid, p, True, True) for uid, p in zip(generation.uids, progress)]


def _chunk(segments: list[list[int]], step: int) -> int:
    """Tokens the next prefill pass takes from a prompt's segments (its last token is never prefilled)."""
    if not segments or (len(segments) == 1 and len(segments[0]) == 1):
        return 0
    return min(len(segments[0]), step)


GPU_PREFILL_TOKENS = 8192  # a GPU's pass: a burst of short prompts at once, half what mlx-lm's 8 x 2048 may take


def prefill_tokens_for_device(setting: int | None) -> int:
    """A prefill pass's token budget ("Prefill waves"): the setting, else by device."""
    if setting is not None:
        return setting
    return DEFAULT_PREFILL_TOKENS if on_cpu() else GPU_PREFILL_TOKENS


def new_generator(model, eos_token_ids: frozenset[int], batch_size: int, prefill_tokens: int) -> BatchGenerator:
    """A model's generator. completion_batch_size is how many sequences decode at once; admission never
    admits more concurrent requests per model than this, so no admitted request waits without tokens."""
    return EngineBatchGenerator(model, stop_tokens=[[t] for t in sorted(eos_token_ids)] or None,
                                completion_batch_size=batch_size, prefill_batch_size=batch_size,
                                prefill_tokens=prefill_tokens)


__all__ = ["GPU_PREFILL_TOKENS", "DecodeBatch", "EngineBatchGenerator", "PrefillBatch", "new_generator",
           "prefill_tokens_for_device"]
