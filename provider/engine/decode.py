"""The decode step, owned by the engine (issue 30 item 2).

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
processors are the engine's own `guided.RowGuide`s (a grammar's masks, log-probabilities: issue 31)
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

`EngineBatchGenerator` is mlx-lm's `BatchGenerator` with a `PrefillBatch` as its prompt batch and a
`DecodeBatch` as its generation batch: `extend` merges the batches mlx-lm builds into them.
"""

from __future__ import annotations

import copy

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, GenerationBatch, PromptProcessingBatch, _right_pad_prompts
from mlx_lm.models.cache import BatchKVCache, KVCache

from provider.engine import guided


class DecodeBatch(GenerationBatch):
    def __init__(self, *args, **kwargs) -> None:
        self._padding_read: tuple[mx.array | None, list[int]] = (None, [])  # see `_left_padding`
        super().__init__(*args, **kwargs)

    def _step(self) -> tuple[list[int], list[None]]:
        if any(self.logits_processors):
            if guided.only_guides(self.logits_processors):  # issue 31: grammar masks, log-probabilities
                return guided.step(self)
            return super()._step()
        self._current_tokens, self._current_logprobs = self._next_tokens, self._next_logprobs
        inputs = self._current_tokens
        logits = self.model(inputs[:, None], cache=self.prompt_cache)[:, -1, :]
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        samplers = [self.fallback_sampler if s is None else s for s in (self.samplers or [None] * len(self.uids))]
        if not samplers or all(s is samplers[0] for s in samplers):
            sampled = (samplers[0] if samplers else self.fallback_sampler)(logprobs)
        else:
            sampled = mx.concatenate([s(logprobs[e: e + 1]) for e, s in enumerate(samplers)], axis=0)
        self._next_tokens = sampled
        self._next_logprobs = [None] * len(self.uids)  # kept aligned for mlx-lm's filter / extend
        mx.async_eval(sampled)  # the next step runs while this one's tokens are read and delivered
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
            c.keys = mx.contiguous(layer.keys[idx: idx + 1, :, start: layer._idx])
            c.values = mx.contiguous(layer.values[idx: idx + 1, :, start: layer._idx])
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
            layer._idx -= shift
            layer.left_padding = mx.array(kept)  # from the host: nothing behind it to wait for
        self._padding_read = (caches[0].left_padding, kept)


def _batch_kv(cache: list) -> bool:
    return bool(cache) and all(type(c) is BatchKVCache for c in cache)


class PrefillBatch(PromptProcessingBatch):
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
            inputs = _right_pad_prompts(tokens, max_length=longest)
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

    def _copy(self) -> PrefillBatch:
        """mlx-lm's copy for `split`, with the batch caches' objects copied instead of their arrays."""
        cache = self.prompt_cache
        self.prompt_cache = []
        try:
            new = super()._copy()
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


class EngineBatchGenerator(BatchGenerator):
    """mlx-lm's `BatchGenerator` with the engine's prompt and decode batches."""

    def __init__(self, model, **kwargs) -> None:
        super().__init__(model, **kwargs)
        self._prompt_batch = PrefillBatch.empty(self.model, self.sampler, prefill_step_size=self.prefill_step_size)
        self._generation_batch = DecodeBatch.empty(self.model, self.sampler)


__all__ = ["DecodeBatch", "EngineBatchGenerator", "PrefillBatch"]
