"""provider/request: the OpenAI chat request, below both front doors (the coordinator's jobs and the
local server), so each reads, validates and counts a body the same way.

* ``parse_chat_body`` / ``ChatBody`` / ``InvalidBody`` — the one validator of a chat body (body.py)
* ``PromptCounter`` — prompt token counts for admission, before the model is loaded (tokens.py)
"""

from provider.request.body import ChatBody, InvalidBody, parse_chat_body
from provider.request.tokens import PromptCounter, PromptError, TokenizerLoader, UnknownModel

__all__ = ["ChatBody", "InvalidBody", "PromptCounter", "PromptError", "TokenizerLoader", "UnknownModel",
           "parse_chat_body"]
