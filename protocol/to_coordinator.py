"""Frames the provider sends to the coordinator. Strict: they are what Go must decode.

Required fields have no default, so a frame cannot be built with one forgotten. Field order follows the Go
structs; the wire is semantic JSON, so order never matters to the coordinator.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, JsonValue

from protocol._wire import (
    NULLABLE,
    OMIT_EMPTY,
    Bool,
    EncryptedPayload,
    Float,
    Int64,
    JsonObject,
    NullAsEmpty,
    Opaque,
    Raw,
    Str,
    UInt64,
    WireModel,
)
from protocol.vocab import (
    ErrorReason,
    FailureCode,
    LoadStatus,
    PrefetchStatus,
    QuoteConfidence,
    RejectionReason,
    TerminalCause,
)

OmitStr = Annotated[Str, OMIT_EMPTY]
OmitInt = Annotated[Int64, OMIT_EMPTY]
OmitFloat = Annotated[Float, OMIT_EMPTY]
OmitBool = Annotated[Bool, OMIT_EMPTY]
OmitStrList = Annotated[tuple[Str, ...], OMIT_EMPTY]
OmitStrMap = Annotated[dict[Str, Str], OMIT_EMPTY]


# --- register ------------------------------------------------------------------------------------------


class CpuCores(WireModel):
    total: Int64
    performance: Int64
    efficiency: Int64


class Hardware(WireModel):
    machine_model: Str
    chip_name: Str
    chip_family: Str
    chip_tier: Str
    memory_gb: Int64
    memory_available_gb: Float
    cpu_cores: CpuCores
    gpu_cores: Int64
    memory_bandwidth_gbs: Float


class ModelInfo(WireModel):
    id: Str
    size_bytes: Int64
    model_type: Str
    quantization: Str
    weight_hash: OmitStr = ""
    is_vision: OmitBool = False
    template_render_ok: Bool | None = None  # pointer: explicit false excludes the model from tool requests
    estimated_memory_gb: OmitFloat = 0.0
    tool_constraint_template_hash: OmitStr = ""
    ssd_offloaded_weight_bytes: OmitInt = 0
    native_load_transient_bytes: OmitInt = 0


class PrivacyCapabilities(WireModel):
    text_backend_inprocess: Bool
    text_proxy_disabled: Bool
    python_runtime_locked: Bool
    dangerous_modules_blocked: Bool
    sip_enabled: Bool
    anti_debug_enabled: Bool
    core_dumps_disabled: Bool
    env_scrubbed: Bool
    hypervisor_active: Bool | None = None  # [A] only; [N] tolerates it


class Register(WireModel):
    """First frame on every connection. ``attestation`` keeps its exact bytes (they are signed)."""

    type: Literal["register"] = "register"
    hardware: Hardware
    models: tuple[ModelInfo, ...]
    backend: Str
    version: OmitStr = ""
    public_key: OmitStr = ""
    encrypted_response_chunks: OmitBool = False
    wallet_address: OmitStr = ""
    attestation: Raw | None = None
    prefill_tps: OmitFloat = 0.0
    decode_tps: OmitFloat = 0.0
    auth_token: OmitStr = ""
    python_hash: OmitStr = ""
    runtime_hash: OmitStr = ""
    template_hashes: OmitStrMap = Field(default_factory=dict)
    privacy_capabilities: PrivacyCapabilities | None = None
    runtime_capabilities: OmitStrList = ()
    private_only: OmitBool = False
    apns_device_token: OmitStr = ""
    apns_environment: OmitStr = ""
    prefix_cache_protocol: OmitInt = 0
    tool_constraint_protocol: OmitInt = 0
    tool_constraint_models: OmitStrList = ()
    app_attest_protocol: OmitInt = 0


# --- heartbeat -----------------------------------------------------------------------------------------


class HeartbeatStats(WireModel):
    """Cumulative for this provider process; a decrease reads as a restart."""

    requests_served: Int64
    tokens_generated: Int64
    cancellations_received: OmitInt = 0
    cancellations_before_output: OmitInt = 0
    cancellations_partial_complete: OmitInt = 0
    generation_errors_after_output: OmitInt = 0
    chunk_encryption_errors: OmitInt = 0
    stream_closed_without_terminal: OmitInt = 0
    cancel_during_model_load: OmitInt = 0
    usage_gaps: OmitInt = 0
    tokens_after_cancel_total: OmitInt = 0
    cancel_abort_ns_sum: OmitInt = 0


class SystemMetrics(WireModel):
    memory_pressure: Float
    cpu_usage: Float
    thermal_state: Str  # a ThermalState value; Go zero value "" is legal


class PerformanceRateObservation(WireModel):
    """One engine rate, independent of heartbeat cadence: ``sample_age_ms`` is monotonic time since its
    newest sample when the snapshot was taken (coordinator/protocol/performance_measurements.go)."""

    tokens_per_second: Float
    sample_count: Int64
    sample_age_ms: Int64


class PerformanceMeasurements(WireModel):
    """A slot's measured rates with their age; ``epoch`` changes with each engine lifetime (a load)."""

    epoch: Str
    isolated_prefill: PerformanceRateObservation | None = None
    contended_prefill: PerformanceRateObservation | None = None
    decode: PerformanceRateObservation | None = None
    delivered_decode: PerformanceRateObservation | None = None
    end_to_end: PerformanceRateObservation | None = None
    workload_buckets: Annotated[tuple[JsonObject, ...], NullAsEmpty] = ()


class BackendSlotCapacity(WireModel):
    model: Str
    state: Str  # a SlotState value
    num_running: Int64
    num_waiting: Int64
    active_tokens: Int64
    max_tokens_potential: Int64
    max_concurrency: OmitInt = 0
    observed_decode_tps: OmitFloat = 0.0
    observed_prefill_tps: OmitFloat = 0.0
    active_token_budget_used: OmitInt = 0
    active_token_budget_max: OmitInt = 0
    queued_token_budget: OmitInt = 0
    kv_bytes_per_token: OmitInt = 0
    model_load_time_ms: OmitInt = 0
    kv_backend: Str | None = None
    kv_backend_fallback_reason: Str | None = None
    steps_executed: OmitInt = 0
    admits: OmitInt = 0
    first_tokens_emitted: OmitInt = 0
    seconds_since_last_step: OmitFloat = 0.0
    seconds_since_last_first_token: OmitFloat = 0.0
    wedge_suspected: OmitBool = False
    eval_in_flight_ms: OmitInt = 0
    idle_clear_in_flight_ms: OmitInt = 0
    telemetry: JsonObject | None = None
    prefix_cache: JsonObject | None = None
    paged_storage: JsonObject | None = None
    performance_measurements: PerformanceMeasurements | None = None


class BackendCapacity(WireModel):
    slots: tuple[BackendSlotCapacity, ...]
    gpu_memory_active_gb: Float
    gpu_memory_peak_gb: Float
    gpu_memory_cache_gb: Float
    total_memory_gb: Float
    free_for_load_gb: Float | None = None  # pointer: [N] cold-load admission reads it when present
    capacity_seq: Annotated[UInt64, OMIT_EMPTY] = 0  # > 0 enables capacity_probe: omit unless quoting
    mlx_cache_reclaimer: JsonObject | None = None
    telemetry: JsonObject | None = None
    prefix_cache_maintenance: JsonObject | None = None


class Heartbeat(WireModel):
    type: Literal["heartbeat"] = "heartbeat"
    status: Str  # a HeartbeatStatus value
    active_model: Annotated[Str | None, NULLABLE] = None  # Go always emits it, null when unset
    stats: HeartbeatStats
    warm_models: OmitStrList = ()
    system_metrics: SystemMetrics
    backend_capacity: BackendCapacity | None = None
    apns_device_token: OmitStr = ""
    apns_environment: OmitStr = ""
    idle_unload_mins: Int64 | None = None


# --- inference -----------------------------------------------------------------------------------------


class InferenceAccepted(WireModel):
    type: Literal["inference_accepted"] = "inference_accepted"
    request_id: Str


class InferenceResponseChunk(WireModel):
    """One SSE event. ``data`` (plaintext) exists for decoding fixtures only: a real coordinator rejects it."""

    type: Literal["inference_response_chunk"] = "inference_response_chunk"
    request_id: Str
    data: OmitStr = ""
    encrypted_data: EncryptedPayload | None = None


class Usage(WireModel):
    prompt_tokens: Int64
    completion_tokens: Int64
    reasoning_tokens: OmitInt = 0
    cache_outcome: OmitStr = ""
    cache_tier: OmitStr = ""
    cached_tokens: OmitInt = 0
    prefill_tokens_saved: OmitInt = 0
    cache_stage_ms: OmitInt = 0


class InferenceComplete(WireModel):
    type: Literal["inference_complete"] = "inference_complete"
    request_id: Str
    usage: Usage
    se_signature: OmitStr = ""
    response_hash: OmitStr = ""
    stop_sequence: OmitStr = ""
    profile: JsonValue = None


class InferenceError(WireModel):
    """Terminal failure of one request. Build it with ``protocol.errors.inference_error_frame``."""

    type: Literal["inference_error"] = "inference_error"
    request_id: Str
    error: Str
    status_code: Int64
    error_reason: ErrorReason | None = None
    failure_code: FailureCode | None = None
    terminal_cause: TerminalCause | None = None
    attempt_usage: Usage | None = None
    rejection_reason: RejectionReason | None = None
    available_token_budget: Int64 | None = None  # pointer: explicit 0 means "busy now"
    feasible_after_ms: OmitInt = 0
    capacity_seq: Annotated[UInt64, OMIT_EMPTY] = 0
    profile: JsonValue = None


# --- attestation ---------------------------------------------------------------------------------------


class AttestationResponse(WireModel):
    """Answer to ``attestation_challenge``; the posture booleans are pointers (absent ≠ false)."""

    type: Literal["attestation_response"] = "attestation_response"
    nonce: Str
    signature: Str
    status_signature: OmitStr = ""
    public_key: Str
    hypervisor_active: Bool | None = None
    rdma_disabled: Bool | None = None
    sip_enabled: Bool | None = None
    secure_boot_enabled: Bool | None = None
    binary_hash: OmitStr = ""
    active_model_hash: OmitStr = ""
    python_hash: OmitStr = ""
    runtime_hash: OmitStr = ""
    template_hashes: OmitStrMap = Field(default_factory=dict)
    model_hashes: OmitStrMap = Field(default_factory=dict)


class CodeAttestationResponse(WireModel):
    type: Literal["code_attestation_response"] = "code_attestation_response"
    nonce: Str
    signature: Str


# --- [N] model management and capacity ------------------------------------------------------------------


class LoadModelStatus(WireModel):
    type: Literal["load_model_status"] = "load_model_status"
    model_id: Str
    status: LoadStatus
    error: OmitStr = ""


class PrefetchModelStatus(WireModel):
    type: Literal["prefetch_model_status"] = "prefetch_model_status"
    model_id: Str
    status: PrefetchStatus
    bytes_done: OmitInt = 0
    bytes_total: OmitInt = 0
    error: OmitStr = ""


class ModelsUpdate(WireModel):
    type: Literal["models_update"] = "models_update"
    models: tuple[ModelInfo, ...]
    tool_constraint_protocol: OmitInt = 0
    tool_constraint_models: OmitStrList = ()


class CapacityQuote(WireModel):
    type: Literal["capacity_quote"] = "capacity_quote"
    quote_id: Str
    capacity_seq: UInt64
    admissible_now: Bool
    rejection_reason: RejectionReason | None = None
    ttft_p50_ms: Float  # Go float64: end-to-end quantiles of real requests of this shape
    ttft_p90_ms: Float
    queue_est_ms: Float
    available_token_budget: Int64
    confidence: QuoteConfidence


class ProviderDrain(WireModel):
    """Barrier before a planned disconnect; ``request_id`` is a random barrier id (≤ 64 bytes)."""

    type: Literal["provider_drain"] = "provider_drain"
    request_id: Str


# --- [N] capability-gated exchanges a v1 provider never starts -------------------------------------------
# The coordinator's frames listed without their fields; unknown fields are kept so a decoded frame re-encodes as-is.


class PrefixCacheLookup(Opaque):
    type: Literal["prefix_cache_lookup"] = "prefix_cache_lookup"


class PrefixCacheReady(Opaque):
    type: Literal["prefix_cache_ready"] = "prefix_cache_ready"


class PrefixCacheLookupV2(Opaque):
    type: Literal["prefix_cache_lookup_v2"] = "prefix_cache_lookup_v2"


class PrefixCacheReadyV2(Opaque):
    type: Literal["prefix_cache_ready_v2"] = "prefix_cache_ready_v2"


class ModelsReplace(Opaque):
    type: Literal["models_replace"] = "models_replace"


class ModelsReplaceReady(Opaque):
    type: Literal["models_replace_ready"] = "models_replace_ready"


class AppAttestShadow(Opaque):
    """Sent in both directions ([N] App Attest shadow exchange)."""

    type: Literal["app_attest_shadow"] = "app_attest_shadow"
