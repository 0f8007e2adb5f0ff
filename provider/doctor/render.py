"""Printing a `DoctorReport`: `render_table` (the human output: aligned sections, human units) and
`report_json` (the stable `doctor --json` document the package docstring describes)."""

from __future__ import annotations

import dataclasses
import os
import platform
import sys
import time
from typing import Any

from memory import CapFigures, DeviceMemory, MemorySnapshot
from provider.doctor.guest import guest_json, guest_lines
from provider.doctor.report import DoctorReport, ModelReport, broken_text
from provider.doctor.routing import routing_json, routing_lines
from provider.models import Inventory, Quantization
from provider.models.activation import reserve_json
from provider.models.kv import KV_QUANTIZATION_BITS, at_dtype, kv_quantization_setting, quantization_refusal, quantized
from provider.models.searched import place_lines
from provider.session.status import trust_line
from provider.units import GiB, human_bytes, table

INDENT = "  "  # a section's lines under its heading


def quantization_text(q: Quantization | None, dtype: str) -> str:
    if q is None:
        return dtype
    return f"{q.bits}-bit {q.mode.value} g{q.group_size}"


def report_json(report: DoctorReport) -> dict[str, Any]:
    """The stable `doctor --json` document (see the module docstring)."""
    cap = dataclasses.asdict(report.cap)
    cap.update({k.removesuffix("_bytes") + "_gib": round(v / GiB, 3)
                for k, v in list(cap.items()) if k.endswith("_bytes") and isinstance(v, int)})
    snap = report.snapshot
    return {
        "ok": report.ok,
        "machine": {
            "platform": sys.platform,
            "arch": platform.machine(),
            "cpu_count": os.cpu_count(),
            "hypothetical": report.hypothetical,
            "machine_bytes": snap.machine_bytes,
            "cgroup_limit_bytes": snap.cgroup_limit_bytes,
            "memory_limit_bytes": snap.memory_limit_bytes,
            "physical_bytes": snap.physical_bytes,
            "available_bytes": snap.available_bytes,
            # what the figures above are of: the machine's RAM (unified) or a GPU's own (discrete)
            "device_memory": snap.device_memory.value,
            "host_physical_bytes": snap.host_physical_bytes,
            "host_available_bytes": snap.host_available_bytes,
        },
        "cap": cap,
        "pressure": {"level": report.pressure.level.name.lower(), "utilization": report.pressure.utilization},
        "runtime_hash": report.runtime_hash,
        "models": [_model_json(r, report.cap, report.broken.get(r.model.id)) for r in report.models],
        "skipped": [{"id": s.id, "path": str(s.path), "reason": s.reason.value} for s in report.inventory.skipped],
        "searched": [p.as_json() for p in report.inventory.searched],
        "coordinator": {"url": report.coordinator.url, "checked": report.coordinator.checked,
                        "reachable": report.coordinator.reachable, "detail": report.coordinator.detail.value,
                        "http_status": report.coordinator.http_status},
        "problems": [{"code": p.code.value, "severity": p.severity.value, "subject": p.subject, "detail": p.detail}
                     for p in report.problems],
        "settings_adjusted": [{"variable": a.variable, "given": a.given, "used": a.used, "action": a.action.value,
                               "rule": a.rule} for a in report.policy.adjustments],
        "routing": None if report.routing is None else routing_json(report.routing),
        "agent": {"running": report.agent is not None,
                  "restart": None if report.agent is None else report.agent.get("restart"),
                  "baseline": None if report.agent is None else report.agent.get("baseline"),
                  "trust": report.trust},
        "guest": None if report.guest is None else guest_json(report.guest),
        "crash_loop": report.crash_loop.as_json(),
    }


def kv_room_tokens(cap: CapFigures, r: ModelReport) -> dict[str, int | None]:
    """Tokens of KV the cap leaves beside the model alone (its weights and the activation reserve), for
    each kv_quantization (None: the setting cannot apply to this model)."""
    plain = at_dtype(r.model.kv)
    refused = r.model.is_vision or quantization_refusal(plain) is not None
    room = cap.kv_budget_bytes(r.fit.weights_bytes, activation_reserve_bytes=r.model.activation_reserve_bytes)
    return {setting: None if bits is not None and refused
            else room // max(1, (plain if bits is None else quantized(plain, bits)).max_bytes_per_token)
            for setting, bits in KV_QUANTIZATION_BITS.items()}


def _model_json(r: ModelReport, cap: CapFigures, broken: dict[str, Any] | None = None) -> dict[str, Any]:
    m = r.model
    q = m.quantization
    return {
        "id": m.id,
        "path": str(m.path),
        "source": m.source.value,
        "weight_bytes": m.weight_bytes,
        "quantization": None if q is None else {"bits": q.bits, "group_size": q.group_size, "mode": q.mode.value},
        "dtype": m.dtype.value,
        "context_length": m.context_length,
        "kv_bytes_per_token": m.kv_bytes_per_token,
        # the form its KV is kept quantized in (kv_quantization), or why the setting asked was not applied
        "kv_quantization": {"bits": None if m.kv_bits is None else m.kv_bits.as_json(),
                            "refused": m.kv_quantization_refused or None},
        "kv_room_tokens": kv_room_tokens(cap, r),  # beside this model alone, for each kv_quantization
        # what its passes hold at most: measured at its last load (stored), else its config's estimate
        "activation_reserve": reserve_json(m, cap),
        "verdict": r.fit.verdict.value,
        "required_bytes": r.fit.required_bytes,
        "ever_fits": r.fit.ever_fits,
        # what the model can do, as /v1/models says it (null: its tokenizer could not be read)
        "capabilities": {"tools": m.tools},
        # the running agent failed to load it and remembers why (null: it did not, or no agent answers)
        "broken": broken,
    }


def activation_text(reserve: dict[str, Any]) -> str:
    """A model's activation reserve in a table cell: its size and where it comes from."""
    text = f"{human_bytes(reserve['bytes'])} {reserve['source']}"
    if reserve["measured_peak_bytes"] is not None:
        text += f" (peak {human_bytes(reserve['measured_peak_bytes'])} at {reserve['measured_peak_tokens']} tokens)"
    return text


def _looked_in(inventory: Inventory) -> list[str]:
    """Where discovery looked, each place and whether it is there."""
    lines = place_lines(inventory.searched, indent="    ")
    return ["  looked in:", *lines] if lines else ["  looked in: nowhere (no source configured)"]


def _memory_rows(snap: MemorySnapshot) -> list[tuple[str, str]]:
    """The memory MLX allocates from (what the cap is taken of), and on a discrete GPU the host's RAM."""
    if snap.device_memory is DeviceMemory.DISCRETE:
        return [("memory", f"{human_bytes(snap.machine_bytes or snap.physical_bytes)} GPU memory (discrete: "
                           "the cap is taken of it)"),
                ("host RAM", f"{human_bytes(snap.host_physical_bytes or 0)}, "
                             f"{human_bytes(snap.host_available_bytes or 0)} available (not under the cap)")]
    return [("memory", f"{human_bytes(snap.machine_bytes or snap.physical_bytes)} (unified: MLX allocates "
                       "from the machine's RAM)"),
            ("cgroup limit", human_bytes(snap.cgroup_limit_bytes) if snap.cgroup_limit_bytes else "none")]


def render_table(report: DoctorReport) -> str:
    """The human `doctor` output: aligned sections, human units."""
    snap, cap = report.snapshot, report.cap
    out = ["Machine" + (" (hypothetical, --machine-gb)" if report.hypothetical else "")]
    out += table([
        ("platform", f"{sys.platform} {platform.machine()}, {os.cpu_count()} CPUs"),
        *_memory_rows(snap),
        ("memory_limit_gb", human_bytes(snap.memory_limit_bytes) if snap.memory_limit_bytes else "unset"),
        ("available now", human_bytes(snap.available_bytes)),
    ], INDENT)
    out += ["", "Memory cap (what the agent enforces)"]
    out += table([
        ("physical", human_bytes(cap.physical_bytes)),
        ("hard cap", f"{human_bytes(cap.hard_cap_bytes)}  (min({cap.cap_fraction:g} x physical, physical - 2 GiB))"),
        ("effective cap", f"{human_bytes(cap.effective_cap_bytes)}  (min(hard cap, physical - memory_reserve))"),
        ("load reserve", human_bytes(cap.load_reserve_bytes)),
        ("activation reserve", human_bytes(cap.activation_reserve_bytes) + " (DARKBLOOM_ACTIVATION_RESERVE_GB)"
         if cap.activation_reserve_set else "each model's own (see Models: measured at its load, else estimated)"),
        ("pressure", f"{report.pressure.level.name.lower()} ({report.pressure.utilization:.0%} of physical; "
                     "this process, nothing loaded)"),
    ], INDENT)
    out += ["", f"Runtime hash  {report.runtime_hash or 'unavailable'}", ""]
    out.append(f"Models ({len(report.models)}; fit with nothing loaded, so nothing evictable)")
    if report.models:
        rows = [("id", "size", "quantization", "context", "activations", "needs", "verdict", "kv",
                 "KV room, tokens (none / q8 / q4)", "tools")]
        for r in report.models:
            m = r.model
            room = kv_room_tokens(cap, r)
            rows.append((m.id, human_bytes(m.weight_bytes), quantization_text(m.quantization, m.dtype.value),
                         str(m.context_length or "-"), activation_text(reserve_json(m, cap)),
                         human_bytes(r.fit.required_bytes), r.fit.verdict.value,
                         kv_quantization_setting(m.kv_bits) if m.kv_bits
                         else ("none (refused)" if m.kv_quantization_refused else "none"),
                         " / ".join("-" if room[s] is None else f"{room[s]:,}" for s in KV_QUANTIZATION_BITS),
                         {True: "yes", False: "no", None: "-"}[m.tools]))
        out += table(rows, INDENT)
        for r in report.models:
            if r.model.kv_quantization_refused:
                out.append(f"  {r.model.id}: kv_quantization not applied: {r.model.kv_quantization_refused}")
            if r.model.id in report.broken:
                out.append(f"  {r.model.id}: broken (the running agent's load failed): "
                           f"{broken_text(report.broken[r.model.id])}")
    for s in report.inventory.skipped:
        out.append(f"  skipped {s.id or s.path}: {s.reason.value}")
    out += _looked_in(report.inventory)
    c = report.coordinator
    reach = "not checked" if not c.checked else ("reachable" if c.reachable else f"UNREACHABLE ({c.detail.value}"
                                                  + (f", HTTP {c.http_status}" if c.http_status else "") + ")")
    out += ["", f"Coordinator  {c.url}  {reach}", ""]
    if report.routing is not None:
        out += routing_lines(report.routing) + [""]
    if report.agent is not None:
        restart, baseline = report.agent.get("restart", {}), report.agent.get("baseline", {})
        reason = f" ({restart['reason']})" if restart.get("reason") else ""
        out += [f"Running agent  restart {restart.get('recommendation', '?')}{reason}; no-model baseline drift "
                f"{human_bytes(baseline.get('drift_bytes'))} ({baseline.get('drift_pct', 0)} % of the cap) since start",
                f"  {trust_line(report.trust, time.time())}", ""]
    if report.guest is not None:
        out += guest_lines(report.guest) + [""]
    if report.problems:
        out.append("Problems")
        out += table([(p.severity.value.upper(), p.code.value, p.subject or "-",
                        p.explanation + (f": {p.detail}" if p.detail else "")) for p in report.problems], INDENT)
    out.append("OK" if report.ok else "NOT OK: fix the errors above")
    return "\n".join(out)
