"""A text request's states in the engine (provider/engine/lifecycle.py): the table, and the path each
kind of request takes through it on the tiny model (batched, prefilled alone, one token, cancelled
before it starts or while it decodes), each released exactly once."""

from __future__ import annotations

import asyncio

import pytest

from engine_reference import NO_EOS, PROMPTS, greedy, messages
from provider.engine import ChatRequest, Engine, Finished, lifecycle, worker
from provider.engine.lifecycle import (
    TRANSITIONS,
    RequestEvent,
    RequestLifecycle,
    RequestState,
    RequestStateError,
)

W, P, D, F, R = (RequestState.WAITING, RequestState.PREFILLING, RequestState.DECODING, RequestState.FINISHING,
                 RequestState.RELEASED)
SERVED = [(W, P), (P, D), (D, F), (F, R)]


def test_a_served_request_walks_the_table_and_ends_released():
    request = RequestLifecycle("r")
    assert request.state is W
    steps = [RequestEvent.START, RequestEvent.TOKEN, RequestEvent.TOKEN, RequestEvent.END, RequestEvent.RELEASE]
    assert [request.step(e) for e in steps] == [P, D, D, F, R]
    assert request.state.terminal and not TRANSITIONS[R]


@pytest.mark.parametrize("state", list(RequestState))
def test_every_event_outside_the_table_raises_naming_it_and_the_state(state):
    for event in RequestEvent:
        if event in TRANSITIONS[state]:
            continue
        request = RequestLifecycle("r")
        request._state = state  # placed there directly: only the table's own rows are under test
        with pytest.raises(RequestStateError, match=f"{event.value} is not allowed in state {state.name}"):
            request.step(event)
        assert request.state is state  # an illegal step changes nothing


def test_an_end_is_legal_until_the_end_is_decided_and_a_release_only_after_it():
    assert [s for s in RequestState if RequestEvent.END in TRANSITIONS[s]] == [W, P, D]
    assert [s for s in RequestState if RequestEvent.RELEASE in TRANSITIONS[s]] == [F]
    assert issubclass(RequestStateError, AssertionError)  # a bug in the engine, never a request's fault


@pytest.fixture
def transitions(monkeypatch):
    """Every state change of the engine's requests, by request id, as the engine thread makes them."""
    seen: dict[str, list[tuple[RequestState, RequestState]]] = {}
    step = lifecycle.RequestLifecycle.step

    def recorded(me: RequestLifecycle, event: RequestEvent) -> RequestState:
        before = me.state
        after = step(me, event)
        if after is not before:
            seen.setdefault(me.request_id, []).append((before, after))
        return after

    monkeypatch.setattr(lifecycle.RequestLifecycle, "step", recorded)
    return seen


class Releases:
    """The `on_released` hook: each request id, in order, and an event per id for the test to wait on."""

    def __init__(self) -> None:
        self.ids: list[str] = []
        self._loop = asyncio.get_running_loop()
        self._done: dict[str, asyncio.Event] = {}

    def __call__(self, request_id: str) -> None:  # on the engine thread
        self.ids.append(request_id)
        self._loop.call_soon_threadsafe(self.event(request_id).set)

    def event(self, request_id: str) -> asyncio.Event:
        return self._done.setdefault(request_id, asyncio.Event())


@pytest.mark.parametrize("solo_min_tokens", [0, 1], ids=["batched", "alone"])
async def test_served_requests_go_waiting_prefilling_decoding_finishing_released(tiny_model_path, transitions,
                                                                                 solo_min_tokens):
    releases = Releases()
    phases = []
    async with Engine(solo_min_tokens=solo_min_tokens, trace=lambda model, request, phase: phases.append(phase)) \
            as engine:
        await engine.load("m", tiny_model_path, eos_token_ids=NO_EOS)
        streams = [engine.submit("m", ChatRequest(f"r{n}", messages(PROMPTS[n]), greedy(n)), on_released=releases)
                   for n in (1, 3)]  # one token (its first is its last), and three
        ends = [(await s.collect())[1] for s in streams]
        assert [len(e.completion_ids) for e in ends if isinstance(e, Finished)] == [1, 3]
        assert engine.stats("m").num_running == 0
    assert transitions == {"r1": SERVED, "r3": SERVED}
    assert sorted(releases.ids) == ["r1", "r3"]
    assert ("solo" in phases) is bool(solo_min_tokens)  # the prompts were prefilled alone, or in the batch


async def test_a_request_cancelled_while_it_decodes_is_released_once(tiny_model_path, transitions):
    releases = Releases()
    async with Engine() as engine:
        await engine.load("m", tiny_model_path, eos_token_ids=NO_EOS)
        stream = engine.submit("m", ChatRequest("c", messages(PROMPTS[1]), greedy(400)), on_released=releases)
        await anext(stream)  # its first text: it decodes
        assert (engine.stats("m").num_running, engine.stats("m").num_waiting) == (1, 0)  # counted by its state
        await stream.aclose()
        await releases.event("c").wait()
    assert transitions["c"] == SERVED  # a cancel ends it as a finish does (if it was not done already)
    assert releases.ids == ["c"]


async def test_a_request_cancelled_before_it_starts_goes_from_waiting_to_released(tiny_model_path, transitions,
                                                                                 monkeypatch):
    start = worker.Worker._start

    def held(me, slot, active):  # "held" never starts: it stays first in its model's queue
        return False if active.request_id == "held" else start(me, slot, active)

    monkeypatch.setattr(worker.Worker, "_start", held)
    releases = Releases()
    async with Engine() as engine:
        await engine.load("m", tiny_model_path, eos_token_ids=NO_EOS)
        waiting = engine.submit("m", ChatRequest("held", messages(PROMPTS[0]), greedy(4)), on_released=releases)
        behind = engine.submit("m", ChatRequest("next", messages(PROMPTS[1]), greedy(2)), on_released=releases)
        await waiting.aclose()
        _, end = await behind.collect()  # the queue moves on once the request before it is gone
    assert isinstance(end, Finished) and len(end.completion_ids) == 2
    assert transitions["held"] == [(W, F), (F, R)] and transitions["next"] == SERVED
    assert releases.ids == ["held", "next"]
