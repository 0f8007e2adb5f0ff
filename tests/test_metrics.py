"""provider/metrics: what /metrics serves, read back with prometheus-client's own parser."""

from __future__ import annotations

from enum import Enum

import pytest
from prometheus_client.parser import text_string_to_metric_families

from provider.metrics import (
    CONTENT_TYPE,
    CapFigure,
    EvictionCause,
    LoadResult,
    Metrics,
    RequestOutcome,
    label,
)


class Rejection(Enum):  # stands in for protocol/errors' closed vocabulary
    MEMORY_CAP = "memory_cap"
    SLOT_STATE = "slot_state"


def samples(metrics: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = metrics.render().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(metrics: Metrics, name: str, **labels: str) -> float:
    return samples(metrics)[(name, tuple(sorted(labels.items())))]


def test_fresh_metrics_expose_every_family_with_known_labels_at_zero() -> None:
    m = Metrics()
    families = {
        f.name: f.type
        for f in text_string_to_metric_families(m.render().decode())
        if not f.name.endswith("_created")  # prometheus-client's per-series creation timestamps
    }
    assert families == {
        "darkbloom_requests": "counter",
        "darkbloom_tokens": "counter",
        "darkbloom_rejects": "counter",
        "darkbloom_model_loads": "counter",
        "darkbloom_model_evictions": "counter",
        "darkbloom_settle_seconds": "histogram",
        "darkbloom_ledger_bytes": "gauge",
        "darkbloom_cap_bytes": "gauge",
        "darkbloom_loaded_models": "gauge",
        "darkbloom_in_flight_requests": "gauge",
        "darkbloom_prefix_cache_lookups": "counter",
        "darkbloom_prefix_cache_bytes": "gauge",
        "darkbloom_baseline_drift_bytes": "gauge",
        "darkbloom_restart_recommendation": "gauge",
        "darkbloom_paused": "gauge",
        "darkbloom_pauses": "counter",
    }
    for outcome in RequestOutcome:
        assert value(m, "darkbloom_requests_total", outcome=outcome.value) == 0
    assert value(m, "darkbloom_tokens_total", kind="completion") == 0
    assert value(m, "darkbloom_model_evictions_total", cause="idle") == 0
    assert value(m, "darkbloom_prefix_cache_lookups_total", result="miss") == 0
    assert value(m, "darkbloom_prefix_cache_bytes", tier="disk") == 0
    assert value(m, "darkbloom_paused", reason="outside_window") == 0
    assert value(m, "darkbloom_pauses_total", reason="owner_active") == 0
    assert CONTENT_TYPE.startswith("text/plain; version=")


def test_counters_histogram_and_gauges_round_trip() -> None:
    m = Metrics()
    m.request_finished(RequestOutcome.COMPLETED)
    m.request_finished(RequestOutcome.COMPLETED)
    m.request_finished(RequestOutcome.FAILED)
    m.add_tokens(prompt=120, completion=30)
    m.add_tokens(completion=2)
    m.rejected(Rejection.MEMORY_CAP)
    m.rejected("slot_state")
    m.rejected(Rejection.SLOT_STATE)
    m.model_load(LoadResult.LOADED)
    m.model_load(LoadResult.REFUSED)
    m.model_evicted(EvictionCause.LRU)
    m.settled(0.3)
    m.settled(4.0)
    m.set_loaded_models(2)
    m.set_ledger_bytes({"request_kv": 1 << 20, "pending_load": 5 << 30})
    gib = 1 << 30
    m.set_cap_figures({CapFigure.PHYSICAL: 64 * gib, CapFigure.HARD_CAP: int(57.6 * gib),
                       CapFigure.EFFECTIVE_CAP: int(57.6 * gib), CapFigure.LOAD_RESERVE: int(6.4 * gib),
                       CapFigure.ACTIVATION_RESERVE: 3 * gib})

    assert value(m, "darkbloom_requests_total", outcome="completed") == 2
    assert value(m, "darkbloom_requests_total", outcome="failed") == 1
    assert value(m, "darkbloom_tokens_total", kind="prompt") == 120
    assert value(m, "darkbloom_tokens_total", kind="completion") == 32
    assert value(m, "darkbloom_rejects_total", reason="memory_cap") == 1
    assert value(m, "darkbloom_rejects_total", reason="slot_state") == 2
    assert value(m, "darkbloom_model_loads_total", result="loaded") == 1
    assert value(m, "darkbloom_model_loads_total", result="refused") == 1
    assert value(m, "darkbloom_model_evictions_total", cause="lru") == 1
    assert value(m, "darkbloom_settle_seconds_count") == 2
    assert value(m, "darkbloom_settle_seconds_sum") == pytest.approx(4.3)
    assert value(m, "darkbloom_settle_seconds_bucket", le="0.5") == 1
    assert value(m, "darkbloom_settle_seconds_bucket", le="5.0") == 2
    assert value(m, "darkbloom_loaded_models") == 2
    assert value(m, "darkbloom_ledger_bytes", kind="pending_load") == 5 << 30
    assert value(m, "darkbloom_cap_bytes", figure="hard_cap") == int(57.6 * gib)
    assert value(m, "darkbloom_cap_bytes", figure="activation_reserve") == 3 * gib


def test_ledger_kinds_absent_from_an_update_drop_to_zero() -> None:
    m = Metrics()
    m.set_ledger_bytes({"request_kv": 100, "media": 7})
    m.set_ledger_bytes({"media": 9})
    assert value(m, "darkbloom_ledger_bytes", kind="request_kv") == 0
    assert value(m, "darkbloom_ledger_bytes", kind="media") == 9


def test_in_flight_is_released_on_every_exit_path() -> None:
    m = Metrics()
    with m.in_flight():
        with m.in_flight():
            assert value(m, "darkbloom_in_flight_requests") == 2
    with pytest.raises(RuntimeError), m.in_flight():
        raise RuntimeError
    assert value(m, "darkbloom_in_flight_requests") == 0


def test_label_values_are_closed_vocabulary_or_other() -> None:
    assert label(Rejection.MEMORY_CAP) == "memory_cap"
    assert label("kv_headroom") == "kv_headroom"
    for bad in ("Prompt text: tell me a secret", "UPPER", "a" * 49, "", "x\ny"):
        assert label(bad) == "other"
    m = Metrics()
    m.rejected("ignore previous instructions")
    assert value(m, "darkbloom_rejects_total", reason="other") == 1
    assert b"ignore previous" not in m.render()


def test_instances_do_not_share_a_registry() -> None:
    a, b = Metrics(), Metrics()
    a.request_finished(RequestOutcome.CANCELLED)
    assert value(a, "darkbloom_requests_total", outcome="cancelled") == 1
    assert value(b, "darkbloom_requests_total", outcome="cancelled") == 0


def test_prefix_cache_stats_feed_counters_by_delta_and_gauges_by_value() -> None:
    from kvcache.manager import PrefixCacheStats

    m = Metrics()
    m.set_prefix_cache(PrefixCacheStats(hits=2, partial_hits=1, misses=3, ram_bytes=4096, disk_bytes=8192))
    m.set_prefix_cache(PrefixCacheStats(hits=5, partial_hits=1, misses=3, ram_bytes=1024, disk_bytes=0))
    assert value(m, "darkbloom_prefix_cache_lookups_total", result="hit") == 5  # cumulative, not summed
    assert value(m, "darkbloom_prefix_cache_lookups_total", result="partial_hit") == 1
    assert value(m, "darkbloom_prefix_cache_lookups_total", result="miss") == 3
    assert value(m, "darkbloom_prefix_cache_bytes", tier="ram") == 1024
    assert value(m, "darkbloom_prefix_cache_bytes", tier="disk") == 0


def test_session_figures_are_read_at_each_scrape_with_closed_labels():
    """darkbloom_session_* come from the session status when scraped; a reason or component
    name that is not a short identifier becomes ``other``."""
    from protocol.errors import Failure, RejectionReason
    from provider.session.status import RuntimeVerdict, SessionStatus

    metrics = Metrics()
    status = SessionStatus("wss://coord.example/ws/provider")
    metrics.watch_session(status.view)
    before = metrics.render().decode()
    assert 'darkbloom_session_state{state="connecting"} 1.0' in before
    assert "\ndarkbloom_session_runtime_verified " not in before  # no sample: unknown until the coordinator says
    status.registered()
    status.requests.refuse(Failure.capacity(RejectionReason.MEMORY_CAP))
    status.requests.refuse(Failure.draining())
    status.requests.accept()
    status.requests.fail(Failure.generation_failed())
    status.note(RuntimeVerdict(False, ("runtime", "template:chat ml")))
    text = metrics.render().decode()
    assert 'darkbloom_session_state{state="registered"} 1.0' in text
    assert 'darkbloom_session_requests_total{reason="memory_cap",result="refused"} 1.0' in text
    assert 'darkbloom_session_requests_total{reason="draining",result="refused"} 1.0' in text
    assert 'darkbloom_session_requests_total{reason="",result="accepted"} 1.0' in text
    assert 'darkbloom_session_requests_total{reason="generation_failure",result="failed"} 1.0' in text
    assert 'darkbloom_session_runtime_mismatch{component="other"} 1.0' in text
    assert "darkbloom_session_runtime_verified 0.0" in text and "darkbloom_session_registrations_total 1.0" in text
