"""Settings of the coordinator double. Defaults are the [A] coordinator's; tests shrink them."""

from __future__ import annotations

from dataclasses import dataclass

from .events import TrustLevel

# [A] registry.go providerSupportsPrivateTextLocked: these privacy booleans must all be true to route text.
REQUIRED_PRIVACY_FLAGS: tuple[str, ...] = (
    "text_backend_inprocess",
    "text_proxy_disabled",
    "python_runtime_locked",
    "dangerous_modules_blocked",
    "anti_debug_enabled",
    "core_dumps_disabled",
    "env_scrubbed",
)


@dataclass(frozen=True, slots=True)
class DoubleConfig:
    """Timers are in seconds. ``ws_port``/``http_port`` 0 pick free ports at the first start; a restart
    reuses the ports of the first start."""

    # dispatch ([A] consumer.go handleChatCompletions)
    first_response_timeout: float = 10.0  # inference_accepted | first chunk | inference_error
    accepted_timeout: float = 600.0  # after inference_accepted, for the first chunk
    stream_idle_timeout: float = 600.0  # between chunks once committed, and non-streaming total
    dispatch_attempts: int = 3
    default_max_tokens: int = 8192  # injected when the consumer names no output bound
    queue_timeout: float = 120.0  # attempt 0 waits this long for a free routable provider
    queue_limit_per_model: int = 10
    # provider liveness ([A] main.go StartEvictionLoop, registry.go evictStale)
    eviction_timeout: float = 90.0
    eviction_sweep_interval: float = 30.0
    # challenges ([A] provider.go challengeLoop / sendChallenge)
    challenge_interval: float = 300.0
    challenge_response_timeout: float = 30.0
    challenge_freshness: float = 360.0  # scheduler.go challengeFreshnessMaxAge
    max_failed_challenges: int = 3
    # write timeouts ([A] provider.go, consumer.go cancelWriteTimeout)
    control_write_timeout: float = 5.0
    cancel_write_timeout: float = 2.0
    # model catalog ([A] registry catalog; GET /v1/models/catalog): (id, size_gb) pairs. Empty, as with [A]'s
    # memory store, filters nothing. Non-empty: register drops models it does not list.
    catalog: tuple[tuple[str, float], ...] = ()
    # [N] catalog builds carry the weight hash a provider's prefetch verifies against (directed.py):
    # (id, weight_hash) pairs, listed in GET /v1/models/catalog (with no size when not in `catalog`).
    # They filter nothing at register.
    catalog_weight_hashes: tuple[tuple[str, str], ...] = ()
    # [N] sends desired_models right after register (even an empty map): (public name, desired build)
    # pairs; None sends nothing, as [A].
    desired_models: tuple[tuple[str, str], ...] | None = None
    # routing
    backend: str = "inprocess-mlx"
    # EIGENINFERENCE_MIN_TRUST. [A]'s default is hardware, which no test provider reaches; self-hosted
    # coordinators under test set none, or self_signed to require a registration attestation.
    min_trust: TrustLevel = TrustLevel.NONE
    require_secure_boot_present: bool = True  # sip/rdma/secure_boot must be present in the answer
    # [N] lifecycle (docs/reference/protocol-messages.md "Provider lifecycle drain", `register`):
    # provider_drain fences the socket and is acknowledged once its pending requests are settled; False: never
    # acknowledged (an older coordinator, or an ack lost), for the provider's bounded wait.
    drain_ack: bool = True
    # False: the April [A] coordinator (e515244f) itself: no trust_status, no desired_models, and every
    # [N] provider frame (provider_drain, the model answers) dropped as an unknown type, as [A] logs
    # "unknown message type". True: [A] with the additive [N] lifecycle above.
    newer_protocol: bool = True
    # a verified registration whose durable state cannot be restored is closed with 1013 (try again later):
    # the first `restore_pending_registrations` registrations are (the double asks for no attestation).
    restore_pending_registrations: int = 0
    # transport ([A] handleProviderWS SetReadLimit): a larger provider frame closes the socket with 1009
    max_provider_frame_bytes: int = 10 * 1024 * 1024
    host: str = "127.0.0.1"
    ws_port: int = 0
    http_port: int = 0

    def __post_init__(self) -> None:
        if self.dispatch_attempts < 1:
            raise ValueError("dispatch_attempts must be at least 1")
        if not self.newer_protocol and self.desired_models is not None:
            raise ValueError("desired_models is an [N] frame: the April coordinator never sends it")
        for name in (
            "first_response_timeout",
            "accepted_timeout",
            "stream_idle_timeout",
            "queue_timeout",
            "eviction_timeout",
            "eviction_sweep_interval",
            "challenge_interval",
            "challenge_response_timeout",
            "challenge_freshness",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")


def max_concurrency(total_memory_gb: float | None) -> int:
    """[A] Provider.maxConcurrency: 4 without backend_capacity, else by total memory."""
    if total_memory_gb is None:
        return 4
    for bound, cap in ((24, 2), (48, 4), (96, 6), (128, 8)):
        if total_memory_gb <= bound:
            return cap
    return 12
