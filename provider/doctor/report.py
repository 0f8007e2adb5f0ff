"""Gathering what `doctor` shows (`run_doctor` -> `DoctorReport`): this machine's snapshot and cap
figures from `memory/` (the functions the agent enforces), the models' fit verdicts, the coordinator
check, the running agent's diagnostics (through its local server), and the problems they add up to."""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import memory
from kvcache.disk import KVCACHE_DIR, check_writable_dir, os_error_name
from memory import (
    ROOM_CAUSE_SETTING,
    CapFigures,
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
from provider.doctor.guest import GuestReport, gather_guest
from provider.doctor.problems import Problem, ProblemCode, Severity, adjustment_problem
from provider.doctor.routing import BLOCKING, RoutingReport, gather_routing, untrusted_sentence
from provider.engine.activation import window_for
from provider.hardening import Hardening
from provider.models import Inventory, ModelInfo, discover_models
from provider.models.activation import ActivationStore, with_activation
from provider.models.broken import reason_words
from provider.models.searched import places_text
from provider.models.template import TemplateBound
from provider.models.template_check import check_inventory, without_unservable
from provider.supervision import AbnormalExits, guard_unwritable, read_abnormal_exits
from provider.units import GiB, human_bytes

DEFAULT_COORDINATOR_TIMEOUT_S = 5.0


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
    # the running agent's models whose failed load it remembers: id -> {reason, failures, since, retry_in_s}
    broken: Mapping[str, dict[str, Any]] = field(default_factory=dict)

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
    cap = memory.compute_figures(snapshot.physical_bytes, policy).for_models(())  # the agent with nothing loaded
    level = memory.pressure(snapshot)
    status = running_agent_status(settings) if check_running_agent else None
    # A chat template past its time or memory bound is a skipped folder, as the agent finds at start
    # (and as a running agent found on a request).
    inventory = without_unservable(check_inventory(discover_models(settings), timeout_s=settings.template_timeout_s),
                                   _template_drops(status), timeout_s=settings.template_timeout_s)
    # Each model's activation reserve as the agent has it before a load: what its last load measured (the
    # state dir), else its config's estimate.
    inventory = with_activation(inventory, window_tokens=window_for(None), batch_rows=settings.max_batch_size,
                                store=ActivationStore(settings.state_dir))
    models = tuple(
        ModelReport(m, memory.fit(cap, snapshot, m.weight_bytes, evictable_bytes=0, outstanding_bytes=0,
                                  activation_reserve_bytes=m.activation_reserve_bytes))
        for m in inventory.models
    )
    if check_coordinator_url:
        coordinator = asyncio.run(check_coordinator(settings.coordinator_url, timeout_s))
    else:
        coordinator = CoordinatorCheck(settings.coordinator_url, False, None, Reach.NOT_CHECKED)
    rhash = runtime_hash_of(settings)
    no_room = _no_room(settings, snapshot, policy, cap)
    crash_loop = read_abnormal_exits(settings.state_dir, window_s=settings.crash_loop_window_s)
    broken = _broken(status)
    problems = (_problems(models, inventory, level, coordinator, rhash, env, policy, no_room) + _ssd_tier(settings)
                + _crash_loop_problems(settings, crash_loop) + _crash_loop_guard(settings)
                + _broken_problems(broken))
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
                        routing, agent, guest_report, crash_loop, _trust(status), broken)


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


def _broken(status: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """The models a running agent failed to load and remembers (its /status `models_broken`)."""
    broken = status.get("models_broken") if status is not None else None
    return {m: b for m, b in broken.items() if isinstance(b, dict)} if isinstance(broken, dict) else {}


def broken_text(broken: Mapping[str, Any]) -> str:
    """A remembered failed load in words: its reason and when it is tried again at the latest."""
    retry = broken.get("retry_in_s")
    when = f"; tried again when its folder changes, or in {retry:.0f} s" if isinstance(retry, (int, float)) else ""
    return f"{reason_words(str(broken.get('reason')))} ({broken.get('reason')}){when}"


def _broken_problems(broken: Mapping[str, Mapping[str, Any]]) -> tuple[Problem, ...]:
    return tuple(Problem(ProblemCode.MODEL_BROKEN, model_id, broken_text(b)) for model_id, b in broken.items())


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
    reserve = human_bytes(cap.activation_reserve_bytes) if cap.activation_reserve_set else "its own, measured at its load"
    detail = (f"a load needs its weights + the activation reserve ({reserve}) "
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
