"""The local HTTP server: OpenAI-compatible chat and legacy completions on 127.0.0.1, plus /healthz,
/status and /metrics.

* `app.create_app(backend, metrics, chat=...)` -- the FastAPI app (chat=False: status endpoints only,
  for the coordinator agent to run beside its WebSocket);
* `backend.RuntimeBackend` -- the shared `provider.runtime.Runtime` (manager admission, prompt counter);
* `errors` -- every error in OpenAI's shape (404/405 included), and the CORS middleware;
* the request body and its prompt count come from `provider.request` (shared with the coordinator path);
* `server.serve_local(settings)` -- `darkbloom-provider serve --local`;
* `server.StatusEndpoint.start(runtime, settings)` -- the status endpoints beside the agent's session.
"""
