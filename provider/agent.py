"""The provider agent: settings → inventory → engine → ledger → model manager → session, until a signal.

    agent = await Agent.start(settings)          # everything blocking runs off the event loop
    code = await agent.run(stop)                 # until `stop` is set: drain, unload, 0

``run_agent(settings)`` does both and installs SIGTERM/SIGINT handlers that set ``stop``;
``main_serve(settings)`` is the synchronous entry for ``darkbloom-provider serve`` and returns the exit
code. ``python -m provider.agent`` runs it with the settings from the usual sources.

Startup order (each blocking step in a worker thread): refuse ``dev_posture`` unless the coordinator is
on loopback; harden the process; read the host posture and decide whether ``register`` can carry an
attestation (``provider.session.attestation``; logged either way); load or create the identity keys;
compute the runtime hash; then the shared ``provider.runtime.Runtime`` (models, ledger, prefix KV cache, engine,
model manager, weight hashes and warm tokenizers: the same assembly ``serve --local`` runs); detect
the hardware. The guest monitor (provider/guest: serving windows, the owner's activity, battery, heat)
is built first and handed to the runtime, so admission refuses while the Mac is paused, the
heartbeat says ``draining`` then, and a change sends a heartbeat at once. While running, the local status endpoints (``/healthz``, ``/status``, ``/metrics`` on
``local_host:local_port``) answer ``darkbloom-provider status``, and on macOS a power assertion keeps
idle sleep from dropping the session (``keep_awake``, ``provider/power.py``).

Shutdown: the session drains (new requests 503 ``draining``, running ones get ``drain_timeout_s``, then
are cancelled), sends the ``provider_drain`` barrier and waits up to ``drain_ack_timeout_s`` for its
ack, and closes the socket with 1000; then every model is unloaded (its prefix cache purged)
and the engine stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import signal
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from memory import Ledger, Probe
from protocol import AttestationChallenge, AttestationResponse, ModelsUpdate
from protocol.attest import RuntimeHashes, answer_challenge
from protocol.crypto import KeyFileError
from provider import __version__
from provider.config import ConfigError, SelfRestart, Settings, load_settings
from provider.directed import DesiredBuilds, ModelDirectives
from provider.engine import Engine
from provider.guest.monitor import GuestMonitor
from provider.hardware import available_gb, detect_machine, hardware_of, measure_memory_bandwidth_gbs, os_version
from provider.jobs import JobContext, ServingStats, run_job
from provider.local.server import StatusEndpoint
from provider.metrics import Metrics
from provider.models import Inventory, default_hf_cache
from provider.power import KeepAwake
from provider.request import PromptCounter
from provider.runtime import Runtime
from provider.runtime_hash import runtime_hash
from provider.session.attestation import plan_attestation, signed_attestation
from provider.session.connection import ConnectFactory, Session, SessionConfig
from provider.session.core import ChallengeAnswerer
from provider.session.heartbeat import HeartbeatSource, ThermalSampler
from provider.session.identity import Keys, load_or_create_keys
from provider.session.posture import (
    NO_HARDENING,
    DevPostureRefused,
    Posture,
    check_dev_posture,
    harden_process,
    read_host_posture,
)
from provider.session.register import RegisterFrame, advertised_models, build_register
from provider.session.status import SessionStatus
from provider.slots import ModelManager
from provider.slots.quote import capacity_quote
from provider.supervision import EXIT_RESTART, under_service_manager
from provider.telemetry import configure_logging, get_logger

log = get_logger("provider.agent")

EXIT_OK = 0
EXIT_CONFIG = 78  # EX_CONFIG, as the CLI uses for configuration errors
# EXIT_RESTART (75, EX_TEMPFAIL, from provider/supervision.py): a memory restart. launchd
# (KeepAlive, SuccessfulExit false) and the systemd unit (Restart=on-failure) start the agent again; the
# crash-loop guard counts it as a memory self-restart, and enough of them keep a launchd service down.


@dataclass(slots=True)
class Agent:
    """Every long-lived part of a running provider, wired together."""

    settings: Settings
    keys: Keys
    posture: Posture
    runtime_hash: str
    inventory: Inventory
    probe: Probe
    ledger: Ledger
    engine: Engine
    owns_engine: bool
    manager: ModelManager
    stats: ServingStats
    counter: PromptCounter
    heartbeat: HeartbeatSource
    session: Session
    weight_hashes: Mapping[str, str]
    metrics: Metrics
    runtime: Runtime
    guest: GuestMonitor
    keep_awake: KeepAwake  # the Mac stays awake while the agent is available (provider/power.py)
    exit_code: int = EXIT_OK  # EXIT_RESTART once a memory restart was decided

    @classmethod
    async def start(cls, settings: Settings, *, engine: Engine | None = None, harden: bool = True,
                    connect: ConnectFactory | None = None, metrics: Metrics | None = None,
                    eos_token_ids: Mapping[str, frozenset[int]] | None = None,
                    guest: GuestMonitor | None = None, keep_awake: KeepAwake | None = None) -> Agent:
        """Build everything; nothing connects yet. ``harden=False`` leaves this process as it is
        (for running an agent inside a test process); the posture then reports no hardening.
        ``guest``: the owner's rules (default: from the settings, on the wall clock)."""
        check_dev_posture(settings.coordinator_url, settings.dev_posture)
        hardening = harden_process() if harden else NO_HARDENING
        host = await asyncio.to_thread(read_host_posture)
        posture = Posture(host, hardening, dev=settings.dev_posture)
        if host.secure_boot_enabled is None:  # left out of every challenge answer, never guessed
            log.warning("secure_boot_unknown")
        if host.virtual_machine:  # a guest isolates nothing: hypervisor_active stays false
            log.info("host_is_virtual_machine")
        attestation = plan_attestation(posture)
        if attestation.sendable:  # each register carries a freshly signed blob
            log.info("attestation_planned", state=attestation.trust_level.value)
        else:  # doctor's routing section says the same in words
            log.warning("attestation_not_sent", reason=[gap.value for gap in attestation.gaps],
                        state=attestation.trust_level.value)
        keys = await asyncio.to_thread(load_or_create_keys, settings.state_dir)
        rhash = await asyncio.to_thread(runtime_hash, settings.runtime_hash)
        metrics = metrics or Metrics()
        thermal = ThermalSampler()
        guest = guest or GuestMonitor.from_settings(settings, thermal=lambda: thermal.state)
        guest.report_to(metrics)
        # Before the runtime starts the engine (the only other MLX user): where Apple's table has no figure,
        # the bandwidth is measured, so that register lets a coordinator price this provider while cold.
        machine = await asyncio.to_thread(detect_machine, measure=measure_memory_bandwidth_gbs)
        if machine.bandwidth_measured:
            log.info("memory_bandwidth_measured", memory_bandwidth_gbs=machine.memory_bandwidth_gbs)
        rt = await Runtime.start(settings, engine=engine, metrics=metrics, eos_token_ids=eos_token_ids, guest=guest)
        inventory, probe, ledger, manager = rt.inventory, rt.probe, rt.ledger, rt.manager
        counter, stats, metrics, weight_hashes = rt.counter, rt.stats, rt.metrics, rt.weight_hashes.known()
        hardware = hardware_of(machine, probe.snapshot())
        osver = os_version()
        heartbeat = HeartbeatSource(stats=stats, capacity=manager.capacity, thermal=thermal, paused=guest.is_paused,
                                    rates=manager.rates, quoting=True)
        status = SessionStatus(settings.coordinator_url)
        rt.session = status  # /status and /metrics report the link
        metrics.watch_session(status.view)
        desired = DesiredBuilds(counter.knows)  # desired_models: public name -> build, for every request
        ctx = JobContext(identity=keys.encryption, manager=manager, counter=counter, stats=stats, metrics=metrics,
                         requests=status.requests, intake=rt.intake, resolve_model=desired.resolve,
                         rates=manager.rates)

        def make_register() -> RegisterFrame:
            snapshot = probe.snapshot()
            prefill_tps, decode_tps = manager.register_rates()
            return build_register(
                prefill_tps=prefill_tps,
                decode_tps=decode_tps,
                hardware=hardware.model_copy(update={"memory_available_gb": available_gb(snapshot)}),
                models=advertised_models(manager.advertised_verdicts(), weight_hashes),
                backend=settings.backend,
                public_key=keys.encryption.public_key_b64,
                version=__version__,
                runtime_hash=rhash,
                privacy=posture.privacy_capabilities(),
                auth_token=settings.auth_token.get_secret_value() if settings.auth_token else None,
                attestation=signed_attestation(attestation, signer=keys.signer,
                                               encryption_public_key=keys.encryption.public_key_b64,
                                               chip_name=hardware.chip_name, hardware_model=hardware.machine_model,
                                               os_version=osver),
            )

        session = Session(
            SessionConfig(url=settings.coordinator_url, heartbeat_interval_s=settings.heartbeat_interval_s,
                          eviction_window_s=settings.eviction_window_s, drain_timeout_s=settings.drain_timeout_s,
                          drain_ack_timeout_s=settings.drain_ack_timeout_s, dev_posture=settings.dev_posture),
            build_register=make_register,
            answer_challenge=challenge_answerer(keys, posture, rhash),
            build_heartbeat=heartbeat,
            run_job=lambda request, send: run_job(request, ctx, send),
            connect=connect,
            status=status,
            run_directive=ModelDirectives(manager, runtime=rt, coordinator_url=settings.coordinator_url,
                                          hf_cache_dir=settings.hf_cache_dir or default_hf_cache(), desired=desired),
            quote=lambda probe: capacity_quote(probe, manager, manager.rates, heartbeat.capacity_seq),
            build_models_update=lambda: ModelsUpdate(models=advertised_models(manager.advertised_verdicts(),
                                                                              rt.weight_hashes.known())),
        )
        manager.on_capacity_change = session.capacity_changed
        guest.on_change(lambda _: session.capacity_changed())  # a heartbeat at once: draining, or idle again
        log.info("agent_ready", models=list(rt.servable), version=__version__, backend=settings.backend,
                 url=settings.coordinator_url, state="dev_posture" if settings.dev_posture else "honest_posture",
                 hardening_count=sum((hardening.core_dumps_disabled, hardening.anti_debug_enabled,
                                      hardening.env_scrubbed)))
        return cls(settings, keys, posture, rhash, inventory, probe, ledger, rt.engine, rt.owns_engine, manager,
                   stats, counter, heartbeat, session, weight_hashes, metrics, rt, guest,
                   keep_awake if keep_awake is not None else KeepAwake(enabled=settings.keep_awake))

    async def run(self, stop: asyncio.Event) -> int:
        """Serve until ``stop`` is set, then drain, unload every model and return the exit code
        (``EXIT_RESTART`` when a needed memory restart set ``stop``, see `_restart_if_needed`)."""
        if self_restart_enabled(self.settings, os.environ):
            self.manager.baseline_listeners.append(functools.partial(self._restart_if_needed, stop))
        background = [asyncio.create_task(self._refresh_thermal(), name="agent-thermal"),
                      asyncio.create_task(self.manager.run_idle_reaper(), name="agent-idle-reaper"),
                      asyncio.create_task(self.guest.run(), name="agent-guest")]
        endpoint = StatusEndpoint.start(self.runtime, self.settings) if self.settings.local_enabled else None
        # The power assertion follows the guest monitor: held while the agent may serve (a serving window
        # open, no pause), released while it is paused, and for good once the drain starts.
        self.guest.follow(self._keep_awake_unless(stop))
        try:
            await self.session.run(stop)
        finally:
            self.keep_awake.set_available(False)
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            if endpoint is not None:
                endpoint.draining()
            try:
                await self.close()
            finally:
                if endpoint is not None:
                    await endpoint.aclose()
        log.info("agent_stopped", count=self.stats.requests_served, tokens_total=self.stats.tokens_generated,
                 code=self.exit_code)
        return self.exit_code

    def _keep_awake_unless(self, stop: asyncio.Event) -> Callable[[bool], None]:
        """`KeepAwake.set_available` for the guest monitor, off once `stop` is set (a draining agent
        takes no jobs: a window opening during the drain must not hold the Mac awake again)."""
        def follow(available: bool) -> None:
            self.keep_awake.set_available(available and not stop.is_set())
        return follow

    def _restart_if_needed(self, stop: asyncio.Event) -> None:
        """After each baseline sample: when memory that did not come back costs a model
        (`memory.diagnostics`: needed), stop taking jobs (503 draining), let in-flight ones finish
        within the drain timeout, close the session and exit with EXIT_RESTART."""
        if self.exit_code == EXIT_RESTART or stop.is_set():
            return
        advice = self.manager.restart_advice()
        if not advice.needed:
            return
        log.warning("self_restart", reason=advice.reason, drift_bytes=advice.drift.mlx_active_bytes,
                    code=EXIT_RESTART)
        self.exit_code = EXIT_RESTART
        self.manager.start_draining()
        stop.set()

    async def close(self) -> None:
        await self.runtime.aclose()

    async def _refresh_thermal(self) -> None:
        while True:
            await self.heartbeat.thermal.refresh()
            await asyncio.sleep(self.settings.heartbeat_interval_s)


def challenge_answerer(keys: Keys, posture: Posture, rhash: str) -> ChallengeAnswerer:
    """Signs every challenge with our P-256 key; posture and runtime hash as read at startup."""
    security = posture.security()
    hashes = RuntimeHashes(runtime_hash=rhash)

    def answer(challenge: AttestationChallenge) -> AttestationResponse:
        return answer_challenge(challenge, public_key_b64=keys.encryption.public_key_b64, signer=keys.signer,
                                posture=security, hashes=hashes)

    return answer


def install_stop_signals(stop: asyncio.Event) -> Callable[[], None]:
    """SIGTERM and SIGINT set ``stop`` (drain); returns a function that removes the handlers."""
    loop = asyncio.get_running_loop()
    signals = (signal.SIGTERM, signal.SIGINT)

    def on_signal(signum: int) -> None:
        log.info("stop_signal", signal=signal.Signals(signum).name)
        stop.set()

    for signum in signals:
        loop.add_signal_handler(signum, on_signal, signum)

    def remove() -> None:
        for signum in signals:
            loop.remove_signal_handler(signum)

    return remove


async def run_agent(settings: Settings, *, stop: asyncio.Event | None = None, engine: Engine | None = None,
                    harden: bool = True, connect: ConnectFactory | None = None,
                    install_signals: bool = True) -> int:
    """Start the agent and serve until SIGTERM/SIGINT (or ``stop``); 0 after a clean drain."""
    stop = stop or asyncio.Event()
    remove = install_stop_signals(stop) if install_signals else None
    try:
        agent = await Agent.start(settings, engine=engine, harden=harden, connect=connect)
        return await agent.run(stop)
    finally:
        if remove is not None:
            remove()


def self_restart_enabled(settings: Settings, env: Mapping[str, str]) -> bool:
    """`self_restart`: on, off, or (auto) only under a service manager that starts the agent again."""
    if settings.self_restart is SelfRestart.AUTO:
        return under_service_manager(env)
    return settings.self_restart is SelfRestart.ON


def main_serve(settings: Settings) -> int:
    """Synchronous entry point: run the agent to completion and return the process exit code."""
    try:
        return asyncio.run(run_agent(settings))
    except (DevPostureRefused, KeyFileError) as exc:  # the operator must fix something; texts are ours
        log.error("agent_refused_to_start", reason=str(exc))
        print(f"darkbloom-provider: {exc}", file=sys.stderr)
        return EXIT_CONFIG


def main(argv: list[str] | None = None) -> int:
    """``python -m provider.agent``: settings from the file, ``DARKBLOOM_*`` env; no flags."""
    del argv
    try:
        settings = load_settings()
    except ConfigError as exc:
        print(f"darkbloom-provider: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    configure_logging(settings.log_level, settings.log_format)
    from provider.state_lock import AlreadyRunning, StateLock

    try:  # one agent per state directory, as `darkbloom-provider serve` (provider/state_lock.py)
        lock = StateLock.for_serving(settings, local=False)
    except AlreadyRunning as exc:
        print(f"darkbloom-provider: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    with lock:
        return main_serve(settings)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())


__all__ = ["EXIT_CONFIG", "EXIT_OK", "EXIT_RESTART", "self_restart_enabled", "Agent", "challenge_answerer", "install_stop_signals", "main", "main_serve",
           "run_agent"]
