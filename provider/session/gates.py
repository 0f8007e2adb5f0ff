"""The [A] coordinator's routing gates as pure functions, so ``doctor`` can say from what this agent
sends whether a coordinator will route to it.

Trust (``trust_problems``): [A] routes private text only to a provider whose ``register`` has
``backend: inprocess-mlx`` and the seven required privacy booleans true
(``providerSupportsPrivateTextLocked``), and whose challenge answers report ``sip_enabled: true``,
``secure_boot_enabled`` not false, and ``rdma_disabled`` true unless a hypervisor is active
(``verifyChallengeResponse``: a failure marks the provider untrusted). [N] routes only ``mlx-swift``.

Trust level (``TrustLevel``, [A] registry.go): ``none`` without a valid registration attestation,
``self_signed`` with one (provider.go ``verifyProviderAttestation``; what it takes is
``provider.session.attestation``), ``hardware`` only after MDM / Apple device attestation, which a
Python provider cannot get. The scheduler skips a provider whose level ranks below the coordinator's
``EIGENINFERENCE_MIN_TRUST`` (default ``hardware``): ``routing_minimums`` lists the settings that route it.

Free-memory gate (``memory_gate``, [A] ``freeMemoryAdmits``): active only when the coordinator's
catalog has a size for the model. A request passes when
``size (0 if the model's slot is running) + (prompt + max_tokens) × 400 000 bytes ≤ total − active``,
with ``total`` / ``active`` the heartbeat's ``total_memory_gb`` / ``gpu_memory_active_gb``. A request
that no provider passes waits in the coordinator's queue (120 s), then fails. Sizes here are bytes;
the catalog's ``size_gb`` is read in the unit we report ``total_memory_gb`` in (GiB).

Catalog (``catalog_url``, ``parse_catalog``): the coordinator's public ``GET /v1/models/catalog``,
read as ``{"models": [{"id", "size_gb", …}]}`` (a ``data`` list or a bare list are accepted too).
A non-empty catalog also drops, at register, every model whose id it does not list.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from protocol import PrivacyCapabilities
from protocol.attest import SecurityPosture
from provider.units import GiB, gib

ROUTABLE_BACKEND = "inprocess-mlx"  # [A]; [N] routes only "mlx-swift"
REQUIRED_PRIVACY_FLAGS: tuple[str, ...] = (  # [A] providerSupportsPrivateTextLocked
    "text_backend_inprocess",
    "text_proxy_disabled",
    "python_runtime_locked",
    "dangerous_modules_blocked",
    "anti_debug_enabled",
    "core_dumps_disabled",
    "env_scrubbed",
)
KV_BYTES_PER_TOKEN = 400_000  # freeMemoryAdmits' KV estimate per token
COORDINATOR_MAX_TOKENS = 8192  # what [A] injects when the consumer names no output bound
CATALOG_PATH = "/v1/models/catalog"


class TrustLevel(StrEnum):
    NONE = "none"
    SELF_SIGNED = "self_signed"
    HARDWARE = "hardware"


TRUST_RANK: dict[TrustLevel, int] = {TrustLevel.NONE: 0, TrustLevel.SELF_SIGNED: 1, TrustLevel.HARDWARE: 2}


def routing_minimums(level: TrustLevel) -> tuple[TrustLevel, ...]:
    """The ``EIGENINFERENCE_MIN_TRUST`` values under which [A] routes a provider at ``level`` (trustRank)."""
    return tuple(m for m in TrustLevel if TRUST_RANK[m] <= TRUST_RANK[level])


class TrustIssue(StrEnum):
    BACKEND = "backend_not_routable"
    PRIVACY_CAPABILITY = "privacy_capability_false"
    SIP_DISABLED = "sip_disabled"
    SECURE_BOOT_DISABLED = "secure_boot_disabled"
    RDMA_ENABLED = "rdma_enabled"


@dataclass(frozen=True, slots=True)
class TrustProblem:
    issue: TrustIssue
    subject: str  # the field (or backend) at fault


def trust_problems(*, backend: str, privacy: PrivacyCapabilities, security: SecurityPosture) -> tuple[TrustProblem, ...]:
    """Everything in ``register`` and the challenge answers that keeps [A] from routing to us."""
    found: list[TrustProblem] = []
    if backend != ROUTABLE_BACKEND:
        found.append(TrustProblem(TrustIssue.BACKEND, backend))
    found += [TrustProblem(TrustIssue.PRIVACY_CAPABILITY, flag) for flag in REQUIRED_PRIVACY_FLAGS
              if not getattr(privacy, flag)]
    if not security.sip_enabled:
        found.append(TrustProblem(TrustIssue.SIP_DISABLED, "sip_enabled"))
    if security.secure_boot_enabled is False:
        found.append(TrustProblem(TrustIssue.SECURE_BOOT_DISABLED, "secure_boot_enabled"))
    if not security.rdma_disabled and not security.hypervisor_active:
        found.append(TrustProblem(TrustIssue.RDMA_ENABLED, "rdma_disabled"))
    return tuple(found)


# --- the free-memory gate -----------------------------------------------------------------------------------


class GateVerdict(StrEnum):
    PASSES = "passes"  # a cold request passes
    PASSES_PRELOADED = "passes_preloaded"  # preloaded: the slot is running, the weights count as 0
    BLOCKED_COLD = "blocked_cold"  # refused until the model is loaded: preload it
    BLOCKED = "blocked"  # refused even with the model loaded, at the default max_tokens
    NOT_GATED = "not_gated"  # the catalog has no size for it (or no catalog): the gate is off
    NOT_IN_CATALOG = "not_in_catalog"  # dropped at register: nothing routes to it


@dataclass(frozen=True, slots=True)
class MemoryGate:
    verdict: GateVerdict
    size_bytes: int | None  # what the gate counts for the weights of a cold model
    kv_estimate_bytes: int  # (prompt + max_tokens) × 400 000
    total_bytes: int  # the total_memory_gb we report
    cold_required_bytes: int | None
    warm_required_bytes: int  # the KV estimate; the resident weights count as active instead
    warm_free_bytes: int  # total − the model's resident weights

    @property
    def cold_passes(self) -> bool:
        return self.cold_required_bytes is not None and self.cold_required_bytes <= self.total_bytes

    @property
    def warm_passes(self) -> bool:
        return self.warm_required_bytes <= self.warm_free_bytes


def memory_gate(*, total_bytes: int, size_bytes: int | None, resident_bytes: int, in_catalog: bool = True,
                preloaded: bool = False, max_tokens: int = COORDINATOR_MAX_TOKENS,
                prompt_tokens: int = 0) -> MemoryGate:
    """The gate for one model on an otherwise idle provider. ``size_bytes`` None: no catalog size, the
    gate is off. ``resident_bytes``: what the model occupies once loaded (our padded estimate)."""
    kv = (prompt_tokens + max_tokens) * KV_BYTES_PER_TOKEN
    warm_free = total_bytes - resident_bytes
    cold = None if size_bytes is None else size_bytes + kv
    gate = MemoryGate(GateVerdict.PASSES, size_bytes, kv, total_bytes, cold, kv, warm_free)
    if not in_catalog:
        verdict = GateVerdict.NOT_IN_CATALOG
    elif size_bytes is None:
        verdict = GateVerdict.NOT_GATED
    elif preloaded:
        verdict = GateVerdict.PASSES_PRELOADED if gate.warm_passes else GateVerdict.BLOCKED
    elif gate.cold_passes:
        verdict = GateVerdict.PASSES
    else:
        verdict = GateVerdict.BLOCKED_COLD if gate.warm_passes else GateVerdict.BLOCKED
    return MemoryGate(verdict, size_bytes, kv, total_bytes, cold, kv, warm_free)


def gate_fix(model_id: str, gate: MemoryGate) -> str | None:
    """The one-line fix for a gate that stops requests, None when there is nothing to fix."""
    match gate.verdict:
        case GateVerdict.BLOCKED_COLD:
            assert gate.size_bytes is not None
            return (f'preload it: preload_models = ["{model_id}"] (cold, the coordinator counts its size '
                    f"{gib(gate.size_bytes)} + {gib(gate.kv_estimate_bytes)} KV against "
                    f"{gib(gate.total_bytes)}; loaded and running, no weights)")
        case GateVerdict.BLOCKED:
            return (f"the coordinator wants {gib(gate.kv_estimate_bytes)} free beside the weights for a request "
                    f"with max_tokens {COORDINATOR_MAX_TOKENS}; this machine reports {gib(gate.total_bytes)}: "
                    "only requests with a small max_tokens get through, or serve a smaller model")
        case GateVerdict.NOT_IN_CATALOG:
            return ("the coordinator's catalog does not list this id, so register drops it: serve it under a "
                    "catalog id (model_aliases = {\"<catalog id>\" = \"<path>\"})")
    return None


# --- the catalog ---------------------------------------------------------------------------------------------


def catalog_url(coordinator_url: str) -> str:
    """The coordinator's HTTP origin (ws → http, wss → https) + ``/v1/models/catalog``."""
    parts = urlsplit(coordinator_url)
    scheme = {"ws": "http", "wss": "https"}.get(parts.scheme, parts.scheme)
    host = parts.hostname or ""
    netloc = (f"[{host}]" if ":" in host else host) + (f":{parts.port}" if parts.port is not None else "")
    return urlunsplit((scheme, netloc, CATALOG_PATH, "", ""))


def parse_catalog(document: Any) -> dict[str, int | None]:
    """Model id → catalog size in bytes (None when the entry has no usable ``size_gb``). Raises
    ``ValueError`` when the document is not a catalog."""
    entries = document
    if isinstance(document, Mapping):
        entries = document.get("models", document.get("data"))
    if not isinstance(entries, list):
        raise ValueError("not a model catalog")
    catalog: dict[str, int | None] = {}
    for entry in entries:
        if not isinstance(entry, Mapping) or not isinstance(entry.get("id"), str) or not entry["id"]:
            continue
        size = entry.get("size_gb")
        valid = isinstance(size, int | float) and not isinstance(size, bool) and 0 < size < 1 << 20
        catalog[entry["id"]] = round(size * GiB) if valid else None
    return catalog


__all__ = [
    "CATALOG_PATH",
    "COORDINATOR_MAX_TOKENS",
    "KV_BYTES_PER_TOKEN",
    "REQUIRED_PRIVACY_FLAGS",
    "ROUTABLE_BACKEND",
    "TRUST_RANK",
    "GateVerdict",
    "MemoryGate",
    "TrustIssue",
    "TrustLevel",
    "TrustProblem",
    "catalog_url",
    "gate_fix",
    "memory_gate",
    "parse_catalog",
    "routing_minimums",
    "trust_problems",
]
