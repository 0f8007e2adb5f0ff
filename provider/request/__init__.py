"""provider/request: the OpenAI chat request, below both front doors (the coordinator's jobs and the
local server), so each reads, validates and counts a body the same way.

* ``parse_chat_body`` / ``ChatBody`` — the one validator of a chat body (body.py),
  ``parse_completion_body`` / ``CompletionBody`` for the legacy completions endpoint
* ``InvalidBody`` — what every parser here raises for a body we cannot run (errors.py)
* ``params`` — the OpenAI parameters we cannot honour (a 400 naming them) or ignore, in one table
* ``PromptCounter`` — prompt token counts for admission, before the model is loaded (tokens.py)
* ``serving.Pipeline`` — one request served: intake, images, count, output plan, booking, the
  engine's ``ChatRequest`` (serving.py; imported on its own, it needs the model manager)
"""

from provider.request.body import ChatBody, CompletionBody, parse_chat_body, parse_completion_body
from provider.request.errors import InvalidBody
from provider.request.tokens import PromptCounter, PromptError, TokenizerLoader, UnknownModel

__all__ = ["ChatBody", "CompletionBody", "InvalidBody", "PromptCounter", "PromptError", "TokenizerLoader",
           "UnknownModel", "parse_chat_body", "parse_completion_body"]
