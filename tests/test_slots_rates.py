"""provider/slots/rates.py: the evidence heartbeats and quotes report (pure: a fake clock)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from clock import Clock
from protocol import Heartbeat, decode, encode
from provider.slots.rates import FRESHNESS_S, MAX_PREFILL_TPS, PROMPT_BUCKET_TOKENS, RateBook, prompt_bucket


def serve(book: RateBook, *, prompt: int = 512, prefill_s: float = 0.5, tokens: int = 33, decode_s: float = 0.32,
          isolated: bool = True) -> None:
    book.served("m", prompt_tokens=prompt, completion_tokens=tokens, submitted=10.0, first_token=10.0 + prefill_s,
                ended=10.0 + prefill_s + decode_s, isolated=isolated)


@given(st.lists(st.tuples(st.floats(0.03, 5.0), st.floats(0.01, 5.0)), min_size=1, max_size=30))
def test_the_ewma_stays_within_what_was_measured(windows: list[tuple[float, float]]) -> None:
    book = RateBook(Clock(1000.0))
    prefill, decode = [], []
    for prefill_s, decode_s in windows:
        serve(book, prefill_s=prefill_s, decode_s=decode_s)
        prefill.append(512 / prefill_s)
        decode.append(32 / decode_s)
    observed_prefill, observed_decode = book.observed("m")
    assert min(prefill) - 0.01 <= observed_prefill <= max(prefill) + 0.01
    assert min(decode) - 0.01 <= observed_decode <= max(decode) + 0.01
    assert book.measurements("m").decode.sample_count == len(windows)


def test_contended_and_implausible_samples_are_not_prefill_evidence() -> None:
    clock = Clock(1000.0)
    book = RateBook(clock)
    serve(book, isolated=False)
    assert book.observed("m")[0] == 0.0 and book.observed("m")[1] == 100.0  # decode still counts
    serve(book, prompt=30_000, prefill_s=1.0)  # 30,000 tok/s: above the coordinator's ceiling
    serve(book, prefill_s=0.0001)  # a window under 1 ms
    assert book.observed("m")[0] == 0.0
    assert book.measurements("m").isolated_prefill is None
    serve(book, prefill_s=0.5)
    assert book.observed("m")[0] == 1024.0 and 1024.0 <= MAX_PREFILL_TPS


def test_ages_grow_and_a_gap_reseeds() -> None:
    clock = Clock(1000.0)
    book = RateBook(clock)
    serve(book, decode_s=0.32)  # 100 tok/s
    clock.now += 3.0
    assert book.measurements("m").decode.sample_age_ms == 3000
    serve(book, decode_s=0.16)  # 200 tok/s, blended
    assert book.observed("m")[1] == 130.0
    clock.now += FRESHNESS_S + 1
    serve(book, decode_s=0.64)  # 50 tok/s after the evidence expired: it replaces, not blends
    assert book.observed("m")[1] == 50.0
    book.loaded("m")  # a new engine lifetime
    assert book.observed("m") == (0.0, 0.0) and book.measurements("m") is None


def test_heartbeat_slot_carries_rates_and_ages_on_the_wire() -> None:
    from protocol import BackendCapacity, BackendSlotCapacity, HeartbeatStats, SystemMetrics

    book = RateBook(Clock(1000.0))
    serve(book)
    slot = BackendSlotCapacity(model="m", state="running", num_running=0, num_waiting=0, active_tokens=0,
                               max_tokens_potential=0, observed_prefill_tps=book.observed("m")[0],
                               observed_decode_tps=book.observed("m")[1],
                               performance_measurements=book.measurements("m"))
    frame = Heartbeat(status="idle", stats=HeartbeatStats(requests_served=1, tokens_generated=33),
                      system_metrics=SystemMetrics(memory_pressure=0.0, cpu_usage=0.0, thermal_state="nominal"),
                      backend_capacity=BackendCapacity(slots=(slot,), gpu_memory_active_gb=0.0,
                                                       gpu_memory_peak_gb=0.0, gpu_memory_cache_gb=0.0,
                                                       total_memory_gb=8.0, capacity_seq=4))
    text = encode(frame)
    assert '"isolated_prefill":{"tokens_per_second":1024.0,"sample_count":1,"sample_age_ms":0}' in text
    assert '"capacity_seq":4' in text and '"workload_buckets":[]' in text
    assert decode(text) == frame


@given(st.integers(0, 10**7))
def test_prompt_buckets_round_up_to_512(tokens: int) -> None:
    bucket = prompt_bucket(tokens)
    assert bucket % PROMPT_BUCKET_TOKENS == 0 and bucket >= max(tokens, 1) and bucket - max(tokens, 1) < PROMPT_BUCKET_TOKENS


def test_a_request_that_waited_for_the_load_is_no_warm_ttft_sample() -> None:
    clock = Clock(1000.0)
    book = RateBook(clock)
    clock.now = 10.2
    book.loaded("m")  # the load ended at 10.2; the request below arrived at 10.0
    book.served("m", prompt_tokens=512, completion_tokens=9, submitted=10.2, first_token=10.3, ended=10.5,
                isolated=True, ttft_s=0.3)
    assert book.ttft("m", 512) is None and book.observed("m")[1] == 40.0
    book.served("m", prompt_tokens=512, completion_tokens=9, submitted=10.6, first_token=10.7, ended=10.9,
                isolated=True, ttft_s=0.1)
    assert book.ttft("m", 512).samples == 1


def test_prefill_counts_computed_tokens_and_not_a_cache_hit() -> None:
    book = RateBook(Clock(1000.0))
    book.served("m", prompt_tokens=1030, completion_tokens=2, submitted=0.0, first_token=1.0, ended=1.1,
                isolated=True, cached_tokens=6)  # a template start from the cache: 1,024 computed in 1 s
    assert book.observed("m")[0] == 1024.0
    book.served("m", prompt_tokens=1030, completion_tokens=2, submitted=0.0, first_token=0.1, ended=0.2,
                isolated=True, cached_tokens=1000)  # mostly restored: no evidence of the rate
    assert book.measurements("m").isolated_prefill.sample_count == 1
