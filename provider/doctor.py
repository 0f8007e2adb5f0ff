"""`darkbloom-provider doctor`: what this machine would advertise, and whether anything is wrong.

Every number comes from `memory/` -- the same functions the agent enforces -- so the doctor cannot
disagree with the load gate:

* cap figures: `memory.figures(P)` where `P` is the probe's physical size (machine RAM lowered to a
  cgroup limit and to `memory_limit_gb`), with the operator's `memory_reserve_gb`;
* pressure: `memory.pressure(snapshot)` of *this* process (it has loaded nothing, so MLX usage is 0;
  the running agent's own pressure is in `darkbloom-provider status`);
* the running agent (its loopback `/status`, when one answers): the restart recommendation and the
  coordinator's last `trust_status` (trust level, status, reason; `agent.trust` in `--json`);
* per model: `memory.fit(figures, snapshot, weight_bytes, evictable_bytes=0)` -- nothing is loaded
  in the doctor's process, so nothing is evictable and `fits_now` / `too_large` are the only answers.

Problems (`Problem`) come in two severities. An ERROR makes `doctor` exit 1:

* ``no_models``             nothing servable was discovered;
* ``enabled_model_missing`` an id in `enabled_models` was found nowhere;
* ``reserve_leaves_no_room`` the reserves leave no room for any model on this machine (subject: the
                            settings that take it, e.g. ``memory_reserve_gb``); replaces the
                            ``model_never_fits`` it would otherwise cause for every model;
* ``model_never_fits``      a model needs more than the effective cap even on an idle machine;
* ``coordinator_unreachable`` the WebSocket handshake to `coordinator_url` did not complete
  (skipped with `--no-coordinator`);
* ``memory_fatal``          projected utilization is at the FATAL watermark.

* ``dev_posture_refused``   `dev_posture` with a coordinator that is not on loopback: the agent refuses
  to start (dev_posture is for a self-hosted coordinator on this machine only).
* ``service_stayed_down``   the last start found `crash_loop_limit` abnormal exits within
  `crash_loop_window_mins` (the agent's own count in the state directory, `provider/supervision.py`)
  and the launchd service stayed down for them: it starts again at the next login or boot (once the
  window has passed) or with `service install`.

WARNINGs are printed but keep exit 0: ``model_skipped`` (a broken or partial model folder, or one
whose chat template passes its time or memory bound on the agent's start-up check, which `doctor`
and `models` repeat: ``chat_template_timeout``, ``chat_template_memory``),
``unrecognised_env`` (a `DARKBLOOM_*` variable nothing reads), ``runtime_hash_unavailable``,
``setting_rejected`` / ``setting_clamped`` (a memory-policy variable that was not usable as given:
the detail says what was given and what was used instead), ``ssd_tier_unavailable`` (the state
directory cannot hold the KV SSD tier -- read-only, someone else's, a file in the way: the agent
starts without it; subject: the OS error's name). That check creates `state_dir/kvcache` (0700) as
the agent would, and writes and removes one probe file there. From the routing section
(`provider/doctor_routing.py`): ``coordinator_untrusted`` (a coordinator will route nothing here:
the posture or privacy capabilities it requires are reported false -- always so on Linux without
`dev_posture`; subject: the fields), ``memory_gate_blocks`` (the coordinator's free-memory gate
refuses requests for a model, cold or always; subject: the model; detail: the fix, e.g. preload it),
``not_in_catalog`` (the coordinator's catalog does not list the model: it is dropped at register).
From the owner's-Mac section (`provider/doctor_guest.py`: the serving windows, whether one is open and
the next change, every signal's reading): ``signal_unavailable`` (a pause rule is on but its signal
cannot be read here; subject: the setting, detail: the reader's source). From the service's own
count: ``abnormal_exits`` (the agent ended abnormally — a crash, a kill, a memory self-restart, an
error exit — within `crash_loop_window_mins`, fewer times than it takes to stay down; the detail
counts each kind), ``crash_loop_guard_off`` (the state directory cannot take that count, e.g. a full
disk: the agent serves without the guard; subject: the OS error's name; one probe written and removed).
An invalid configuration never reaches this module: the CLI exits 78 with one line first.

`report_json()` is a stable interface (keys are only ever added): ``cap`` holds every
`CapFigures` field (bytes) plus ``*_gib`` conveniences, ``pressure`` {level, utilization},
``runtime_hash``, ``models`` [{id, path, source, weight_bytes, quantization, context_length,
kv_bytes_per_token, verdict, required_bytes, ever_fits, capabilities {tools}}] (``tools``: the model
calls tools, as `/v1/models` says; null when its tokenizer could not be read), ``skipped`` [{id, path, reason}],
``searched`` [{source: alias | model_dir | hf_cache, id (an alias's), path, exists}] (where discovery
looked; ``no_models`` names them too),
``coordinator`` {url, checked, reachable, detail}, ``machine`` {...}, ``problems`` [{code, severity,
subject, detail}], ``settings_adjusted`` [{variable, given, used, action, rule}], ``ok``, ``crash_loop``
{abnormal_exits [{at, kind: crash | memory_restart | error_exit}], stayed_down_at}, and
``routing`` (`doctor_routing.routing_json`: ``coordinator_sees`` {backend, runtime_hash, dev_posture,
posture, privacy_capabilities, total_memory_gb, hardening_probed}, ``trusted``,
``untrusted_reasons`` [{code, subject}], ``trust_level`` {level (none | self_signed: what the coordinator
assigns at register), attestation_sent, routes_at_min_trust [levels], reasons [{code, detail}] (why no
attestation), detail, attestation {the blob's security values; null = unknown}}, ``coordinator_must`` [text], ``catalog`` {url, checked,
reachable, detail, models}, ``models`` [{id, verdict, fix, preloaded, size_source, size_bytes,
kv_estimate_bytes, total_bytes, cold {required_bytes, free_bytes, passes}, warm {...}}]; null for
`models`, which does not gather it), ``guest`` (`doctor_guest.guest_json`: windows, timezone,
window_open, next_window_change (unix) and _local, state, reason, retry_after_s, signals {idle_s,
idle_source, on_battery, power_source, thermal}, rules; null for `models`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import platform
import socket
import ssl
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import memory
from kvcache.disk import KVCACHE_DIR, check_writable_dir, os_error_name
from memory import (
    ROOM_CAUSE_SETTING,
    CapFigures,
    DeviceMemory,
    EnvAction,
    EnvAdjustment,
    FitResult,
    MemorySnapshot,
    PolicySettings,
    Pressure,
    PressureLevel,
    Probe,
    RoomCause,
)
from memory.probe import no_mlx_counters
from provider.config import Settings, policy_settings, unrecognised_env
from provider.control import find_status
from provider.doctor_guest import GuestReport, gather_guest, guest_json, guest_lines
from provider.doctor_routing import (
    BLOCKING,
    RoutingReport,
    gather_routing,
    routing_json,
    routing_lines,
    untrusted_sentence,
)
from provider.hardening import Hardening
from provider.models import Inventory, ModelInfo, Quantization, discover_models
from provider.models.searched import PULL_HINT, README_MODELS_HEADING, place_lines, places_text
from provider.models.template import TemplateBound
from provider.models.template_check import check_inventory, without_unservable
from provider.session.status import trust_line
from provider.supervision import AbnormalExits, guard_unwritable, read_abnormal_exits
from provider.units import GiB, human_bytes, table

DEFAULT_COORDINATOR_TIMEOUT_S = 5.0
INDENT = "  "  # a section's lines under its heading

class Severity(StrEnum):
    ERROR = "error"
    WARNING = "warning"


class ProblemCode(StrEnum):
    NO_MODELS = "no_models"
    ENABLED_MODEL_MISSING = "enabled_model_missing"
    MODEL_NEVER_FITS = "model_never_fits"
    NO_ROOM = "reserve_leaves_no_room"
    COORDINATOR_UNREACHABLE = "coordinator_unreachable"
    MEMORY_FATAL = "memory_fatal"
    MODEL_SKIPPED = "model_skipped"
    UNRECOGNISED_ENV = "unrecognised_env"
    RUNTIME_HASH_UNAVAILABLE = "runtime_hash_unavailable"
    SETTING_REJECTED = "setting_rejected"
    SETTING_CLAMPED = "setting_clamped"
    SSD_TIER_UNAVAILABLE = "ssd_tier_unavailable"
    DEV_POSTURE_REFUSED = "dev_posture_refused"
    COORDINATOR_UNTRUSTED = "coordinator_untrusted"
    MEMORY_GATE_BLOCKS = "memory_gate_blocks"
    NOT_IN_CATALOG = "not_in_catalog"
    RESTART_ADVISED = "restart_advised"
    RESTART_NEEDED = "restart_needed"
    SIGNAL_UNAVAILABLE = "signal_unavailable"
    SERVICE_STAYED_DOWN = "service_stayed_down"
    ABNORMAL_EXITS = "abnormal_exits"
    CRASH_LOOP_GUARD_OFF = "crash_loop_guard_off"


_SEVERITY: dict[ProblemCode, Severity] = {
    ProblemCode.NO_MODELS: Severity.ERROR,
    ProblemCode.ENABLED_MODEL_MISSING: Severity.ERROR,
    ProblemCode.MODEL_NEVER_FITS: Severity.ERROR,
    ProblemCode.NO_ROOM: Severity.ERROR,
    ProblemCode.COORDINATOR_UNREACHABLE: Severity.ERROR,
    ProblemCode.MEMORY_FATAL: Severity.ERROR,
    ProblemCode.MODEL_SKIPPED: Severity.WARNING,
    ProblemCode.UNRECOGNISED_ENV: Severity.WARNING,
    ProblemCode.RUNTIME_HASH_UNAVAILABLE: Severity.WARNING,
    ProblemCode.SETTING_REJECTED: Severity.WARNING,
    ProblemCode.SETTING_CLAMPED: Severity.WARNING,
    ProblemCode.SSD_TIER_UNAVAILABLE: Severity.WARNING,
    ProblemCode.DEV_POSTURE_REFUSED: Severity.ERROR,
    ProblemCode.COORDINATOR_UNTRUSTED: Severity.WARNING,
    ProblemCode.MEMORY_GATE_BLOCKS: Severity.WARNING,
    ProblemCode.NOT_IN_CATALOG: Severity.WARNING,
    ProblemCode.RESTART_ADVISED: Severity.WARNING,
    ProblemCode.RESTART_NEEDED: Severity.ERROR,
    ProblemCode.SIGNAL_UNAVAILABLE: Severity.WARNING,
    ProblemCode.SERVICE_STAYED_DOWN: Severity.ERROR,
    ProblemCode.ABNORMAL_EXITS: Severity.WARNING,
    ProblemCode.CRASH_LOOP_GUARD_OFF: Severity.WARNING,
}

_EXPLAIN: dict[ProblemCode, str] = {
    ProblemCode.NO_MODELS: f"no servable model found: {PULL_HINT} downloads one (see '{README_MODELS_HEADING}' "
                           "in the README)",
    ProblemCode.ENABLED_MODEL_MISSING: "listed in enabled_models but found nowhere",
    ProblemCode.MODEL_NEVER_FITS: "needs more than the effective cap even on an idle machine",
    ProblemCode.NO_ROOM: "these settings leave no room for any model under the cap (see deploy/README.md)",
    ProblemCode.COORDINATOR_UNREACHABLE: "WebSocket handshake with the coordinator did not complete",
    ProblemCode.MEMORY_FATAL: "memory pressure is at the FATAL watermark",
    ProblemCode.MODEL_SKIPPED: "model folder skipped",
    ProblemCode.UNRECOGNISED_ENV: "environment variable is not read by anything (typo?)",
    ProblemCode.RUNTIME_HASH_UNAVAILABLE: "runtime hash could not be computed",
    ProblemCode.SETTING_REJECTED: "value not usable, the default was used",
    ProblemCode.SETTING_CLAMPED: "value out of range, clamped",
    ProblemCode.SSD_TIER_UNAVAILABLE: "state directory not writable: the agent starts without the SSD tier",
    ProblemCode.DEV_POSTURE_REFUSED: "dev_posture is only allowed with a coordinator on a loopback address: "
                                     "the agent refuses to start",
    ProblemCode.COORDINATOR_UNTRUSTED: "a coordinator will treat this machine as untrusted",
    ProblemCode.MEMORY_GATE_BLOCKS: "the coordinator's free-memory gate refuses requests for this model",
    ProblemCode.NOT_IN_CATALOG: "not in the coordinator's catalog: dropped at register",
    ProblemCode.RESTART_ADVISED: "the running agent advises a restart (memory does not come back after unloads)",
    ProblemCode.RESTART_NEEDED: "the running agent needs a restart: memory that did not come back costs a model",
    ProblemCode.SIGNAL_UNAVAILABLE: "this pause rule cannot read its signal here: the agent serves as if it said go",
    ProblemCode.SERVICE_STAYED_DOWN: "the agent ended abnormally too often (crashes, kills or memory "
                                     "self-restarts): the launchd service stays down (find the cause in "
                                     "provider.log, then `service install`)",
    ProblemCode.ABNORMAL_EXITS: "the agent ended abnormally recently (a crash, a kill or a memory self-restart)",
    ProblemCode.CRASH_LOOP_GUARD_OFF: "the agent cannot count its abnormal exits in the state directory (a full "
                                      "disk?): it serves, but a crash loop would not be stopped",
}


@dataclass(frozen=True, slots=True)
class Problem:
    code: ProblemCode
    subject: str = ""  # a model id, variable name or URL origin; never user text
    detail: str = ""  # figures and setting values behind it (operator input, never user text)

    @property
    def severity(self) -> Severity:
        return _SEVERITY[self.code]

    @property
    def explanation(self) -> str:
        return _EXPLAIN[self.code]


class Reach(StrEnum):
    """How the coordinator check ended (a closed vocabulary, not an exception string)."""

    OK = "ok"
    NOT_CHECKED = "not_checked"
    DNS = "dns_failed"
    REFUSED = "connection_refused"
    TIMEOUT = "timeout"
    TLS = "tls_failed"
    HANDSHAKE_REJECTED = "handshake_rejected"
    NETWORK = "network_error"


@dataclass(frozen=True, slots=True)
class CoordinatorCheck:
    url: str
    checked: bool
    reachable: bool | None  # None when not checked
    detail: Reach
    http_status: int | None = None  # the handshake's HTTP status when the server refused it


@dataclass(frozen=True, slots=True)
class ModelReport:
    model: ModelInfo
    fit: FitResult


@dataclass(frozen=True, slots=True)
class DoctorReport:
    snapshot: MemorySnapshot
    hypothetical: bool  # figures for `--machine-gb`, not this machine
    cap: CapFigures
    policy: PolicySettings
    pressure: Pressure
    runtime_hash: str | None
    models: tuple[ModelReport, ...]
    inventory: Inventory
    coordinator: CoordinatorCheck
    problems: tuple[Problem, ...]
    routing: RoutingReport | None = None
    agent: dict[str, Any] | None = None  # the running agent's /status diagnostics, when one answers
    guest: GuestReport | None = None
    crash_loop: AbnormalExits = AbnormalExits()  # the agent's own count of its abnormal exits
    trust: dict[str, Any] | None = None  # the running agent's last trust_status from the coordinator

    @property
    def ok(self) -> bool:
        return not any(p.severity is Severity.ERROR for p in self.problems)


# --- gathering


def machine_snapshot(settings: Settings, *, machine_gb: float | None = None) -> tuple[MemorySnapshot, bool]:
    """This machine's snapshot (the agent's probe, without MLX), or an idle `machine_gb` machine."""
    if machine_gb is None:
        return Probe(settings.memory_limit_gb, mlx_counters=no_mlx_counters).snapshot(), False
    machine = int(machine_gb * GiB)
    limit = settings.memory_limit_bytes
    physical = machine if limit is None else min(machine, limit)
    return MemorySnapshot(physical_bytes=physical, available_bytes=physical, machine_bytes=machine,
                          memory_limit_bytes=limit), True


def cap_figures(settings: Settings, snapshot: MemorySnapshot, env: Mapping[str, str] | None = None) -> CapFigures:
    """The figures the agent computes for this snapshot and these settings."""
    return memory.compute_figures(snapshot.physical_bytes, policy_settings(settings, env))


def runtime_hash_of(settings: Settings) -> str | None:
    """What `register` sends: the operator's override, else this installation's hash; None on failure."""
    from provider.runtime_hash import runtime_hash

    try:
        return runtime_hash(settings.runtime_hash)
    except (OSError, ValueError):
        return None


async def check_coordinator(url: str, timeout_s: float = DEFAULT_COORDINATOR_TIMEOUT_S) -> CoordinatorCheck:
    """TCP (+TLS) connect and a WebSocket handshake to `url`, closed at once; never raises. A redirect is
    a rejected handshake, as it is for the agent (which never follows one)."""
    from websockets.exceptions import InvalidHandshake, InvalidStatus

    from provider.session.connection import NoRedirectConnect

    def result(reach: Reach, status: int | None = None) -> CoordinatorCheck:
        return CoordinatorCheck(url, True, reach is Reach.OK, reach, status)

    try:
        async with asyncio.timeout(timeout_s):
            async with NoRedirectConnect(url, open_timeout=timeout_s, close_timeout=1, max_size=2**16):
                pass
    except InvalidStatus as exc:
        return result(Reach.HANDSHAKE_REJECTED, exc.response.status_code)
    except InvalidHandshake:
        return result(Reach.HANDSHAKE_REJECTED)
    except TimeoutError:
        return result(Reach.TIMEOUT)
    except socket.gaierror:
        return result(Reach.DNS)
    except ConnectionRefusedError:
        return result(Reach.REFUSED)
    except ssl.SSLError:
        return result(Reach.TLS)
    except OSError:
        return result(Reach.NETWORK)
    return result(Reach.OK)


def run_doctor(
    settings: Settings,
    *,
    check_coordinator_url: bool = True,
    timeout_s: float = DEFAULT_COORDINATOR_TIMEOUT_S,
    machine_gb: float | None = None,
    env: Mapping[str, str] | None = None,
    explain_routing: bool = True,
    hardening: Hardening | None = None,
    check_running_agent: bool = True,
    guest: Callable[[Settings], GuestReport] | None = gather_guest,
) -> DoctorReport:
    """Gather everything `doctor` shows. Blocking (file scans, the coordinator and catalog checks, the
    hardening probe). `explain_routing=False` skips the routing section; `hardening` stands in for the
    probe's result."""
    env = os.environ if env is None else env
    snapshot, hypothetical = machine_snapshot(settings, machine_gb=machine_gb)
    policy = policy_settings(settings, env)
    cap = memory.compute_figures(snapshot.physical_bytes, policy)
    level = memory.pressure(snapshot)
    status = running_agent_status(settings) if check_running_agent else None
    # A chat template past its time or memory bound is a skipped folder, as the agent finds at start
    # (and as a running agent found on a request).
    inventory = without_unservable(check_inventory(discover_models(settings), timeout_s=settings.template_timeout_s),
                                   _template_drops(status), timeout_s=settings.template_timeout_s)
    models = tuple(
        ModelReport(m, memory.fit(cap, snapshot, m.weight_bytes, evictable_bytes=0, outstanding_bytes=0))
        for m in inventory.models
    )
    if check_coordinator_url:
        coordinator = asyncio.run(check_coordinator(settings.coordinator_url, timeout_s))
    else:
        coordinator = CoordinatorCheck(settings.coordinator_url, False, None, Reach.NOT_CHECKED)
    rhash = runtime_hash_of(settings)
    no_room = _no_room(settings, snapshot, policy, cap)
    crash_loop = read_abnormal_exits(settings.state_dir, window_s=settings.crash_loop_window_s)
    problems = (_problems(models, inventory, level, coordinator, rhash, env, policy, no_room) + _ssd_tier(settings)
                + _crash_loop_problems(settings, crash_loop) + _crash_loop_guard(settings))
    routing = None
    if explain_routing:
        routing = gather_routing(settings, total_bytes=snapshot.physical_bytes,
                                 models=[(r.model, r.fit) for r in models], runtime_hash=rhash,
                                 check_catalog=check_coordinator_url, timeout_s=timeout_s, hardening=hardening)
        problems += _routing_problems(routing)
    agent = _diagnostics(status)
    problems += _restart_problems(agent)
    guest_report = guest(settings) if guest is not None else None
    if guest_report is not None:
        problems += tuple(Problem(ProblemCode.SIGNAL_UNAVAILABLE, setting, f"reader: {source}")
                          for setting, source in guest_report.unreadable())
    return DoctorReport(snapshot, hypothetical, cap, policy, level, rhash, models, inventory, coordinator, problems,
                        routing, agent, guest_report, crash_loop, _trust(status))


def running_agent_diagnostics(settings: Settings, timeout_s: float = 2.0) -> dict[str, Any] | None:
    """The memory diagnostics of an agent running with these settings (its loopback /status: the one
    its state directory records, else the configured one), or None when none answers. The same
    figures and recommendation the agent acts on."""
    return _diagnostics(running_agent_status(settings, timeout_s))


def _diagnostics(status: dict[str, Any] | None) -> dict[str, Any] | None:
    diagnostics = status.get("diagnostics") if status is not None else None
    return diagnostics if isinstance(diagnostics, dict) else None


def _trust(status: dict[str, Any] | None) -> dict[str, Any] | None:
    """The coordinator's last ``trust_status`` as the running agent keeps it (diagnostics only)."""
    session = status.get("session") if status is not None else None
    trust = session.get("trust") if isinstance(session, dict) else None
    return trust if isinstance(trust, dict) else None


def _template_drops(status: dict[str, Any] | None) -> dict[str, TemplateBound]:
    """The models a running agent dropped because their template passed a bound on a request."""
    gone = status.get("models_gone") if status is not None else None
    bounds = {b.value: b for b in TemplateBound}
    return {m: bounds[r] for m, r in gone.items() if r in bounds} if isinstance(gone, dict) else {}


def running_agent_status(settings: Settings, timeout_s: float = 2.0) -> dict[str, Any] | None:
    """The /status of an agent running with these settings (see `running_agent_diagnostics`)."""
    found = find_status(settings, timeout_s)
    return found[1] if found is not None else None


def _restart_problems(agent: dict[str, Any] | None) -> tuple[Problem, ...]:
    restart = (agent or {}).get("restart") or {}
    code = {"advised": ProblemCode.RESTART_ADVISED, "needed": ProblemCode.RESTART_NEEDED}.get(restart.get("recommendation"))
    if code is None:
        return ()
    baseline = agent.get("baseline", {}) if agent else {}
    detail = f"{restart.get('reason')}; baseline drift {human_bytes(baseline.get('drift_bytes'))} since start"
    return (Problem(code, "agent", detail),)


def _crash_loop_problems(settings: Settings, exits: AbnormalExits) -> tuple[Problem, ...]:
    """The agent's own count of its abnormal exits (`provider/supervision.py`): an error while the
    last start stayed down for them (launchd relaunches it only at the next login or boot, however
    old they are by then), a warning for those inside the window otherwise."""
    n = len(exits.abnormal_exits)
    detail = ""
    if n:
        detail = (f"{n} abnormal exit{'s' if n != 1 else ''} within {settings.crash_loop_window_mins:g} minutes "
                  f"({exits.kinds()}), the last at {exits.abnormal_exits[-1].at}; crash_loop_limit is "
                  f"{settings.crash_loop_limit}")
    if exits.stayed_down_at is not None:
        return (Problem(ProblemCode.SERVICE_STAYED_DOWN, "service",
                        "; ".join(filter(None, (f"stayed down at {exits.stayed_down_at}", detail)))),)
    return (Problem(ProblemCode.ABNORMAL_EXITS, "service", detail),) if n else ()


def _crash_loop_guard(settings: Settings) -> tuple[Problem, ...]:
    """The guard's files cannot be written (`supervision.guard_unwritable`: a probe written and removed)."""
    exc = guard_unwritable(settings.state_dir)
    if exc is None:
        return ()
    return (Problem(ProblemCode.CRASH_LOOP_GUARD_OFF, os_error_name(exc),
                    f"{settings.state_dir}: {os.strerror(exc.errno) if exc.errno else 'not usable'}"),)


def _routing_problems(routing: RoutingReport) -> tuple[Problem, ...]:
    found: list[Problem] = []
    if not routing.dev_posture_allowed:
        found.append(Problem(ProblemCode.DEV_POSTURE_REFUSED, "dev_posture",
                             "set dev_posture = false for this coordinator (and use a wss:// URL)"))
    if not routing.trusted:
        found.append(Problem(ProblemCode.COORDINATOR_UNTRUSTED, ", ".join(p.subject for p in routing.trust),
                             untrusted_sentence(routing)))
    for route in routing.models:
        if route.gate.verdict in BLOCKING:
            found.append(Problem(ProblemCode.MEMORY_GATE_BLOCKS, route.model_id, route.fix or ""))
        elif route.gate.verdict == "not_in_catalog":
            found.append(Problem(ProblemCode.NOT_IN_CATALOG, route.model_id, route.fix or ""))
    return tuple(found)


def _no_room(settings: Settings, snapshot: MemorySnapshot, policy: PolicySettings, cap: CapFigures) -> Problem | None:
    """One problem naming the settings that leave no room for any model, or None when there is room."""
    causes = memory.no_room_causes(snapshot.unlimited_physical_bytes, policy)
    if not causes:
        return None
    values = {
        RoomCause.MEMORY_RESERVE: f"memory_reserve_gb = {settings.memory_reserve_gb:g}",
        RoomCause.ACTIVATION_RESERVE: f"activation reserve {human_bytes(cap.activation_reserve_bytes)}",
        RoomCause.MEMORY_LIMIT: f"memory_limit_gb = {settings.memory_limit_gb or 0:g}",
        RoomCause.CAP_FRACTION: f"cap fraction {cap.cap_fraction:g}",
        RoomCause.SMALL_MACHINE: f"{human_bytes(snapshot.unlimited_physical_bytes)} physical",
    }
    detail = (f"a load needs its weights + the activation reserve ({human_bytes(cap.activation_reserve_bytes)}) "
              f"+ the minimum KV ({human_bytes(cap.min_kv_bytes)}) under the effective cap "
              f"({human_bytes(cap.effective_cap_bytes)}); set by {', '.join(values[c] for c in causes)}")
    return Problem(ProblemCode.NO_ROOM, ", ".join(ROOM_CAUSE_SETTING[c] for c in causes), detail)


def _ssd_tier(settings: Settings) -> tuple[Problem, ...]:
    """The agent's own check of its KV SSD directory (`provider.runtime.build_prefix_cache`)."""
    root = settings.state_dir / KVCACHE_DIR
    try:
        check_writable_dir(root)
    except OSError as exc:
        return (Problem(ProblemCode.SSD_TIER_UNAVAILABLE, os_error_name(exc),
                        f"{root}: {os.strerror(exc.errno) if exc.errno else 'not usable'}"),)
    return ()


def adjustment_problem(adjustment: EnvAdjustment) -> Problem:
    """A rejected or clamped memory-policy variable, with what was given and what was used."""
    given = f"{adjustment.given:g}" if isinstance(adjustment.given, float) else repr(adjustment.given)
    used = "no limit" if adjustment.used is None else f"{adjustment.used:g}"
    code = ProblemCode.SETTING_CLAMPED if adjustment.action is EnvAction.CLAMPED else ProblemCode.SETTING_REJECTED
    default = " (the default)" if adjustment.action is EnvAction.REJECTED else ""
    return Problem(code, adjustment.variable, f"given {given} ({adjustment.rule}); used {used}{default}")


def _problems(models: tuple[ModelReport, ...], inventory: Inventory, level: Pressure, coordinator: CoordinatorCheck,
              rhash: str | None, env: Mapping[str, str], policy: PolicySettings,
              no_room: Problem | None) -> tuple[Problem, ...]:
    found: list[Problem] = []
    if not models:
        found.append(Problem(ProblemCode.NO_MODELS, detail=f"looked in {places_text(inventory.searched)}"))
    found += [Problem(ProblemCode.ENABLED_MODEL_MISSING, i) for i in inventory.missing]
    if no_room is not None:
        found.append(no_room)  # the reason every model is too large: say it once, not per model
    else:
        found += [Problem(ProblemCode.MODEL_NEVER_FITS, r.model.id) for r in models if not r.fit.ever_fits]
    found += [adjustment_problem(a) for a in policy.adjustments]
    if coordinator.checked and not coordinator.reachable:
        found.append(Problem(ProblemCode.COORDINATOR_UNREACHABLE, coordinator.detail.value))
    if level.level is PressureLevel.FATAL:
        found.append(Problem(ProblemCode.MEMORY_FATAL))
    found += [Problem(ProblemCode.MODEL_SKIPPED, s.id or s.path.name) for s in inventory.skipped]
    found += [Problem(ProblemCode.UNRECOGNISED_ENV, name) for name in unrecognised_env(env)]
    if rhash is None:
        found.append(Problem(ProblemCode.RUNTIME_HASH_UNAVAILABLE))
    return tuple(found)


# --- rendering


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
        "models": [_model_json(r) for r in report.models],
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


def _model_json(r: ModelReport) -> dict[str, Any]:
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
        "verdict": r.fit.verdict.value,
        "required_bytes": r.fit.required_bytes,
        "ever_fits": r.fit.ever_fits,
        # what the model can do, as /v1/models says it (null: its tokenizer could not be read)
        "capabilities": {"tools": m.tools},
    }


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
        ("activation reserve", human_bytes(cap.activation_reserve_bytes)),
        ("pressure", f"{report.pressure.level.name.lower()} ({report.pressure.utilization:.0%} of physical; "
                     "this process, nothing loaded)"),
    ], INDENT)
    out += ["", f"Runtime hash  {report.runtime_hash or 'unavailable'}", ""]
    out.append(f"Models ({len(report.models)}; fit with nothing loaded, so nothing evictable)")
    if report.models:
        rows = [("id", "size", "quantization", "context", "needs", "verdict", "tools")]
        for r in report.models:
            m = r.model
            rows.append((m.id, human_bytes(m.weight_bytes), quantization_text(m.quantization, m.dtype.value),
                         str(m.context_length or "-"), human_bytes(r.fit.required_bytes), r.fit.verdict.value,
                         {True: "yes", False: "no", None: "-"}[m.tools]))
        out += table(rows, INDENT)
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
