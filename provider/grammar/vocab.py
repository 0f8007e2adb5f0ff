"""A model's vocabulary as llguidance reads it: the tokenizer a grammar is compiled against, and
each token's bytes (what `logprobs` reports as `bytes`).

Built once per model from its Hugging Face fast tokenizer (`llguidance.hf.from_tokenizer` walks the
whole vocabulary: ~10 ms for the tiny model's 2k tokens, about a second for 150k), never on the
event loop. The EOS tokens are the model's (`TokenizerWrapper.eos_token_ids`, the engine's stop
tokens): a grammar lets one through only where its language may end. With it, the tokens that can
continue a number (`numbers.NumberIndex`: what holds constrained numbers to a double's digits).
"""

from __future__ import annotations

from typing import Any

import llguidance
import llguidance.hf

from provider.grammar.numbers import NumberIndex


class VocabUnavailable(ValueError):
    """The model's tokenizer is not one llguidance can read (not a fast tokenizer)."""


class TokenTable:
    """One model's llguidance tokenizer; thread-safe to read (immutable)."""

    __slots__ = ("tokenizer", "vocab_size", "eos_ids", "numbers")

    def __init__(self, tokenizer: llguidance.LLTokenizer, eos_ids: frozenset[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.vocab_size
        self.eos_ids = eos_ids
        self.numbers = NumberIndex.of(self.vocab_size, self.token_bytes)

    @classmethod
    def of(cls, wrapper: Any) -> TokenTable:
        """From mlx-lm's `TokenizerWrapper` (or a bare Hugging Face tokenizer). Blocking."""
        from provider.mlxlm import unwrapped  # imports mlx-lm, which a wrapper's owner has imported

        hf = unwrapped(wrapper)
        eos = frozenset(int(t) for t in (getattr(wrapper, "eos_token_ids", None) or ()))
        if not eos and getattr(hf, "eos_token_id", None) is not None:
            eos = frozenset({int(hf.eos_token_id)})
        try:
            table = llguidance.hf.from_tokenizer(hf, eos_token=sorted(eos) or None)
        except (ValueError, TypeError, AttributeError):
            raise VocabUnavailable() from None
        return cls(table, eos)

    def token_bytes(self, token: int) -> bytes:
        """The token's bytes (a piece of a UTF-8 character for some); b"" for an id outside the vocabulary."""
        if not 0 <= token < self.vocab_size:
            return b""
        return self.tokenizer.decode_bytes([token])

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.tokenize_str(text)


__all__ = ["TokenTable", "VocabUnavailable"]
