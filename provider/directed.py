"""Models the coordinator asks for: ``load_model`` (and, later, ``prefetch_model`` and ``desired_models``).

A ``load_model`` goes through exactly the path a warm-up takes (``ModelManager.ensure_loaded``): the same
room plan and load gate, the same pending-load claim in the ledger, the same post-load guard. Its answer
is ``load_model_status`` ``started``, then ``succeeded`` or ``failed`` (docs/reference/protocol-messages.md
upstream); the heartbeat that follows a load goes out at once (``on_capacity_change``) and shows the slot
``running``. The ``error`` of a failure is a word of our closed vocabularies (the failure's reason), never
an exception's text; a refusal because we are draining says ``provider draining for update``, the string
the coordinator matches as transient (coordinator/protocol/heartbeat.go ``ProviderDrainingForUpdate``).
"""

from __future__ import annotations

from collections.abc import Callable

from protocol import DesiredModels, LoadModel, LoadModelStatus, PrefetchModel, encode
from protocol.errors import ErrorReason, Failure
from provider.slots import ModelManager, SlotRefused
from provider.telemetry import get_logger

log = get_logger("provider.directed")

DRAINING_FOR_UPDATE = "provider draining for update"
MAX_MODEL_ID_CHARS = 256  # the coordinator's id, echoed back: bounded like a request id

Send = Callable[[str], None]


def failure_word(failure: Failure) -> str:
    """The closed-vocabulary word a failed load reports: its reason, else its rejection, else its code."""
    if failure.reason is ErrorReason.DRAINING:
        return DRAINING_FOR_UPDATE
    for word in (failure.reason, failure.rejection, failure.code):
        if word is not None:
            return word.value
    return "model_load"


class ModelDirectives:
    """The agent's handler for coordinator-directed model frames (``Session(run_directive=...)``)."""

    def __init__(self, manager: ModelManager) -> None:
        self._manager = manager

    async def __call__(self, message: LoadModel | PrefetchModel | DesiredModels, send: Send) -> None:
        match message:
            case LoadModel():
                await self.load(message, send)
            case _:
                log.debug("frame_ignored", kind=message.type, reason="not_handled")

    async def load(self, message: LoadModel, send: Send) -> None:
        model_id = message.model_id
        if not model_id or len(model_id) > MAX_MODEL_ID_CHARS:
            log.warning("load_model_ignored", reason="bad_model_id")
            return
        send(encode(LoadModelStatus(model_id=model_id, status="started")))
        log.info("load_model_started", model=model_id)
        if self._manager.draining:
            failure: Failure | None = Failure.draining()
        else:
            try:
                await self._manager.ensure_loaded(model_id)
                failure = None
            except SlotRefused as refused:
                failure = refused.failure
        if failure is None:
            send(encode(LoadModelStatus(model_id=model_id, status="succeeded")))
            log.info("load_model_succeeded", model=model_id)
            return
        word = failure_word(failure)
        send(encode(LoadModelStatus(model_id=model_id, status="failed", error=word)))
        log.warning("load_model_failed", model=model_id, reason=word)


__all__ = ["DRAINING_FOR_UPDATE", "ModelDirectives", "failure_word"]
