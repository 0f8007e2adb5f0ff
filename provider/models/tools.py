"""Whether a model calls tools, and how its family writes a call: what mlx-lm says.

mlx-lm's tokenizer loader (`mlx_lm.tokenizer_utils.load`) recognises a model family's tool-call
format from its chat template or vocabulary (or `tool_parser_type` in its tokenizer config) and
gives the `TokenizerWrapper` the family's parser from `mlx_lm/tool_parsers/`: `has_tool_calling`,
the text that opens and closes a call (`tool_call_start`, `tool_call_end`; an empty end: a call runs
to the end of the output) and `tool_parser(text, tools)`, which turns one call's text into
``{"name", "arguments"}`` (or a list of them). A model whose family has none cannot be offered tools:
its template does not render them, and nothing could read its calls.

`ToolFormat.of(tokenizer)` is that answer for the prompt counter (a request's `tools` are refused at
once for a model without), for the output side (`provider.response.toolcalls` reads calls with the
same parser) and for `doctor` (`models.template_check`), so all three agree.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

ToolParser = Callable[[str, Any], Any]


@dataclass(frozen=True, slots=True)
class ToolFormat:
    """A family's tool calls: `name` is mlx-lm's parser module (``json_tools``, ``mistral``...)."""

    name: str
    start: str
    end: str  # "" : a call runs to the end of the output
    parse: ToolParser

    @classmethod
    def of(cls, tokenizer: Any) -> ToolFormat | None:
        """The format mlx-lm found for this tokenizer (its `TokenizerWrapper`); None when it found none
        (or `tokenizer` is not one of mlx-lm's, e.g. a vision model's processor)."""
        if not getattr(tokenizer, "has_tool_calling", False):
            return None
        parse, start = getattr(tokenizer, "tool_parser", None), getattr(tokenizer, "tool_call_start", None)
        if not callable(parse) or not isinstance(start, str) or not start:
            return None
        end = getattr(tokenizer, "tool_call_end", None) or ""
        name = getattr(parse, "__module__", "").rpartition(".")[2] or "unknown"
        return cls(name, start, end if isinstance(end, str) else "", parse)


__all__ = ["ToolFormat", "ToolParser"]
