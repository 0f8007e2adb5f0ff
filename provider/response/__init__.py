"""provider/response: what both front doors answer, beside `provider.request` (what they read).

* ``openai`` — engine events -> OpenAI ``chat.completion(.chunk)`` and legacy ``text_completion``
  objects (``ChatChunks``, ``TextChunks``, ``chat_completion``, ``text_completion``)
* ``toolcalls`` — the tool calls read out of a completion's text as it streams (``ToolCallStream``)
* ``failures`` — an engine failure in the protocol's vocabulary, the same on both doors
"""
