"""A text request's lifecycle in the engine, as data (as provider/jobs/lifecycle.py is a job's).

Rule 1: which phase a request is in is its `RequestState`, changed only by `RequestLifecycle.step`
through `TRANSITIONS`. Its model's `Slot` (active.py) holds it in a collection for scheduling (the
queue, the prompt prefilled alone, the ready list, the batch by uid): that says where it is held,
not what phase it is in.

    WAITING ──start──▶ PREFILLING ──token──▶ DECODING ──token──▶ DECODING
       │                   │                    │
       └──end──────────────┴──end───────────────┴──end──▶ FINISHING ──release──▶ RELEASED

* WAITING: admitted, in its model's queue; nothing computed for it yet.
* PREFILLING: its prompt is being prefilled: alone (`Slot.solo`), or inserted into the batch, before
  its first token.
* DECODING: its first token is out; each next one comes from the batch's decode step (a prompt
  prefilled alone waits in `Slot.ready` to join the batch at its next step).
* FINISHING: its end is decided: a finish (EOS, a stop string, its length), a failure or a cancel.
  It leaves the batch, its sequence may be kept for the prefix cache, its terminal event goes out.
* RELEASED: it is forgotten and its owner told that its memory is free (`on_released`), once; no
  event is legal there.

A token that ends a request is a `token`, then an `end` (a first token can be the last one:
PREFILLING, DECODING, FINISHING). An illegal step, such as a second release, raises
`RequestStateError`, which names the event and the state.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum, IntEnum
from types import MappingProxyType

from provider.telemetry import get_logger

log = get_logger("provider.engine")


class RequestState(IntEnum):
    WAITING = 0  # in its model's queue
    PREFILLING = 1  # its prompt being prefilled, alone or in the batch
    DECODING = 2  # its first token out
    FINISHING = 3  # its end decided
    RELEASED = 4  # forgotten, its owner told

    @property
    def terminal(self) -> bool:
        return self is RequestState.RELEASED


class RequestEvent(Enum):
    START = "start"  # its prefill starts: alone, or inserted into the batch
    TOKEN = "token"  # a token of its output
    END = "end"  # a finish, a failure or a cancel
    RELEASE = "release"  # out of the engine, its owner told


def _table(rows: dict[RequestState, dict[RequestEvent, RequestState]]
           ) -> Mapping[RequestState, Mapping[RequestEvent, RequestState]]:
    return MappingProxyType({state: MappingProxyType(row) for state, row in rows.items()})


_S, _E = RequestState, RequestEvent
TRANSITIONS: Mapping[RequestState, Mapping[RequestEvent, RequestState]] = _table({
    _S.WAITING: {_E.START: _S.PREFILLING, _E.END: _S.FINISHING},
    _S.PREFILLING: {_E.TOKEN: _S.DECODING, _E.END: _S.FINISHING},
    _S.DECODING: {_E.TOKEN: _S.DECODING, _E.END: _S.FINISHING},
    _S.FINISHING: {_E.RELEASE: _S.RELEASED},
    _S.RELEASED: {},
})


class RequestStateError(AssertionError):
    """An illegal step, e.g. a second release: a bug in the engine."""


class RequestLifecycle:
    """The state of one request; `step(event)` is the only way it changes."""

    __slots__ = ("_state", "request_id")

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._state = RequestState.WAITING

    @property
    def state(self) -> RequestState:
        return self._state

    def step(self, event: RequestEvent) -> RequestState:
        """Apply `event`; raises `RequestStateError` naming the event and state when it is not legal."""
        new = TRANSITIONS[self._state].get(event)
        if new is None:
            raise RequestStateError(f"{event.value} is not allowed in state {self._state.name}")
        if new is not self._state:
            log.debug("request_state", request_id=self.request_id, from_state=self._state.name, to_state=new.name)
            self._state = new
        return new


__all__ = ["TRANSITIONS", "RequestEvent", "RequestLifecycle", "RequestState", "RequestStateError"]
