"""Prometheus metrics for ``/metrics``, on a registry of their own (no global state, isolated tests).

Every label takes a value from a closed vocabulary. Callers pass an ``Enum`` (its ``value`` is used)
or a short identifier; anything else becomes ``other``, so a label can neither leak user text nor
grow without bound.

The coordinator session's figures (``darkbloom_session_*``) are read from the session status at each
scrape (``watch_session``), so they are never stale and never counted twice.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from enum import Enum, StrEnum
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from provider.guest.availability import PauseReason

if TYPE_CHECKING:
    from kvcache.manager import PrefixCacheStats
    from provider.session.status import SessionView

NAMESPACE = "darkbloom"
CONTENT_TYPE = CONTENT_TYPE_LATEST
OTHER = "other"
_LABEL_VALUE = re.compile(r"[a-z0-9_]{1,48}")
# Unload-to-settled times run from ~0 (nothing to free) to the 5 s barrier and its 3 retry rounds.
SETTLE_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0)


class RequestOutcome(StrEnum):
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    REJECTED = "rejected"  # refused before inference_accepted; the reason is in rejects_total


class TokenKind(StrEnum):
    PROMPT = "prompt"
    COMPLETION = "completion"


class LoadResult(StrEnum):
    LOADED = "loaded"
    FAILED = "failed"
    REFUSED = "refused"  # the load gate or the post-load guard said no


class EvictionCause(StrEnum):
    LRU = "lru"  # made room for another model
    IDLE = "idle"  # idle_timeout_mins
    PRESSURE = "pressure"  # memory watermark
    SHUTDOWN = "shutdown"
    PAUSED = "paused"  # the owner's Mac stopped serving (provider/guest): its memory goes back
    OPERATOR = "operator"  # `darkbloom-provider unload MODEL`


class PrefixLookup(StrEnum):
    HIT = "hit"  # the whole prompt but its last token came from the prefix cache
    PARTIAL_HIT = "partial_hit"
    MISS = "miss"


class CacheTier(StrEnum):
    RAM = "ram"
    DISK = "disk"


class CapFigure(StrEnum):
    PHYSICAL = "physical"
    HARD_CAP = "hard_cap"
    EFFECTIVE_CAP = "effective_cap"
    LOAD_RESERVE = "load_reserve"
    ACTIVATION_RESERVE = "activation_reserve"


def label(value: Enum | str) -> str:
    """The label value for ``value``; ``other`` unless it is a short lower-case identifier."""
    raw = value.value if isinstance(value, Enum) else value
    return raw if isinstance(raw, str) and _LABEL_VALUE.fullmatch(raw) else OTHER


class Metrics:
    """The provider's counters, gauges and histograms, and their Prometheus text rendering."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r, ns = self.registry, NAMESPACE
        self.requests_total = Counter("requests", "Inference requests by final outcome.", ["outcome"],
                                      namespace=ns, registry=r)
        self.tokens_total = Counter("tokens", "Tokens processed, by kind.", ["kind"], namespace=ns, registry=r)
        self.rejects_total = Counter("rejects", "Requests refused before acceptance, by rejection reason.",
                                     ["reason"], namespace=ns, registry=r)
        self.model_loads_total = Counter("model_loads", "Model load attempts by result.", ["result"],
                                         namespace=ns, registry=r)
        self.model_evictions_total = Counter("model_evictions", "Model unloads by cause.", ["cause"],
                                             namespace=ns, registry=r)
        self.settle_seconds = Histogram("settle_seconds", "Time for memory to settle after an unload.",
                                        namespace=ns, registry=r, buckets=SETTLE_BUCKETS)
        self.ledger_bytes = Gauge("ledger_bytes", "Bytes reserved in the memory ledger, by reservation kind.",
                                  ["kind"], namespace=ns, registry=r)
        self.cap_bytes = Gauge("cap_bytes", "Memory cap figures in bytes.", ["figure"], namespace=ns, registry=r)
        self.loaded_models = Gauge("loaded_models", "Models resident now.", namespace=ns, registry=r)
        self.in_flight_requests = Gauge("in_flight_requests", "Requests accepted and not finished.",
                                        namespace=ns, registry=r)
        self.prefix_cache_lookups_total = Counter("prefix_cache_lookups", "Prefix KV cache lookups by result.",
                                                  ["result"], namespace=ns, registry=r)
        self.prefix_cache_bytes = Gauge("prefix_cache_bytes", "Bytes held by the prefix KV cache, by tier.",
                                        ["tier"], namespace=ns, registry=r)
        self.baseline_drift_bytes = Gauge("baseline_drift_bytes", "Growth of MLX active memory with no model "
                                          "resident since start (memory/diagnostics).", namespace=ns, registry=r)
        self.restart_recommendation = Gauge("restart_recommendation", "1 for the current restart recommendation "
                                            "(none, advised, needed), 0 for the others.", ["level"],
                                            namespace=ns, registry=r)
        self.paused = Gauge("paused", "1 for the reason the agent takes no new requests now (provider/guest), "
                            "0 for the others.", ["reason"], namespace=ns, registry=r)
        self.pauses_total = Counter("pauses", "Pauses begun, by reason.", ["reason"], namespace=ns, registry=r)
        self._prefix_seen = dict.fromkeys(PrefixLookup, 0)
        # Known label values exist from the start at 0, so rate() and absent() behave.
        for outcome in RequestOutcome:
            self.requests_total.labels(outcome=outcome.value)
        for kind in TokenKind:
            self.tokens_total.labels(kind=kind.value)
        for result in LoadResult:
            self.model_loads_total.labels(result=result.value)
        for cause in EvictionCause:
            self.model_evictions_total.labels(cause=cause.value)
        for result in PrefixLookup:
            self.prefix_cache_lookups_total.labels(result=result.value)
        for tier in CacheTier:
            self.prefix_cache_bytes.labels(tier=tier.value).set(0)
        for reason in PauseReason:
            self.paused.labels(reason=reason.value).set(0)
            self.pauses_total.labels(reason=reason.value)

    # --- requests
    def request_finished(self, outcome: RequestOutcome) -> None:
        self.requests_total.labels(outcome=label(outcome)).inc()

    def add_tokens(self, *, prompt: int = 0, completion: int = 0) -> None:
        if prompt:
            self.tokens_total.labels(kind=TokenKind.PROMPT.value).inc(prompt)
        if completion:
            self.tokens_total.labels(kind=TokenKind.COMPLETION.value).inc(completion)

    def rejected(self, reason: Enum | str) -> None:
        """A fast reject (503 before acceptance); ``reason`` is the protocol's rejection_reason."""
        self.rejects_total.labels(reason=label(reason)).inc()

    @contextmanager
    def in_flight(self) -> Iterator[None]:
        """Count a request as in flight for the duration of the block, on every exit path."""
        self.in_flight_requests.inc()
        try:
            yield
        finally:
            self.in_flight_requests.dec()

    # --- models
    def model_load(self, result: LoadResult) -> None:
        self.model_loads_total.labels(result=label(result)).inc()

    def model_evicted(self, cause: EvictionCause) -> None:
        self.model_evictions_total.labels(cause=label(cause)).inc()

    def settled(self, seconds: float) -> None:
        """An unload's settle barrier finished (settled or gave up) after ``seconds``."""
        self.settle_seconds.observe(seconds)

    def set_loaded_models(self, count: int) -> None:
        self.loaded_models.set(count)

    # --- memory
    def set_ledger_bytes(self, by_kind: Mapping[Enum | str, int]) -> None:
        """Replace the ledger figures; kinds absent from ``by_kind`` drop back to 0."""
        current = {label(kind): value for kind, value in by_kind.items()}
        for labels in self._label_values(self.ledger_bytes):
            current.setdefault(labels, 0)
        for kind, value in current.items():
            self.ledger_bytes.labels(kind=kind).set(value)

    def set_cap_figures(self, figures: Mapping[CapFigure, int]) -> None:
        for figure, value in figures.items():
            self.cap_bytes.labels(figure=label(figure)).set(value)

    def set_restart(self, recommendation: str, drift_bytes: int) -> None:
        """The restart recommendation (`memory.diagnostics.Recommendation` values) and the baseline drift."""
        self.baseline_drift_bytes.set(drift_bytes)
        for level in ("none", "advised", "needed"):
            self.restart_recommendation.labels(level=level).set(1 if level == recommendation else 0)

    def set_prefix_cache(self, stats: PrefixCacheStats) -> None:
        """Feed `kvcache.manager.PrefixCacheStats` (cumulative lookups, current bytes): the counters
        advance by what is new since the previous call, the gauges are replaced."""
        totals = {PrefixLookup.HIT: stats.hits, PrefixLookup.PARTIAL_HIT: stats.partial_hits,
                  PrefixLookup.MISS: stats.misses}
        for result, total in totals.items():
            delta = total - self._prefix_seen[result]
            if delta > 0:
                self.prefix_cache_lookups_total.labels(result=result.value).inc(delta)
                self._prefix_seen[result] = total
        self.prefix_cache_bytes.labels(tier=CacheTier.RAM.value).set(stats.ram_bytes)
        self.prefix_cache_bytes.labels(tier=CacheTier.DISK.value).set(stats.disk_bytes)

    # --- the owner's Mac
    def availability_changed(self, reason: PauseReason | None, *, count: bool = True) -> None:
        """The agent paused for `reason`, or became available (None); `count=False` only sets the gauge."""
        for member in PauseReason:
            self.paused.labels(reason=member.value).set(1 if member is reason else 0)
        if reason is not None and count:
            self.pauses_total.labels(reason=label(reason)).inc()

    # --- the coordinator session
    def watch_session(self, source: Callable[[], SessionView]) -> None:
        """Report the session status ``source()`` returns at every scrape (``darkbloom_session_*``)."""
        self.registry.register(SessionCollector(source))

    def render(self) -> bytes:
        """Prometheus text exposition format (serve with :data:`CONTENT_TYPE`)."""
        return generate_latest(self.registry)

    @staticmethod
    def _label_values(gauge: Gauge) -> list[str]:
        return [sample.labels["kind"] for family in gauge.collect() for sample in family.samples]


class SessionCollector:
    """``darkbloom_session_*`` from a ``SessionView``, read at scrape time."""

    def __init__(self, source: Callable[[], SessionView]) -> None:
        self._source = source

    def describe(self) -> list[Metric]:
        return []  # families are built at collect time; nothing to pre-register

    def collect(self) -> Iterable[Metric]:
        v = self._source()
        ns = f"{NAMESPACE}_session"
        state = GaugeMetricFamily(f"{ns}_state", "Coordinator link state (1 for the current one).", labels=["state"])
        for member in type(v.state):
            state.add_metric([member.value], 1.0 if member is v.state else 0.0)
        yield state
        for name, text, value in (
            ("connect_attempts", "Connection attempts to the coordinator.", v.connect_attempts),
            ("connect_failures", "Connection attempts that never opened a socket.", v.connect_failures),
            ("registrations", "register frames sent (one per connection).", v.registrations),
            ("reconnects", "Connections lost (not drained), each followed by a reconnect.", v.connection_losses),
            ("restore_waits", "Connections the coordinator closed with 1013 (restoring our state: reconnect "
             "later; not a failure).", v.restore_waits),
            ("heartbeats", "Heartbeats sent.", v.heartbeats_sent),
        ):
            yield CounterMetricFamily(f"{ns}_{name}", text, value=value)
        challenges = CounterMetricFamily(f"{ns}_challenges", "Attestation challenges, received and answered.",
                                         labels=["result"])
        challenges.add_metric(["received"], v.challenges_received)
        challenges.add_metric(["answered"], v.challenges_answered)
        yield challenges
        requests = CounterMetricFamily(f"{ns}_requests", "Coordinator requests: accepted, completed, cancelled, "
                                       "and refused (before the accept) or failed (after it) by reason.",
                                       labels=["result", "reason"])
        for result, count in (("accepted", v.accepted), ("completed", v.completed), ("cancelled", v.cancelled)):
            requests.add_metric([result, ""], count)
        for result, by_reason in (("refused", v.refused), ("failed", v.failed)):
            for reason, count in sorted(by_reason.items()):
                requests.add_metric([result, label(reason)], count)
        yield requests
        yield from _optional_gauges(ns, v)
        mismatch = GaugeMetricFamily(f"{ns}_runtime_mismatch", "Components the last runtime_status named as "
                                     "not matching the coordinator's manifest.", labels=["component"])
        for component in v.runtime_mismatches:
            mismatch.add_metric([label(component)], 1.0)
        yield mismatch


def _optional_gauges(ns: str, v: SessionView) -> Iterator[Metric]:
    """Gauges with a sample only when the value is known (a missing sample reads as "unknown")."""
    close = v.last_close
    verified = None if v.runtime_verified is None else float(v.runtime_verified)
    for name, text, value in (
        ("connected_since_seconds", "Unix time the current connection registered.", v.connected_since),
        ("last_challenge_received_seconds", "Unix time of the last attestation challenge.",
         v.last_challenge_received_at),
        ("last_challenge_answered_seconds", "Unix time the last challenge was answered.",
         v.last_challenge_answered_at),
        ("last_heartbeat_seconds", "Unix time of the last heartbeat sent.", v.last_heartbeat_at),
        ("runtime_verified", "1 when the last runtime_status verified our runtime hash, 0 when it did not.",
         verified),
        ("backoff_seconds", "Delay before the next connection attempt while backing off.", v.backoff_delay_s),
        ("last_close_code", "Close code of the last connection that ended (1006: no close frame).",
         None if close is None else close.code),
        ("last_drain_acked", "1 when the coordinator acknowledged the last drain barrier (provider_drain), "
         "0 when it did not in time.", None if v.last_drain is None else float(v.last_drain.acked)),
    ):
        gauge = GaugeMetricFamily(f"{ns}_{name}", text)
        if value is not None:
            gauge.add_metric([], float(value))
        yield gauge
