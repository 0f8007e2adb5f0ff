"""provider/grammar: constrained output with llguidance.

* `formats`  `response_format` as a grammar (json_object, json_schema), checked without a tokenizer
* `tools`    the grammar of a forced tool call, in the model's tool-call format
* `vocab`    `TokenTable`: a model's vocabulary as llguidance reads it (and each token's bytes)
* `compiled` `GrammarCache` (compiled grammars, bounded LRU) and `Constraint` (one request's matcher)
* `numbers`  numbers held to what a double carries (17 digits, a 3-digit exponent), so answers close

The engine applies a `Constraint`'s masks inside the batched decode step (`provider/engine/guided.py`);
the intake compiles it and reserves its memory (`provider/request/output.py`, `memory/grammar.py`).

Why llguidance: it is already installed (mlx-vlm's structured output uses it), it compiles a JSON
schema in milliseconds with no per-vocabulary preprocessing beyond the token table, and computes a
mask in microseconds on the CPU (tiny model: 11 us median; 50-property schema: 2.5 us), with no
token-by-token Python. xgrammar and outlines-core were not measured: neither is installed, and
llguidance already meets the figures asked (benchmarks/grammar_bench.py).
"""

from provider.grammar.compiled import MAX_ENTRIES, Constraint, GrammarCache
from provider.grammar.formats import GrammarRejected, check, json_object_grammar, json_schema_grammar
from provider.grammar.tools import ToolCallFormat, ToolGrammarUnsupported, grammar_for_tool_call
from provider.grammar.vocab import TokenTable, VocabUnavailable

__all__ = [
    "MAX_ENTRIES",
    "Constraint",
    "GrammarCache",
    "GrammarRejected",
    "TokenTable",
    "ToolCallFormat",
    "ToolGrammarUnsupported",
    "VocabUnavailable",
    "check",
    "grammar_for_tool_call",
    "json_object_grammar",
    "json_schema_grammar",
]
