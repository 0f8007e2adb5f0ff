"""A hostile coordinator: the real agent (tiny model) against the coordinator double's hostile mode,
over a real WebSocket on 127.0.0.1, while an OpenAI consumer keeps sending valid requests through the double.

More than 10,000 seeded mutations of every coordinator → provider frame type: zero crashes, zero disconnects
until the one frame over the documented inbound size limit (closed with 1009, then a fresh register), exactly
one terminal frame for every request whose id is readable, no answer to anything else, every valid request
served. The seed (``DARKBLOOM_HOSTILE_SEED``, default 12) and the counts are printed with the test's output.
"""

from __future__ import annotations

import asyncio
import json
import os

from coordinator_double import Disconnected, FrameReceived
from coordinator_double.hostile import TERMINAL_TYPES, HostileReport, hostile_cases
from double_fixtures import consumer_for
from protocol import MAX_INBOUND_FRAME_BYTES
from provider.telemetry import capture_redacted_logs
from running_agent import chat_messages, no_request_reservations

SEED = int(os.environ.get("DARKBLOOM_HOSTILE_SEED", "12"))
MUTATIONS = 10_000
VALID_MIN = 20  # valid requests served while the hostile frames arrive (more if the frames take longer)


async def test_a_hostile_coordinator_gets_one_answer_per_readable_request_and_never_a_crash(
        coordinator_double, start_agent, capsys):
    double = coordinator_double
    provider = await start_agent(double.ws_url)
    (view,) = await double.wait_routable(model="tiny", timeout=15)
    cases = list(hostile_cases(SEED, count=MUTATIONS, provider_key=view.public_key))
    expected = {c.expect.answer_id for c in cases if c.expect.answer_id is not None}
    mark = double.mark()

    unanswered = set(expected)

    def all_answered(event: object) -> bool:
        if isinstance(event, FrameReceived) and event.message.type in TERMINAL_TYPES:
            unanswered.discard(event.message.request_id)
        return not unanswered

    served: list[tuple[str, int]] = []
    async with consumer_for(double) as consumer:
        async def valid_requests(done: asyncio.Event) -> None:
            while len(served) < VALID_MIN or not done.is_set():
                raw = await consumer.chat.completions.with_raw_response.create(
                    model="tiny", messages=chat_messages(f"valid {len(served)}"), max_tokens=2)
                served.append((raw.headers["X-Inference-Job-ID"], raw.parse().usage.completion_tokens))

        with capture_redacted_logs() as logs:
            sent = asyncio.Event()
            consumer_task = asyncio.create_task(valid_requests(sent))
            try:
                await double.send_hostile(view, cases)
            finally:
                sent.set()
            await asyncio.wait_for(consumer_task, 120)
            await double.wait_for(all_answered, since=mark, timeout=60)
            # Everything sent before this challenge has been answered once it is (one reader, one send queue).
            fence = await double.send_challenge(view)
            assert fence.ok
        report = HostileReport.of(cases, double.events[mark:])
        counts = {"seed": SEED, **report.counts(), "valid_served": len(served)}
        with capsys.disabled():
            print(f"\nhostile coordinator: {json.dumps(counts)}")

        assert report.violations(served_ids=[rid for rid, _ in served]) == [], f"seed {SEED}"
        assert counts["mutated"] >= MUTATIONS and counts["terminal_frames"] == len(expected) > 1000, f"seed {SEED}"
        assert len(served) >= VALID_MIN and all(tokens == 2 for _, tokens in served), f"seed {SEED}"
        assert report.disconnects == [] and provider.agent.session.counters.connection_losses == 0, f"seed {SEED}"
        assert not provider.task.done() and double.provider(view).connected
        crashes = [e for e in logs if e.get("level") in ("error", "critical")]
        assert crashes == [], f"seed {SEED}: {crashes[:5]}"
        assert double.anomalies(since=mark) == [], f"seed {SEED}"
        assert not provider.agent.stats.in_flight and no_request_reservations(provider.agent.ledger)

        # The documented exception: a frame over the inbound limit closes the socket (1009); the agent comes
        # back with a fresh register and serves again.
        await double.send_raw(view, "x" * (MAX_INBOUND_FRAME_BYTES + 2 * 1024 * 1024))
        closed = await double.wait_for(lambda e: isinstance(e, Disconnected), since=mark, timeout=15)
        assert closed.close_code == 1009
        await double.wait_routable(model="tiny", timeout=15)
        completion = await consumer.chat.completions.create(model="tiny", messages=chat_messages(), max_tokens=2)
        assert completion.usage.completion_tokens == 2
        assert provider.agent.session.counters.registrations == 2
