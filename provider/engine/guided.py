"""Per-sequence grammar masks and log-probabilities inside the batched decode step.

A sequence that asks for either carries a `RowGuide`, which rides through mlx-lm's batch scheduling
as the sequence's one "logits processor" (mlx-lm keeps that list aligned with the batch through
every insert, split, filter and extend). `DecodeBatch.step` hands a batch holding guides to `step`
here; a batch without one takes the plain step, unchanged.

The step. A constrained sequence's mask for token n+1 depends on token n, which the plain step
reads only after it has scheduled step n+1 (the device computes the next step while the host reads
and delivers this one). Here the forward pass is scheduled first (`mx.async_eval(logprobs)`), then
the current tokens are read (they were computed during the previous step), each constrained
sequence's matcher consumes its token and fills its packed mask row (llguidance, microseconds on
the host, while the device runs the forward pass), and only the sampling waits for the masks. Plain
sequences in the same batch are untouched: their log-probabilities are the same array values, fed
to the same sampler calls in the same order as in the plain step, so each gets the tokens it would
get in a batch without guides.

Masking: the constrained rows' packed masks (one bit per token, `Constraint.fill`) are unpacked on
the host to a bool per token (microseconds) and go to the device with the step; disallowed tokens get -inf and
the row is renormalized (`logsumexp`), so a temperature or top-p sampler (and the log-probabilities
reported) see a distribution over the allowed tokens only; a batch whose constrained rows are all
greedy and report nothing skips that (the argmax is the same). Columns past the grammar's vocabulary (a model whose head is wider than its
tokenizer) are disallowed.

Log-probabilities: for the sequences that asked, the sampled token's log-probability and the
`top_logprobs` best alternatives (of the distribution it was sampled from: the model's, over what its
grammar allows; before temperature) are scheduled with the token and read with it the next step,
as mlx-lm's own step does for every sequence. Nothing is computed for a sequence that did not ask.

The first token. A sequence's first step in a batch has as input the prompt's last token (batched
prefill) or its first output token, sampled and consumed already by the solo prefill
(`first_token`): it consumes nothing (`RowGuide.fresh`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import greedy_sampler

from provider.engine.types import TokenLogprob

if TYPE_CHECKING:
    from provider.grammar import Constraint


@dataclass(slots=True, eq=False)
class RowGuide:
    """What one sequence asks of the decode step besides its token."""

    constraint: Constraint | None = None  # its grammar's matcher: masks, and the tokens it consumes
    top_logprobs: int | None = None  # None: no log-probabilities; else this many alternatives (0-20)
    fresh: bool = True  # its next step is its first in a batch: its input is not a token to consume


def guide_for(constraint: Constraint | None, top_logprobs: int | None) -> RowGuide | None:
    """A request's guide, or None for a plain request."""
    if constraint is None and top_logprobs is None:
        return None
    return RowGuide(constraint, top_logprobs)


def only_guides(processors: Sequence[Sequence[Any]]) -> bool:
    """Whether every logits processor of the batch is a `RowGuide` (the engine adds no other kind)."""
    return all(type(p) is RowGuide for row in processors for p in row)


def _guides(processors: Sequence[Sequence[Any]]) -> list[RowGuide | None]:
    return [row[0] if row else None for row in processors]


def step(batch) -> tuple[list[int], list[TokenLogprob | None]]:
    """`DecodeBatch.step` for a batch holding guides (module docstring)."""
    batch.current_tokens, batch.current_logprobs = batch.next_tokens, batch.next_logprobs
    inputs = batch.current_tokens
    logits = batch.model(inputs[:, None], cache=batch.prompt_cache)[:, -1, :]
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    guides = _guides(batch.logits_processors)
    constrained = [i for i, g in enumerate(guides) if g is not None and g.constraint is not None]
    tokens = None
    if constrained:
        mx.async_eval(logprobs)  # the forward pass runs while the tokens are read and the masks filled
        tokens = inputs.tolist()
        samplers = batch.samplers or [None] * len(guides)
        logprobs = _masked(logprobs, [(i, guides[i]) for i in constrained], tokens,
                           normalize=any(_normalizes(guides[i], samplers[i] or batch.fallback_sampler)
                                         for i in constrained))
    sampled = _sample(batch, logprobs)
    batch.next_tokens = sampled
    batch.next_logprobs = _asked(guides, logprobs, sampled)
    mx.async_eval(sampled, [p.arrays for p in batch.next_logprobs if p is not None])
    for guide in guides:
        if guide is not None:
            guide.fresh = False
    if tokens is None:
        tokens = inputs.tolist()
    for sequence, token in zip(batch.tokens, tokens):
        sequence.append(token)
    current = batch.current_logprobs or [None] * len(tokens)
    return tokens, [None if p is None else p.read(t) for p, t in zip(current, tokens)]


def first_token(guide: RowGuide, sampler, logprobs: mx.array) -> tuple[int, TokenLogprob | None]:
    """A solo-prefilled sequence's first token from its prompt's log-probabilities [1, vocab]: masked
    by its grammar (which then consumes it), with its log-probabilities if asked. Blocking."""
    if guide.constraint is not None:
        logprobs = _masked(logprobs, [(0, guide)], [0], normalize=_normalizes(guide, sampler))
    token = sampler(logprobs)
    pending = _asked([guide], logprobs, token)[0]
    token = int(token.item())
    if guide.constraint is not None:
        guide.constraint.consume(token)  # its first step in the batch takes this token as input: fresh
    return token, None if pending is None else pending.read(token)


def _sample(batch, logprobs: mx.array) -> mx.array:
    """The plain step's sampling (decode.DecodeBatch.step): one call when the batch shares a sampler."""
    samplers = [batch.fallback_sampler if s is None else s for s in (batch.samplers or [None] * len(batch.uids))]
    if not samplers or all(s is samplers[0] for s in samplers):
        return (samplers[0] if samplers else batch.fallback_sampler)(logprobs)
    return mx.concatenate([s(logprobs[e: e + 1]) for e, s in enumerate(samplers)], axis=0)


def _normalizes(guide: RowGuide, sampler) -> bool:
    """Whether a constrained row's masked scores must be renormalized: for its log-probabilities, and
    for a sampler that reads them as probabilities (top-p); greedy picks the same token either way."""
    return guide.top_logprobs is not None or sampler is not greedy_sampler


def _masked(logprobs: mx.array, rows: list[tuple[int, RowGuide]], tokens: list[int], normalize: bool) -> mx.array:
    """`logprobs` with each constrained row limited to what its grammar allows next (renormalized
    over it where `normalize`)."""
    vocab = logprobs.shape[-1]
    packed = np.zeros((len(rows), max(g.constraint.words for _, g in rows)), dtype=np.int32)
    for j, (i, guide) in enumerate(rows):
        if not guide.fresh:
            guide.constraint.consume(tokens[i])
        guide.constraint.fill(packed[j, : guide.constraint.words])
    # Unpacked here (microseconds; on the CPU backend a device gather costs more than the copy saves);
    # columns past a grammar's vocabulary unpack as zeros: nothing allowed there.
    bits = np.unpackbits(packed.view(np.uint8), axis=1, count=vocab, bitorder="little").view(np.bool_)
    index = mx.array([i for i, _ in rows])
    limited = mx.where(mx.array(bits), logprobs[index], -mx.inf)
    if normalize:
        limited = limited - mx.logsumexp(limited, axis=-1, keepdims=True)
    if len(rows) == logprobs.shape[0]:
        return limited
    logprobs[index] = limited  # the other rows keep their exact values
    return logprobs


class _Pending:
    """One sequence's log-probabilities, scheduled with its token and read with it next step."""

    __slots__ = ("arrays", "_row", "_k", "_batch")

    def __init__(self, batch: _PendingBatch, row: int, k: int) -> None:
        self._batch, self._row, self._k = batch, row, k
        self.arrays = batch.arrays

    def read(self, token: int) -> TokenLogprob:
        chosen, ids, values = self._batch.lists()
        top = tuple((t, v) for t, v in zip(ids[self._row][: self._k], values[self._row][: self._k])
                    if v != -float("inf"))
        return TokenLogprob(token, chosen[self._row], top)


class _PendingBatch:
    __slots__ = ("arrays", "_lists")

    def __init__(self, arrays: list[mx.array]) -> None:
        self.arrays = arrays
        self._lists: tuple[list, list, list] | None = None

    def lists(self) -> tuple[list, list, list]:
        if self._lists is None:  # read once for every row of the step
            chosen, ids, values = self.arrays
            self._lists = (chosen.tolist(), ids.tolist(), values.tolist())
        return self._lists


def _asked(guides: list[RowGuide | None], logprobs: mx.array, sampled: mx.array) -> list[_Pending | None]:
    """The log-probabilities to schedule for the sequences that asked (None for the others)."""
    rows = [i for i, g in enumerate(guides) if g is not None and g.top_logprobs is not None]
    out: list[_Pending | None] = [None] * len(guides)
    if not rows:
        return out
    index = mx.array(rows)
    scores = logprobs[index]
    chosen = mx.take_along_axis(scores, sampled.reshape(-1)[index][:, None], axis=-1)[:, 0]
    k = max(guides[i].top_logprobs for i in rows)
    if k > 0:
        ids = mx.argsort(-scores, axis=-1)[:, :k] if k >= scores.shape[-1] else \
            mx.argpartition(-scores, kth=k - 1, axis=-1)[:, :k]
        values = mx.take_along_axis(scores, ids, axis=-1)
        order = mx.argsort(-values, axis=-1)  # best first
        ids, values = mx.take_along_axis(ids, order, axis=-1), mx.take_along_axis(values, order, axis=-1)
    else:
        ids = values = mx.zeros((len(rows), 0))
    pending = _PendingBatch([chosen, ids, values])
    for j, i in enumerate(rows):
        out[i] = _Pending(pending, j, guides[i].top_logprobs)
    return out


__all__ = ["RowGuide", "first_token", "guide_for", "only_guides", "step"]
