"""A job's lifecycle as data (after h11's ``_state.py``).

Rule 1: everything that decides which frame a request may send next lives in ``TRANSITIONS``.

    OPEN ──admit──▶ ADMITTED ──accept──▶ ACCEPTED ──chunk──▶ STREAMING ──chunk──▶ STREAMING
      │                │                    │                   │
      └──fail──────────┴──fail──────────────┴──fail─────────────┴──fail──▶ FAILED
      └──cancel────────┴──cancel────────────┴──cancel───────────┴──cancel▶ CANCELLED
                                                                STREAMING ──complete──▶ COMPLETED

* ``fail`` from OPEN is a fast reject (an ``inference_error`` with no ``inference_accepted`` before it:
  undecryptable body, unknown model, no capacity); from later states it is the one error frame that
  ends an accepted request.
* ``complete`` is legal only after at least one chunk, so ``inference_complete`` always follows the
  stream it closes.
* COMPLETED, FAILED and CANCELLED are terminal: no event is legal there, so a second terminal frame —
  or any frame after a cancel — raises ``JobStateError`` instead of reaching the wire.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum, IntEnum
from types import MappingProxyType

from provider.telemetry import get_logger

log = get_logger("provider.jobs")


class JobState(IntEnum):
    OPEN = 0  # frame received, body not yet judged
    ADMITTED = 1  # fast admission said yes
    ACCEPTED = 2  # inference_accepted sent
    STREAMING = 3  # at least one chunk sent
    COMPLETED = 4  # inference_complete sent
    FAILED = 5  # inference_error sent
    CANCELLED = 6  # cancelled by the coordinator or by a lost connection: nothing more is sent

    @property
    def terminal(self) -> bool:
        return self >= JobState.COMPLETED


class JobEvent(Enum):
    ADMIT = "admit"
    ACCEPT = "accept"  # sends inference_accepted
    CHUNK = "chunk"  # sends one inference_response_chunk
    COMPLETE = "complete"  # sends inference_complete
    FAIL = "fail"  # sends inference_error
    CANCEL = "cancel"  # sends nothing


def _table(rows: dict[JobState, dict[JobEvent, JobState]]) -> Mapping[JobState, Mapping[JobEvent, JobState]]:
    return MappingProxyType({state: MappingProxyType(row) for state, row in rows.items()})


_S, _E = JobState, JobEvent
TRANSITIONS: Mapping[JobState, Mapping[JobEvent, JobState]] = _table({
    _S.OPEN: {_E.ADMIT: _S.ADMITTED, _E.FAIL: _S.FAILED, _E.CANCEL: _S.CANCELLED},
    _S.ADMITTED: {_E.ACCEPT: _S.ACCEPTED, _E.FAIL: _S.FAILED, _E.CANCEL: _S.CANCELLED},
    _S.ACCEPTED: {_E.CHUNK: _S.STREAMING, _E.FAIL: _S.FAILED, _E.CANCEL: _S.CANCELLED},
    _S.STREAMING: {_E.CHUNK: _S.STREAMING, _E.COMPLETE: _S.COMPLETED, _E.FAIL: _S.FAILED,
                   _E.CANCEL: _S.CANCELLED},
    _S.COMPLETED: {},
    _S.FAILED: {},
    _S.CANCELLED: {},
})


class JobStateError(AssertionError):
    """An illegal step, e.g. a second terminal frame: a bug in the job, never sent to the wire."""


class JobLifecycle:
    """The state of one request; ``step(event)`` is the only way it changes."""

    __slots__ = ("_state",)

    def __init__(self) -> None:
        self._state = JobState.OPEN

    @property
    def state(self) -> JobState:
        return self._state

    @property
    def terminal(self) -> bool:
        return self._state.terminal

    def step(self, event: JobEvent) -> JobState:
        """Apply ``event``; raises ``JobStateError`` naming the event and state when it is not legal."""
        new = TRANSITIONS[self._state].get(event)
        if new is None:
            raise JobStateError(f"{event.value} is not allowed in state {self._state.name}")
        if new is not self._state:
            log.debug("job_state", from_state=self._state.name, to_state=new.name)
        self._state = new
        return new


__all__ = ["TRANSITIONS", "JobEvent", "JobLifecycle", "JobState", "JobStateError"]
