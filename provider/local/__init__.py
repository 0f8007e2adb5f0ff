"""The local HTTP server: OpenAI-compatible chat on 127.0.0.1, plus /healthz, /status and /metrics.

* `app.create_app(backend, metrics, chat=...)` -- the FastAPI app (chat=False: status endpoints only,
  for the coordinator agent to run beside its WebSocket);
* `backend.EngineBackend` -- models on the engine, admitted through the memory ledger;
* `body.parse_chat_body` -- the one OpenAI request-body parser;
* `server.serve_local(settings)` -- `darkbloom-provider serve --local`.
"""
