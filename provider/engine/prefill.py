"""Solo prefill: one prompt prefilled by itself, its first token taken from the prompt's own pass.

mlx-lm's `BatchGenerator` prefills every waiting prompt together and gives each its first token
only after the whole group's prefill plus one more one-token pass over the group. Where a prefill
pass costs about what its tokens cost (measured on the CPU backend with the medium tiny model:
eight [1, 110] passes within 3 % of one [8, 110] pass), the group buys nothing, and prefilling the
prompts one at a time lets each first token go out as soon as that prompt's own pass ends: in a
burst of eight, the median first token comes after about half the burst's prefill instead of
after all of it. The worker (`worker.py`, "Solo prefill") holds the decode batch while a burst is
prefilled this way (bounded), so the batch then decodes all of it together, as it would have.

Three facts make it cost nothing:

* `SplitHead`: the first token's logits come from the same pass as the prompt, the backbone's last
  hidden state through the head only (mlx-lm runs the last prompt token as a second, one-token
  pass). Used only when the model's logits are exactly head(backbone(x)), checked at load on a
  probe; a model that post-processes its logits (soft-capping, a scale) keeps mlx-lm's path.
* `for_batch`: the prompt's KV joins the batch with its buffer rounded up to whole 256-token blocks,
  as a prompt prefilled inside the batch has it, so the batch grows block by block as it would
  have (mlx-lm's merge keeps exactly the tokens, and every later growth stays off the blocks).
* `solo_threshold`: a prompt goes solo only when its own pass is long enough that the pass's
  fixed cost (reading the weights) is a small part of it, from passes timed at load
  (calibration.py, on the load's budget). On a GPU the fixed cost dominates a short prompt's pass
  and prompts keep being batched as mlx-lm does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache

from provider.engine.budget import PassCosts

PREFILL_STEP = 2048  # mlx-lm's prefill_step_size: prompt tokens per pass, and per hold (worker.py)
FIXED_SHARE = 0.1  # solo only when the pass's fixed cost is at most this share of it
# The probe compares what follows the backbone, which is the same for every position: one token (a
# pass costs seconds a token for a 4-bit model on a CPU). A token id any vocabulary has.
PROBE = [1]


@dataclass(frozen=True, slots=True)
class SplitHead:
    """A causal LM as backbone (tokens -> hidden states, filling the cache) and head (hidden -> logits)."""

    backbone: Callable[..., mx.array]
    head: Callable[[mx.array], mx.array]

    def last_logprobs(self, tokens: Sequence[int], cache: list) -> mx.array:
        """Prefill `tokens` into `cache` and return the log-probabilities after the last one, [1, vocab]
        (lazy: the caller evaluates them with the cache)."""
        hidden = self.backbone(mx.array([list(tokens)]), cache=cache)
        logits = self.head(hidden[:, -1:, :])[:, -1, :]
        return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def head_parts(model: nn.Module) -> SplitHead | None:
    """The model's backbone and head, if it has both (whether its logits are the head of the backbone
    is `same_logits`'s question)."""
    backbone = getattr(model, "model", None)
    head = getattr(model, "lm_head", None)
    if head is None:  # tied embeddings: the input embedding is the head
        head = getattr(getattr(backbone, "embed_tokens", None), "as_linear", None)
    if not callable(backbone) or not callable(head):
        return None
    return SplitHead(backbone, head)


def model_logprobs(model: nn.Module, tokens: Sequence[int], cache: list) -> mx.array:
    """The whole model's log-probabilities after the last of `tokens`, [1, vocab] (lazy)."""
    full = model(mx.array([list(tokens)]), cache=cache)[:, -1, :]
    return full - mx.logsumexp(full, axis=-1, keepdims=True)


def same_logits(full: mx.array, parts: mx.array) -> bool:
    """The probe's verdict: the model's own log-probabilities and its head's of its backbone agree."""
    return full.shape == parts.shape and mx.allclose(full, parts, rtol=1e-3, atol=1e-3).item()


def split_head(model: nn.Module) -> SplitHead | None:
    """The model's backbone and head when its logits are exactly head(backbone(x)), else None (the
    probe in one step; a load runs its two passes on its budget, calibration.py)."""
    split = head_parts(model)
    if split is None:
        return None
    try:
        full = model_logprobs(model, PROBE, make_prompt_cache(model))
        parts = split.last_logprobs(PROBE, make_prompt_cache(model))
        mx.eval(full, parts)
    except Exception:  # an architecture whose parts take other arguments: mlx-lm's path
        return None
    return split if same_logits(full, parts) else None


def solo_threshold(costs: PassCosts) -> int:
    """Fewest prompt tokens for which a pass's fixed cost is at most FIXED_SHARE of the pass."""
    if costs.per_token_s <= 0:
        return PREFILL_STEP
    tokens = costs.fixed_s * (1 - FIXED_SHARE) / (FIXED_SHARE * costs.per_token_s)
    return max(1, min(PREFILL_STEP, math.ceil(tokens)))


class SoloPrefill:
    """One prompt's prefill, a chunk at a time (`step`), into its own cache."""

    def __init__(self, model: nn.Module, split: SplitHead, cache: list, tokens: Sequence[int],
                 chunk: int = PREFILL_STEP) -> None:
        if not tokens:
            raise ValueError("nothing to prefill")
        self.cache = cache
        self._model = model
        self._split = split
        self._rest = list(tokens)
        self._chunk = chunk

    def step(self) -> tuple[int, mx.array | None]:
        """Prefill the next chunk: (tokens processed, None), or for the last chunk the
        log-probabilities of the first output token, evaluated with the cache."""
        if len(self._rest) > self._chunk:
            part, self._rest = self._rest[: self._chunk], self._rest[self._chunk:]
            self._model(mx.array([part]), cache=self.cache)  # the logits stay lazy: never computed
            mx.eval([c.state for c in self.cache])
            mx.clear_cache()
            return len(part), None
        part, self._rest = self._rest, []
        logprobs = self._split.last_logprobs(part, self.cache)
        mx.eval(logprobs, [c.state for c in self.cache])
        return len(part), logprobs


class _JoiningKV(KVCache):
    """A prompt's KV on its way into the batch (`for_batch`): merged with block-rounded capacity."""

    @classmethod
    def merge(cls, caches):
        batch = BatchKVCache.merge(caches)
        pad = -max(c.size() for c in caches) % BatchKVCache.step
        if pad and batch.keys is not None:
            widths = [(0, 0), (0, 0), (0, pad), (0, 0)]  # room after the last token: not padding
            batch.keys, batch.values = mx.pad(batch.keys, widths), mx.pad(batch.values, widths)
        return batch


def for_batch(cache: list) -> list:
    """`cache` as `BatchGenerator.insert` should get it (the arrays shared, nothing copied)."""
    if not all(type(c) is KVCache for c in cache):
        return cache  # other layer kinds merge as mlx-lm merges them
    out = []
    for layer in cache:
        joining = _JoiningKV()
        joining.keys, joining.values, joining.offset = layer.keys, layer.values, layer.offset
        out.append(joining)
    return out
