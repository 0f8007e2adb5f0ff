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
context it keeps). `Response.logprobs` is None for the steps taken here.

`EngineBatchGenerator` is mlx-lm's `BatchGenerator` with a `DecodeBatch` as its generation batch: new
sequences are prefilled and take their first step as mlx-lm does, then `extend` merges them into it.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, GenerationBatch


class DecodeBatch(GenerationBatch):
    def _step(self) -> tuple[list[int], list[None]]:
        if any(self.logits_processors):
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


class EngineBatchGenerator(BatchGenerator):
    """mlx-lm's `BatchGenerator` stepping its decode batch with `DecodeBatch`."""

    def __init__(self, model, **kwargs) -> None:
        super().__init__(model, **kwargs)
        self._generation_batch = DecodeBatch.empty(self.model, self.sampler)


__all__ = ["DecodeBatch", "EngineBatchGenerator"]
