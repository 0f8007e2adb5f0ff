"""A request admitted for a model that is loading waits for the load while the load makes progress
(provider/slots/manager.py `_wait_load`): `load_wait_timeout_s` counts from the load's last step (each
part of the weights read, each measurement, each check), not from the request's arrival. A load
that stops moving still refuses its waiters (503 capacity_timeout, retryable) and goes on.

Real engine, real manager, the tiny model (manager_rigs.py). The slow load is made with the manager's
fault hook: each of the load's steps takes a while, as on a slow disk or a busy machine.
"""

from __future__ import annotations

import asyncio

import pytest

from manager_rigs import serve_once
from protocol.errors import ErrorReason
from provider.slots import LoadStep, ModelState, SlotRefused

WAIT_S = 3.0  # load_wait_timeout_s here
STEP_S = 1.0  # what each of the load's steps takes: less than the wait (room for the engine's own work
# between two steps on a busy machine), four of them more


class SlowSteps:
    """A fault hook under which each step of a load takes `STEP_S` (a real delay: the load is slow)."""

    def __init__(self) -> None:
        self.steps: list[LoadStep] = []
        self.engine_loading = asyncio.Event()

    async def __call__(self, step: LoadStep, model_id: str) -> None:
        self.steps.append(step)
        if step is LoadStep.ENGINE_LOADING:
            self.engine_loading.set()
        await asyncio.sleep(STEP_S)


class StallAfterEngineLoad:
    """A fault hook that holds a load once the engine has loaded the model (weights read, measured,
    warmed: every step of it reported), until `go` is set."""

    def __init__(self) -> None:
        self.stalled, self.go = asyncio.Event(), asyncio.Event()

    async def __call__(self, step: LoadStep, model_id: str) -> None:
        if step is LoadStep.LOADED:
            self.stalled.set()
            await self.go.wait()


async def test_requests_wait_for_a_load_that_keeps_moving_longer_than_the_wait(rigs, tiny_model_path):
    make, _ = rigs
    slow = SlowSteps()
    rig = make({"tiny": tiny_model_path}, 100 * 10**6, fault=slow, load_wait_timeout_s=WAIT_S)
    m = rig.manager
    loop = asyncio.get_running_loop()
    started = loop.time()
    first = asyncio.create_task(serve_once(m, "r1", "tiny"))  # its booking starts the load
    await slow.engine_loading.wait()
    assert m.state("tiny") is ModelState.LOADING
    second = await serve_once(m, "r2", "tiny")  # arrives during the load, is admitted, waits for it
    assert (await first).usage.completion_tokens == 2 and second.usage.completion_tokens == 2
    assert loop.time() - started > WAIT_S  # four slow steps: the load took longer than the wait
    assert slow.steps == [LoadStep.CLAIMED, LoadStep.ENGINE_LOADING, LoadStep.LOADED, LoadStep.GUARD]


async def test_a_load_that_stops_moving_refuses_its_waiters_and_goes_on(rigs, tiny_model_path):
    make, _ = rigs
    stall = StallAfterEngineLoad()
    rig = make({"tiny": tiny_model_path}, 100 * 10**6, fault=stall, load_wait_timeout_s=WAIT_S)
    m = rig.manager
    with pytest.raises(SlotRefused) as exc:
        await serve_once(m, "r1", "tiny")
    assert stall.stalled.is_set()  # it moved until the engine's load ended, then stopped
    failure = exc.value.failure
    assert failure.reason is ErrorReason.CAPACITY_TIMEOUT and failure.status_code == 503
    assert m.state("tiny") is ModelState.LOADING and "kv:r1" not in rig.ledger
    stall.go.set()
    load_task = m._s.slots["tiny"].load_task
    assert load_task is not None and await asyncio.shield(load_task) is None
    assert m.state("tiny") is ModelState.LOADED
    await serve_once(m, "r2", "tiny")
