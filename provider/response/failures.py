"""An engine failure in the protocol's vocabulary: one table, read by both front doors.

The engine says why a request ended without finishing in its own closed vocabulary
(`provider.engine.EngineFailure`, on a `Failed` event or an `EngineError`); a client is told a
`protocol.errors.Failure`. `ENGINE_FAILURES` is the one mapping between them, so the coordinator's
door (an `inference_error` frame) and the local server (an HTTP status and OpenAI's error object,
both derived from the same `Failure`) give the same answer for the same engine failure.

The table lives here rather than in `protocol.errors` because its keys are the engine's type:
`protocol` never imports `provider`, and a table keyed by strings there would not notice a code the
engine adds. It covers every `EngineFailure` (a test checks), so the fallback, `Failure.internal()`,
is for a value that is not an engine failure at all.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

from protocol.errors import Failure
from provider.engine.types import EngineError, EngineFailure

ENGINE_FAILURES: Mapping[EngineFailure, Callable[[], Failure]] = MappingProxyType({
    EngineFailure.REQUEST_EXCEEDS_CONTEXT: Failure.request_exceeds_context,  # 400, not retried
    EngineFailure.INVALID_REQUEST: Failure.invalid_request,  # 400
    # The model is gone or never came (unloaded under the request, a load the engine refused at a
    # submit): 503, another provider (or, locally, a retry) may have it. A load that fails in the model
    # manager's load is remembered there and answered `Failure.model_load_failed()` (404) instead.
    EngineFailure.MODEL_NOT_LOADED: Failure.model_unloaded,
    EngineFailure.MODEL_UNLOADED: Failure.model_unloaded,
    EngineFailure.LOAD_FAILED: Failure.model_unloaded,
    EngineFailure.ENGINE_CLOSED: Failure.draining,  # the engine stopped under it: a drain ran out
    EngineFailure.MODEL_ALREADY_LOADED: Failure.internal,  # the manager loads a model once: a bug
    EngineFailure.INTERNAL_ERROR: Failure.generation_failed,  # 500, counts against this provider
})


def engine_failure(code: EngineFailure) -> Failure:
    """What a client is told for an engine failure, on either door."""
    make = ENGINE_FAILURES.get(code)
    return Failure.internal() if make is None else make()


def exception_failure(exc: BaseException) -> Failure | None:
    """A failure the manager or engine raised on purpose (a `failure` it carries, or an
    `EngineError`), None for anything unexpected (a bug: the caller logs it and answers
    `Failure.internal()`)."""
    failure = getattr(exc, "failure", None)
    if isinstance(failure, Failure):
        return failure
    if isinstance(exc, EngineError):
        return engine_failure(exc.code)
    return None


__all__ = ["ENGINE_FAILURES", "engine_failure", "exception_failure"]
