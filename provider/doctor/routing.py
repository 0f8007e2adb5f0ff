"""`doctor`'s routing section: what a coordinator will see from this agent, and whether it will route.

Built from the code the agent runs: the host posture (`read_host_posture`), the hardening steps
(`provider.hardening`, run in a throwaway child so this process is left alone), `Posture` (the
`privacy_capabilities` of `register` and the posture fields of every challenge answer), the backend
and runtime hash of `register`, the advertised models (`advertised_models`, the models that can ever
load), the `total_memory_gb` the heartbeats report, and the registration attestation
(`plan_attestation`: whether `register` carries one, hence the trust level the coordinator assigns, and
why). The coordinator's side is `provider.session.gates`: its trust rules and levels, its catalog, and its
free-memory gate per model.

The catalog comes from the coordinator's public `GET /v1/models/catalog` when the coordinator check
is on and it answers; otherwise each model's own weight size stands in for the catalog size (what a
catalog entry for those weights would say).
"""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from memory import FitResult
from protocol import PrivacyCapabilities
from protocol.attest import SecurityPosture
from provider.config import Settings
from provider.hardening import NO_HARDENING, Hardening, probe_hardening
from provider.models import ModelInfo
from provider.session.attestation import GAP_TEXT, AttestationPlan, plan_attestation
from provider.session.gates import (
    REQUIRED_PRIVACY_FLAGS,
    ROUTABLE_BACKEND,
    GateVerdict,
    MemoryGate,
    TrustIssue,
    TrustLevel,
    TrustProblem,
    catalog_url,
    gate_fix,
    memory_gate,
    parse_catalog,
    routing_minimums,
    trust_problems,
)
from provider.session.posture import HostPosture, Posture, is_loopback_url, read_host_posture
from provider.session.register import advertised_models
from provider.units import GiB, gib, human_bytes

MAX_CATALOG_BYTES = 8 << 20


class SizeSource(StrEnum):
    CATALOG = "catalog"  # the coordinator's catalog size_gb
    WEIGHTS = "weights"  # no catalog to read: the weight files' size stands in
    NONE = "none"  # the catalog has no size for it: the gate is off


@dataclass(frozen=True, slots=True)
class CatalogCheck:
    url: str
    checked: bool
    reachable: bool
    detail: str  # ok | not_checked | unreachable | http_<status> | not_a_catalog
    sizes: dict[str, int | None] | None  # model id -> size bytes, when read


@dataclass(frozen=True, slots=True)
class ModelRoute:
    model_id: str
    size_source: SizeSource
    preloaded: bool
    gate: MemoryGate
    fix: str | None


@dataclass(frozen=True, slots=True)
class RoutingReport:
    backend: str
    runtime_hash: str | None
    dev_posture: bool
    dev_posture_allowed: bool  # dev_posture is off, or the coordinator is on loopback
    security: SecurityPosture
    privacy: PrivacyCapabilities
    hardening_probed: bool  # False: the child could not run; the hardening flags are then reported false
    trust: tuple[TrustProblem, ...]
    catalog: CatalogCheck
    total_bytes: int
    models: tuple[ModelRoute, ...]
    virtual_machine: bool | None = None  # the host is a VM guest (a fact for the operator, not sent)
    attestation: AttestationPlan | None = None  # None: not gathered (the trust level is then `none`)

    @property
    def trusted(self) -> bool:
        return not self.trust

    @property
    def trust_level(self) -> TrustLevel:
        """What the coordinator assigns at `register`."""
        return TrustLevel.NONE if self.attestation is None else self.attestation.trust_level


def fetch_catalog(coordinator_url: str, timeout_s: float) -> CatalogCheck:
    """GET the coordinator's catalog; never raises."""
    url = catalog_url(coordinator_url)

    def result(detail: str, sizes: dict[str, int | None] | None = None) -> CatalogCheck:
        return CatalogCheck(url, True, sizes is not None, detail, sizes)

    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            body = response.read(MAX_CATALOG_BYTES + 1)
    except urllib.error.HTTPError as exc:
        return result(f"http_{exc.code}")
    except (urllib.error.URLError, OSError, ValueError):
        return result("unreachable")
    try:
        if len(body) > MAX_CATALOG_BYTES:
            raise ValueError("too large")
        return result("ok", parse_catalog(json.loads(body)))
    except (ValueError, RecursionError):
        return result("not_a_catalog")


def gather_routing(settings: Settings, *, total_bytes: int, models: Iterable[tuple[ModelInfo, FitResult]],
                   runtime_hash: str | None, check_catalog: bool, timeout_s: float,
                   host: HostPosture | None = None, hardening: Hardening | None = None) -> RoutingReport:
    """Blocking: reads the host, runs the hardening probe (unless `hardening` is given) and, with
    `check_catalog`, one HTTP GET."""
    host = host if host is not None else read_host_posture()
    probed = hardening if hardening is not None else probe_hardening()
    posture = Posture(host, probed or NO_HARDENING, dev=settings.dev_posture)
    security, privacy = posture.security(), posture.privacy_capabilities()
    if check_catalog:
        catalog = fetch_catalog(settings.coordinator_url, timeout_s)
    else:
        catalog = CatalogCheck(catalog_url(settings.coordinator_url), False, False, "not_checked", None)
    routes = tuple(_route(m, catalog.sizes, total_bytes, settings.preload_models)
                   for m in advertised_models(models))
    return RoutingReport(
        backend=settings.backend, runtime_hash=runtime_hash, dev_posture=settings.dev_posture,
        dev_posture_allowed=not settings.dev_posture or is_loopback_url(settings.coordinator_url),
        security=security, privacy=privacy, hardening_probed=probed is not None,
        trust=trust_problems(backend=settings.backend, privacy=privacy, security=security),
        catalog=catalog, total_bytes=total_bytes, models=routes, virtual_machine=host.virtual_machine,
        attestation=plan_attestation(posture))


def _route(model, sizes: dict[str, int | None] | None, total_bytes: int, preload: tuple[str, ...]) -> ModelRoute:
    # An empty catalog (the memory store) filters nothing and gates nothing ([A] IsModelInCatalog).
    if sizes:
        in_catalog = model.id in sizes
        size, source = sizes.get(model.id), SizeSource.CATALOG if sizes.get(model.id) else SizeSource.NONE
    elif sizes is not None:
        in_catalog, size, source = True, None, SizeSource.NONE
    else:
        in_catalog, size, source = True, model.size_bytes, SizeSource.WEIGHTS
    resident = round(model.estimated_memory_gb * GiB)
    gate = memory_gate(total_bytes=total_bytes, size_bytes=size, resident_bytes=resident, in_catalog=in_catalog,
                       preloaded=model.id in preload)
    return ModelRoute(model.id, source, model.id in preload, gate, gate_fix(model.id, gate))


# --- rendering -----------------------------------------------------------------------------------------------


def untrusted_sentence(report: RoutingReport, platform: str = sys.platform) -> str:
    """Why a coordinator will not trust this machine, and the way out, in plain words."""
    fields = [p.subject for p in report.trust if p.issue is not TrustIssue.BACKEND]
    parts = []
    if fields:
        parts.append(f"{', '.join(fields)} reported false")
    if any(p.issue is TrustIssue.BACKEND for p in report.trust):
        parts.append(f"backend {report.backend!r} is not {ROUTABLE_BACKEND!r}")
    text = "; ".join(parts)
    if not report.dev_posture:
        if platform != "darwin":
            text += "; this is not a Mac (no SIP, no Secure Boot): no production coordinator will route to it"
        text += ("; for a self-hosted coordinator on this machine (loopback URL) set dev_posture = true, which "
                 "reports the posture such a coordinator requires")
    return text


SIGNING_KEY_TEXT = "a software key in a file (0600), not held in the Secure Enclave"


def trust_sentence(report: RoutingReport) -> str:
    """The trust level the coordinator assigns at `register`, why, and which minimums route it."""
    level = report.trust_level
    minimums = " or ".join(m.value for m in routing_minimums(level))
    if report.attestation is not None and report.attestation.sendable:
        why = ("register carries an attestation signed with this agent's P-256 key, with Secure Enclave, SIP and "
               "Secure Boot as the dev posture reports them (a test harness's posture, not this host's)"
               if report.dev_posture else "register carries an attestation of this host's posture (it has a Secure "
               "Enclave; SIP, Secure Boot and the sealed system volume as read) signed with this agent's P-256 key")
        why += (f"; that key is {SIGNING_KEY_TEXT}, which the coordinator cannot tell from an Enclave-held key: "
                "self_signed means exactly that")
    else:
        gaps = report.attestation.gaps if report.attestation is not None else ()
        why = "no attestation is sent: " + ("; ".join(GAP_TEXT[g] for g in gaps) or "not gathered")
    return (f"{level.value}: {why}; a coordinator routes here with EIGENINFERENCE_MIN_TRUST={minimums}"
            + ("" if level is TrustLevel.HARDWARE else " (hardware needs MDM / Apple device attestation)"))


def coordinator_requirements(report: RoutingReport) -> list[str]:
    """What the coordinator's operator must configure for this provider."""
    if report.trust_level is TrustLevel.SELF_SIGNED:
        needs = ["EIGENINFERENCE_MIN_TRUST=self_signed or none (register carries a self-signed attestation)"]
    else:
        needs = ["EIGENINFERENCE_MIN_TRUST=none (this provider sends no attestation: see the trust level)"]
    if report.runtime_hash:
        needs.append(f"EIGENINFERENCE_KNOWN_RUNTIME_HASHES listing {report.runtime_hash} (the runtime_hash this "
                     "provider sends; without a manifest an [A] coordinator routes to no one)")
    needs.append(f"a coordinator that routes backend {report.backend!r} ([A] routes inprocess-mlx; [N] only mlx-swift)")
    return needs


def routing_json(report: RoutingReport) -> dict[str, Any]:
    """The stable `routing` section of `doctor --json` (keys are only ever added)."""
    s = report.security
    return {
        "coordinator_sees": {
            "backend": report.backend,
            "runtime_hash": report.runtime_hash,
            "dev_posture": report.dev_posture,
            "posture": {"sip_enabled": s.sip_enabled, "secure_boot_enabled": s.secure_boot_enabled,
                        "rdma_disabled": s.rdma_disabled, "hypervisor_active": s.hypervisor_active},
            "privacy_capabilities": report.privacy.model_dump(exclude_none=True),
            "total_memory_gb": round(report.total_bytes / GiB, 4),
            "hardening_probed": report.hardening_probed,
        },
        "virtual_machine": report.virtual_machine,
        "trusted": report.trusted,
        "untrusted_reasons": [{"code": p.issue.value, "subject": p.subject} for p in report.trust],
        "trust_level": _trust_json(report),
        "required_privacy_capabilities": list(REQUIRED_PRIVACY_FLAGS),
        "coordinator_must": coordinator_requirements(report),
        "catalog": {"url": report.catalog.url, "checked": report.catalog.checked,
                    "reachable": report.catalog.reachable, "detail": report.catalog.detail,
                    "models": None if report.catalog.sizes is None else len(report.catalog.sizes)},
        "models": [_model_json(r) for r in report.models],
    }


def _trust_json(report: RoutingReport) -> dict[str, Any]:
    plan = report.attestation
    return {
        "level": report.trust_level.value,
        "attestation_sent": plan is not None and plan.sendable,
        "routes_at_min_trust": [m.value for m in routing_minimums(report.trust_level)],
        "reasons": [] if plan is None else [{"code": g.value, "detail": GAP_TEXT[g]} for g in plan.gaps],
        "detail": trust_sentence(report),
        "signing_key": SIGNING_KEY_TEXT,
        "attestation": None if plan is None else {
            "secureEnclaveAvailable": plan.secure_enclave_available, "sipEnabled": plan.sip_enabled,
            "secureBootEnabled": plan.secure_boot_enabled, "authenticatedRootEnabled": plan.authenticated_root_enabled,
            "rdmaDisabled": plan.rdma_disabled, "hypervisorActive": plan.hypervisor_active},
    }


def _model_json(r: ModelRoute) -> dict[str, Any]:
    g = r.gate
    return {
        "id": r.model_id,
        "verdict": g.verdict.value,
        "fix": r.fix,
        "preloaded": r.preloaded,
        "size_source": r.size_source.value,
        "size_bytes": g.size_bytes,
        "kv_estimate_bytes": g.kv_estimate_bytes,
        "total_bytes": g.total_bytes,
        "cold": {"required_bytes": g.cold_required_bytes, "free_bytes": g.total_bytes, "passes": g.cold_passes},
        "warm": {"required_bytes": g.warm_required_bytes, "free_bytes": g.warm_free_bytes, "passes": g.warm_passes},
    }


def routing_lines(report: RoutingReport) -> list[str]:
    """The human section."""
    s, p = report.security, report.privacy
    out = ["Routing (what a coordinator sees from this agent)"]
    flags = ", ".join(f"{name} {str(getattr(p, name)).lower()}" for name in REQUIRED_PRIVACY_FLAGS)
    out.append(f"  backend {report.backend}, runtime hash {report.runtime_hash or 'unavailable'}, "
               f"total memory {gib(report.total_bytes)}" + (", dev_posture" if report.dev_posture else ""))
    secure_boot = "unknown (not sent)" if s.secure_boot_enabled is None else str(s.secure_boot_enabled).lower()
    out.append(f"  posture: sip_enabled {str(s.sip_enabled).lower()}, secure_boot_enabled "
               f"{secure_boot}, rdma_disabled {str(s.rdma_disabled).lower()}, "
               f"hypervisor_active {str(s.hypervisor_active).lower()} (this agent does not isolate model "
               "memory in a hypervisor" + (", and a VM guest is not that" if report.virtual_machine else "") + ")")
    out.append(f"  privacy capabilities: {flags}")
    out.append("  trust level " + trust_sentence(report))
    if report.trusted:
        out.append("  trust: a coordinator with the settings below will route to it")
    else:
        out.append("  UNTRUSTED: a coordinator will treat this machine as untrusted and route nothing to it: "
                   + untrusted_sentence(report))
    out.append("  the coordinator's operator must set:")
    out += [f"    {need}" for need in coordinator_requirements(report)]
    c = report.catalog
    catalog = {"ok": f"read ({len(c.sizes or {})} models)", "not_checked": "not checked (weight sizes stand in)"}
    out.append(f"  catalog {c.url}: {catalog.get(c.detail, c.detail + ' (weight sizes stand in)')}")
    for r in report.models:
        verdict = r.gate.verdict.value.replace("_", " ")
        size = "-" if r.gate.size_bytes is None else f"{human_bytes(r.gate.size_bytes)} ({r.size_source.value})"
        out.append(f"  {r.model_id}: memory gate {verdict}; size {size}, needs + {gib(r.gate.kv_estimate_bytes)} "
                   "KV at the default max_tokens" + (f"; fix: {r.fix}" if r.fix else ""))
    return out


BLOCKING = frozenset({GateVerdict.BLOCKED, GateVerdict.BLOCKED_COLD})

__all__ = ["BLOCKING", "CatalogCheck", "ModelRoute", "RoutingReport", "SizeSource", "coordinator_requirements",
           "fetch_catalog", "gather_routing", "routing_json", "routing_lines", "trust_sentence",
           "untrusted_sentence"]
