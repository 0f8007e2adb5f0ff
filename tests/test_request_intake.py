"""provider.request.intake and lanes: large bodies in their own lane, with their working memory in the
ledger until the thread is really done with them."""

from __future__ import annotations

import asyncio
import gc
import threading
import weakref
from pathlib import Path

import pytest

from intake_fakes import Manager, ledger_of
from protocol.errors import ErrorReason, FailureCode, RejectionReason
from provider.engine.options import DEFAULT_BATCH_SIZE
from provider.request import PromptCounter
from provider.request.intake import INLINE_BYTES, Intake, Refusal, working_bytes
from provider.request.lanes import LARGE_TASK, BulkLane, LaneFull
from provider.request.tokens import INLINE_CHARS


@pytest.fixture
def counter(tiny_model_path: Path):
    c = PromptCounter({"m": tiny_model_path}, lane=BulkLane(max_waiting=1))
    yield c
    c.lane.close()


async def test_a_large_body_holds_its_working_memory_until_the_lane_is_done(counter):
    ledger = ledger_of(64)
    intake = Intake(counter, ledger, Manager())
    started, release = threading.Event(), threading.Event()

    def slow() -> str:
        started.set()
        release.wait(10)
        return "parsed"

    async def request() -> str:
        async with intake.ticket("big", INLINE_BYTES + 1) as ticket:
            return await ticket.run(slow)

    task = asyncio.create_task(request())
    await asyncio.to_thread(started.wait, 10)
    assert ledger.bytes_of("prompt:big") == working_bytes(INLINE_BYTES + 1, 2048)
    task.cancel()  # the caller gives up; the thread cannot
    with pytest.raises(asyncio.CancelledError):
        await task
    assert "prompt:big" in ledger  # still working: the memory is still in use
    release.set()
    while counter.lane.busy:
        await asyncio.sleep(0.01)
    assert "prompt:big" not in ledger and len(ledger) == 0


async def test_a_small_body_runs_inline_and_reserves_nothing(counter):
    ledger = ledger_of(64)
    intake = Intake(counter, ledger, Manager())
    async with intake.ticket("small", 100) as ticket:
        assert ticket.inline and await ticket.run(threading.get_ident) == threading.get_ident()
        assert len(ledger) == 0


async def test_a_full_lane_refuses_at_once_with_queue_full(counter):
    intake = Intake(counter, ledger_of(64), Manager())
    gate = threading.Event()
    busy = [asyncio.create_task(counter.lane.run(gate.wait, 10)) for _ in range(2)]  # 1 running + 1 waiting
    await asyncio.sleep(0)
    try:
        assert not counter.lane.has_room()
        with pytest.raises(Refusal) as refused:
            async with intake.ticket("third", INLINE_BYTES * 10):
                pass
        assert refused.value.failure.reason is ErrorReason.QUEUE_FULL
        with pytest.raises(LaneFull):
            await counter.lane.run(lambda: None)
    finally:
        gate.set()
        await asyncio.gather(*busy)


async def test_a_task_takes_the_share_of_a_place_its_size_is():
    """The lane holds `max_waiting` large tasks behind the one in progress; a task smaller than
    `LARGE_TASK` characters (or bytes) takes that share of a place, one without a size a whole place."""
    lane = BulkLane(max_waiting=1)  # two places: the one in progress, one waiting
    gate = threading.Event()
    held = [asyncio.create_task(lane.run(gate.wait, 10))]  # a whole place
    await asyncio.sleep(0)  # the task above has reached the lane
    try:
        half = LARGE_TASK // 2
        held += [asyncio.create_task(lane.run(gate.wait, 10, size=half)) for _ in range(2)]
        await asyncio.sleep(0)
        assert lane.busy == 3 and not lane.has_room(1)
        with pytest.raises(LaneFull):
            await lane.run(int, size=1)
    finally:
        gate.set()
        await asyncio.gather(*held)
    assert lane.has_room(10 * LARGE_TASK)  # a task over LARGE_TASK takes one place, no more
    lane.close()


async def test_a_batch_of_prompts_a_little_over_the_inline_size_queues_in_the_lane(tiny_model_path):
    """A batch's worth of prompts that each share a system prompt a little over INLINE_CHARS (so each
    is counted in the lane; over a thousand tokens here) arrives while the lane is busy: all of them
    queue and are counted. Before, the lane took 16 tasks whatever their size and refused the other 16 with
    503 queue_full, the words of a full batch, with nothing running."""
    counter = PromptCounter({"m": tiny_model_path})  # the lane as the agent has it
    await counter.warm(["m"])  # the tokenizer loaded: nothing before the lane waits
    words = "river mountain apple stream batch model token quiet room copper wire north wind paper "
    system = {"role": "system", "content": (words * (INLINE_CHARS // len(words) + 8))[: INLINE_CHARS + 300]}
    gate = threading.Event()
    held = asyncio.create_task(counter.lane.run(gate.wait, 10))
    counts = [asyncio.create_task(counter.prompt_ids("m", [system, {"role": "user", "content": f"question {i}"}]))
              for i in range(DEFAULT_BATCH_SIZE)]
    await asyncio.sleep(0)  # every task above has reached the lane (queued, or refused before)
    queued = counter.lane.busy
    gate.set()
    await held
    ids = await asyncio.gather(*counts, return_exceptions=True)
    assert queued == 1 + DEFAULT_BATCH_SIZE
    assert [i for i in ids if isinstance(i, BaseException)] == []
    assert ids[0] == await counter.prompt_ids("m", [system, {"role": "user", "content": "question 0"}])
    assert all(len(i) > 1000 for i in ids)
    counter.lane.close()


class Body:
    """Stands for a request body (bytes cannot be weakly referenced): the lane's arguments."""


def refuse(body: Body) -> None:
    raise ValueError("refused")  # a body the lane's work turns down (bad JSON, over the context...)


async def test_a_body_refused_in_the_lane_is_freed_with_the_refusal_without_a_collection(counter):
    """No reference cycle through the failure's traceback keeps the body: with the garbage collector
    off, it is gone once the caller has the failure and the thread has left the task."""
    body = Body()
    alive = weakref.ref(body)
    gc.disable()
    try:
        try:
            await counter.lane.run(refuse, body)
        except ValueError:
            pass
        del body
        await counter.lane.run(int)  # the thread has left the refused task (its frame held the failure)
        assert alive() is None
    finally:
        gc.enable()


async def test_working_memory_the_ledger_cannot_give_is_a_503(counter):
    ledger = ledger_of(2.2)  # hard cap 0.2 GiB, activation reserve 3 GiB: nothing is available
    intake = Intake(counter, ledger, Manager())
    with pytest.raises(Refusal) as refused:
        async with intake.ticket("big", 16 * 2**20):
            pass
    assert refused.value.failure.code is FailureCode.CAPACITY
    assert refused.value.failure.rejection is RejectionReason.MEMORY_CAP
    assert len(ledger) == 0


async def test_too_many_messages_for_the_context_are_refused_before_validation(counter):
    await counter.warm(["m"])
    intake = Intake(counter, ledger_of(64), Manager(context=2048))
    per_message = counter.bounds("m").per_message_tokens
    assert per_message >= 1
    fits = {"model": "m", "messages": [{"role": "user", "content": "x"}] * 10}
    intake.precheck(fits)  # nothing to say
    storm = {"model": "m", "messages": [{"role": "user", "content": "x"}] * (2048 // per_message + 1)}
    with pytest.raises(Refusal) as refused:
        intake.precheck(storm)
    assert refused.value.failure.reason is ErrorReason.REQUEST_EXCEEDS_CONTEXT
    intake.precheck({"model": "not ours", "messages": storm["messages"]})  # not ours: the 404 comes later
    intake.precheck(["not", "a", "dict"])


async def test_a_long_prompt_is_given_up_in_the_lane_as_soon_as_it_is_surely_over(counter):
    """Counting stops early: no tokenizing of megabytes past the window."""
    from provider.request.tokens import PromptTooLong

    await counter.warm(["m"])
    words = "lorem ipsum dolor sit amet consectetur adipiscing elit "
    long = [{"role": "user", "content": words * 40_000}]  # ~2.2 M chars, far over 2048 tokens
    with pytest.raises(PromptTooLong):
        await counter.prompt_ids("m", long, limit=2048)
    short = [{"role": "user", "content": words * 20}]  # ~1.1 k chars: inline, exact
    ids = await counter.prompt_ids("m", short, limit=2048)
    assert ids == await counter.prompt_ids("m", short)


def test_piecewise_counting_stops_early_and_is_close_to_the_real_count(tiny_model_path):
    from mlx_lm.utils import load_tokenizer

    from provider.request.tokens import BOUNDARY_SLACK_TOKENS, CHUNK_CHARS, _surely_over

    tokenizer = load_tokenizer(tiny_model_path)
    words = "lorem ipsum dolor sit amet, consectetur adipiscing elit; sed do eiusmod tempor. "
    text = words * (3 * CHUNK_CHARS // len(words))  # three pieces and a bit
    exact = len(tokenizer.encode(text, add_special_tokens=False))
    pieces = 4
    assert _surely_over(tokenizer, text, exact - pieces * BOUNDARY_SLACK_TOKENS)  # over: said so
    assert not _surely_over(tokenizer, text, exact + 1)  # never claims a prompt that fits is over
