"""A constrained request's memory besides its KV, as one bounded figure.

A request whose output a grammar constrains (`response_format` json_object / json_schema, a forced
tool call) holds, from its intake to the moment the engine drops it:

* its grammar's matcher: llguidance's compiled grammar, its Earley parser rows (bounded per step by
  the parser limits) and its lexer, whose DFA grows lazily while masks are computed, at most
  `MAX_LEXER_STATES` states (the limit the compiler is given; llguidance puts one state at 1-2 kB).
  Measured (ours): a 50-property schema on a 6k-token vocabulary is 1.3 MB compiled and 5 MB after
  3000 masks; copies of one compiled grammar share its lexer.
* its mask rows: the packed bitmask on the host and its copy on the device (vocab / 8 bytes each),
  and in the step, the unpacked row (a bool per token) and its masked and renormalized
  log-probabilities (two floats per token).

`grammar_bytes` is that bound; the intake reserves it (`ReservationKind.GRAMMAR`) before the grammar
is compiled, and the engine releases it when the request leaves. No I/O.
"""

from __future__ import annotations

MiB = 2**20

MAX_LEXER_STATES = 8192  # llguidance's default is 250_000 (0.5 GB at 2 kB a state): far past any JSON schema
LEXER_STATE_BYTES = 2048  # llguidance: "approx 1-2 kB per state"
GRAMMAR_FIXED_BYTES = 4 * MiB  # the compiled grammar and the parser's rows (measured 1.3 MB for 50 properties)
MASK_BYTES_PER_TOKEN = 1 + 4 + 4  # the unpacked row, the masked row, the renormalized row (float32)


def grammar_bytes(vocab_size: int) -> int:
    """What one constrained request may hold for its grammar, for a model of `vocab_size` tokens."""
    vocab = max(0, vocab_size)
    packed = 2 * 4 * ((vocab + 31) // 32)  # host bitmask row + its device copy
    return GRAMMAR_FIXED_BYTES + MAX_LEXER_STATES * LEXER_STATE_BYTES + packed + MASK_BYTES_PER_TOKEN * vocab


__all__ = ["GRAMMAR_FIXED_BYTES", "LEXER_STATE_BYTES", "MAX_LEXER_STATES", "grammar_bytes"]
