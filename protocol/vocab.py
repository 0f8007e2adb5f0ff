"""Closed vocabularies of the wire. Values are the exact wire strings."""

from __future__ import annotations

from enum import StrEnum


class FailureCode(StrEnum):
    """``inference_error.failure_code`` (Go coordinator/protocol/inference_failure.go)."""

    INVALID_REQUEST = "invalid_request"
    INVALID_MEDIA = "invalid_media"
    MEDIA_TOO_LARGE = "media_too_large"
    UNSUPPORTED_MEDIA = "unsupported_media"
    TEMPLATE_RENDER = "template_render"
    MODEL_UNAVAILABLE = "model_unavailable"
    CAPACITY = "capacity"
    CANCELLED = "cancelled"
    ENCRYPTION_FAILURE = "encryption_failure"
    GENERATION_FAILURE = "generation_failure"
    INTERNAL_FAILURE = "internal_failure"


class ErrorReason(StrEnum):
    """``inference_error.error_reason`` (Swift InferenceErrorReason)."""

    JINJA_CHANNEL_TAGS = "jinja_channel_tags"
    JINJA_NULL_BRIDGE = "jinja_null_bridge"
    JINJA_TEMPLATE = "jinja_template"
    MODEL_LOAD = "model_load"
    CAPACITY_TIMEOUT = "capacity_timeout"
    QUEUE_FULL = "queue_full"
    TOKEN_BUDGET_EXHAUSTED = "token_budget_exhausted"
    REQUEST_EXCEEDS_CONTEXT = "request_exceeds_context"
    REQUEST_EXCEEDS_NODE = "request_exceeds_node"
    REQUEST_EXCEEDS_NODE_BUDGET = "request_exceeds_node_budget"
    REQUEST_EXCEEDS_BATCH_TOKEN_BUDGET = "request_exceeds_batch_token_budget"
    CAPACITY_BUSY = "capacity_busy"
    DEADLINE_UNREACHABLE = "deadline_unreachable"
    DRAINING = "draining"
    CANCELLED = "cancelled"
    CLIENT_ERROR = "client_error"
    TOOL_NONCOMPLIANCE = "tool_noncompliance"


class RejectionReason(StrEnum):
    """``inference_error.rejection_reason`` / ``capacity_quote.rejection_reason`` (capacity.go)."""

    TOKEN_BUDGET = "token_budget"
    KV_HEADROOM = "kv_headroom"
    MEMORY_CAP = "memory_cap"
    SLOT_STATE = "slot_state"
    TEMPLATE = "template"
    CAPABILITY = "capability"
    DEADLINE = "deadline"


class TerminalCause(StrEnum):
    """``inference_error.terminal_cause``."""

    ADMISSION_TIMEOUT = "admission_timeout"
    PREFILL_STALL = "prefill_stall"
    DECODE_STALL = "decode_stall"
    SAFETY_DEADLINE = "safety_deadline"
    BACKPRESSURE_TIMEOUT = "backpressure_timeout"
    WATCHDOG = "watchdog"
    CANCELLED = "cancelled"
    ENGINE_ERROR = "engine_error"


class HeartbeatStatus(StrEnum):
    """``heartbeat.status``; ``draining`` is understood by [N] only."""

    IDLE = "idle"
    SERVING = "serving"
    DRAINING = "draining"


class ThermalState(StrEnum):
    NOMINAL = "nominal"
    FAIR = "fair"
    SERIOUS = "serious"
    CRITICAL = "critical"


class SlotState(StrEnum):
    """``backend_capacity.slots[].state``. [A] treats only ``running`` as loaded; [N] also ``idle``."""

    RUNNING = "running"
    IDLE = "idle"
    IDLE_SHUTDOWN = "idle_shutdown"
    CRASHED = "crashed"
    RELOADING = "reloading"


class LoadStatus(StrEnum):
    """``load_model_status.status`` ([N])."""

    STARTED = "started"
    SUCCEEDED = "succeeded"
    FAILED = "failed"


class PrefetchStatus(StrEnum):
    """``prefetch_model_status.status`` ([N])."""

    STARTED = "started"
    DOWNLOADING = "downloading"
    VERIFIED = "verified"
    FAILED = "failed"


class QuoteConfidence(StrEnum):
    HIGH = "high"
    LOW = "low"
