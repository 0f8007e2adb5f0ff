"""capacity_quote at the admission layer: a real engine with the tiny model, the real
ledger and model manager. The quote is the read-only admission decision: it must agree with the booking
a real request of the same shape gets, and it must never book, reserve or load anything itself."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from memory import Ledger, Probe, compute_figures, resolve_settings
from protocol import CapacityProbe, CapacityQuote, decode, encode
from protocol.vocab import QuoteConfidence, RejectionReason
from provider.engine import Engine
from provider.models import discover
from provider.slots import ModelManager, Refused
from provider.slots.leases import Booking
from provider.slots.quote import capacity_quote, rejection_of
from provider.slots.rates import HIGH_CONFIDENCE_SAMPLES, RateBook

BATCH = 4


@pytest.fixture
async def manager(tiny_model_path: Path):
    inventory = discover(hf_cache=None, aliases={"tiny": tiny_model_path})
    probe = Probe(memory_limit_gb=8.0)
    figures = compute_figures(probe.machine_bytes, resolve_settings({}, memory_reserve_gb=0.5, memory_limit_gb=8.0))
    ledger = Ledger(figures, sample=probe.snapshot)
    async with Engine(batch_size=BATCH) as engine:
        manager = ModelManager(engine, inventory, ledger, figures, probe, max_model_slots=1, idle_timeout_s=None,
                               load_wait_timeout_s=60.0, settle_timeout_s=2.0)
        await manager.ensure_loaded("tiny")
        yield manager
        await manager.unload_all()
    assert len(ledger) == 0


def probe_of(model: str, prompt_bucket: int, max_output: int, *, vision: bool = False) -> CapacityProbe:
    return CapacityProbe(quote_id=f"q-{random.random()}", model=model, prompt_tokens_bucket=prompt_bucket,
                         max_output_tokens=max_output, requires_vision=vision, vision_image_count=int(vision),
                         deadline_remaining_ms=5000)


async def test_quote_and_booking_agree_over_1000_pairs(manager: ModelManager) -> None:
    """Random shapes against a changing batch: the quote's verdict and reason are the booking's."""
    rng = random.Random(32)
    held: list[Booking] = []
    agree = refused = 0
    before = len(manager.ledger)
    for i in range(1000):
        model = rng.choice(["tiny"] * 9 + ["not-served"])
        bucket = 512 * rng.randint(1, 5)  # 2,560 is beyond the tiny model's 2,048-token context
        max_output = rng.choice([0, 1, 64, 512, 4096])
        quote = capacity_quote(probe_of(model, bucket, max_output), manager, manager.rates, capacity_seq=i + 1)
        assert len(manager.ledger) == before + len(held), "a quote reserves nothing"
        booked = manager.book(f"r{i}", model, bucket, max_output or None)
        if isinstance(booked, Refused):
            refused += 1
            same = not quote.admissible_now and quote.rejection_reason == rejection_of(booked.failure)
        else:
            same = quote.admissible_now and quote.rejection_reason is None
            held.append(booked)
        agree += same
        while held and (len(held) >= BATCH or rng.random() < 0.3):  # the batch fills and drains
            held.pop(rng.randrange(len(held))).release()
        before = len(manager.ledger) - len(held)
    for booking in held:
        booking.release()
    assert refused > 100, "the run must exercise refusals too"
    assert agree >= 990, f"quote and admission agreed on {agree} of 1000"


async def test_refusals_carry_the_capacity_vocabulary(manager: ModelManager) -> None:
    rates = manager.rates
    full = [manager.book(f"f{i}", "tiny", 512, 64) for i in range(BATCH)]
    assert all(isinstance(b, Booking) for b in full)
    busy = capacity_quote(probe_of("tiny", 512, 64), manager, rates, 7)
    assert (busy.admissible_now, busy.rejection_reason) == (False, RejectionReason.SLOT_STATE)  # queue_full
    assert busy.capacity_seq == 7
    for booking in full:
        booking.release()
    assert capacity_quote(probe_of("tiny", 512, 64), manager, rates, 8).admissible_now
    too_long = capacity_quote(probe_of("tiny", 2560, 64), manager, rates, 9)
    assert too_long.rejection_reason is RejectionReason.KV_HEADROOM  # never fits: beyond the context
    image = capacity_quote(probe_of("tiny", 512, 64, vision=True), manager, rates, 10)
    assert image.rejection_reason is RejectionReason.CAPABILITY  # a text model takes no image
    absent = capacity_quote(probe_of("not-served", 512, 64), manager, rates, 11)
    assert absent.rejection_reason is RejectionReason.SLOT_STATE
    for quote in (busy, too_long, image, absent):
        assert decode(encode(quote)) == quote


async def test_confidence_is_high_only_from_real_samples_of_the_shape(manager: ModelManager) -> None:
    rates = RateBook()
    assert capacity_quote(probe_of("tiny", 512, 64), manager, rates, 1).confidence is QuoteConfidence.LOW
    rates.calibrated("tiny", prefill_tps=1000.0, decode_tps=100.0)
    estimate = capacity_quote(probe_of("tiny", 1024, 64), manager, rates, 2)
    assert (estimate.confidence, estimate.ttft_p50_ms) == (QuoteConfidence.LOW, 1024.0)  # 1,024 tokens at 1,000/s
    for i in range(HIGH_CONFIDENCE_SAMPLES):
        rates.served("tiny", prompt_tokens=600, completion_tokens=8, submitted=0.0, first_token=0.1 + i / 100,
                     ended=0.5, isolated=True, ttft_s=0.1 + i / 100)
    seen = capacity_quote(probe_of("tiny", 1024, 64), manager, rates, 3)
    assert seen.confidence is QuoteConfidence.HIGH
    assert seen.ttft_p50_ms == pytest.approx(120.0) and seen.ttft_p90_ms == pytest.approx(140.0)
    other = capacity_quote(probe_of("tiny", 2048, 64), manager, rates, 4)  # another bucket: no samples of it
    assert other.confidence is QuoteConfidence.LOW


async def test_transient_refusals_say_when_room_comes_back(manager: ModelManager) -> None:
    """feasible_after_ms (the floor of the client's Retry-After): when the soonest request in flight
    should end at the model's decode rate; the same figure is the quote's queue estimate."""
    rate = manager.rates.decode_tps("tiny")
    assert rate > 0, "the calibration at load gives a decode rate"
    outputs = [64, 256, 512, 1024]
    full = [manager.book(f"f{i}", "tiny", 512, n) for i, n in enumerate(outputs)]
    refused = manager.book("late", "tiny", 512, 64)
    assert isinstance(refused, Refused) and refused.failure.rejection is RejectionReason.SLOT_STATE
    bound_ms = 64 / rate * 1000  # the shortest in flight, not yet started on
    assert 0 < refused.failure.feasible_after_ms <= round(bound_ms) + 1
    quote = capacity_quote(probe_of("tiny", 512, 64), manager, manager.rates, 1)
    assert 0 < quote.queue_est_ms <= round(bound_ms) + 1
    never = manager.book("huge", "tiny", 2560, 64)  # beyond the context: no wait makes it fit
    assert isinstance(never, Refused) and never.failure.feasible_after_ms is None
    for booking in full:
        booking.release()


async def test_capacity_listener_hears_room_run_out_and_come_back(manager: ModelManager) -> None:
    """The heartbeat goes out at once when the model's room for one more request runs out and when it
    comes back, and not for bookings that change neither."""
    calls: list[frozenset[str]] = []
    manager.on_capacity_change = lambda: calls.append(manager.models_with_room())
    held = [manager.book(f"f{i}", "tiny", 512, 64) for i in range(BATCH - 1)]
    assert calls == []  # room left after each
    held.append(manager.book("last", "tiny", 512, 64))
    assert calls == [frozenset()]  # the batch is full: no room
    held.pop().release()
    await handed_over()
    assert calls == [frozenset(), frozenset({"tiny"})]
    for booking in held:
        booking.release()
    await handed_over()
    assert len(calls) == 2


async def handed_over() -> None:
    """After the callbacks a release handed to the loop (FIFO: they were scheduled first)."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    loop.call_soon(done.set_result, None)
    await done


def test_quote_frame_shape() -> None:
    """capacity.go: durations as float64, rejection_reason only on a refusal."""
    quote = CapacityQuote(quote_id="q", capacity_seq=3, admissible_now=True, ttft_p50_ms=12.5, ttft_p90_ms=20.25,
                          queue_est_ms=0.0, available_token_budget=4096, confidence=QuoteConfidence.HIGH)
    text = encode(quote)
    assert '"ttft_p50_ms":12.5' in text and "rejection_reason" not in text
