"""provider/session: the coordinator WebSocket — one connection, forever.

* ``core``       ``SessionCore``: sans-I/O state machine (frame in → ``Send`` / ``StartJob`` / ``CancelJob`` /
                 ``Log`` / ``Note`` actions out), ``SessionState``
* ``connection`` ``Session``: the asyncio shell (websockets client, send queue, keepalive, clock watchdog,
                 heartbeats, reconnect with backoff, drain), ``SessionConfig``, ``websocket_connect``
* ``backoff``    pure reconnect policy: ``backoff_delays``, ``should_reset_backoff``, ``clock_jumped``,
                 ``is_retryable``
* ``register``   the ``register`` frame (``build_register``, ``advertised_models``)
* ``attestation`` ``register.attestation`` or why there is none (``plan_attestation``, ``signed_attestation``)
* ``heartbeat``  ``HeartbeatSource`` (frames from the manager's ``CapacityReport`` and ``ServingStats``)
* ``identity``   key files under ``state_dir/identity`` (``load_or_create_keys``)
* ``posture``    host posture, process hardening, ``dev_posture`` rules (``Posture``)
* ``status``     ``SessionStatus``: what the link is doing, for ``/status`` and ``/metrics``
* ``gates``      the [A] coordinator's routing rules (trust, trust levels, catalog, free-memory gate), for
                 ``doctor``
"""

from provider.session.backoff import backoff_delays, clock_jumped, is_retryable, should_reset_backoff
from provider.session.connection import Session, SessionConfig, websocket_connect
from provider.session.core import Action, CancelJob, InvalidState, Log, Note, Send, SessionCore, SessionState, StartJob
from provider.session.heartbeat import HeartbeatSource, ThermalSampler, backend_capacity
from provider.session.identity import Keys, load_or_create_keys
from provider.session.posture import (
    DevPostureRefused,
    Hardening,
    HostPosture,
    Posture,
    check_dev_posture,
    harden_process,
    read_host_posture,
)
from provider.session.register import AdvertisedModel, RegisterFrame, advertised_models, build_register
from provider.session.status import LinkState, RequestTally, SessionStatus, SessionView

__all__ = [
    "Action",
    "AdvertisedModel",
    "CancelJob",
    "DevPostureRefused",
    "Hardening",
    "HeartbeatSource",
    "HostPosture",
    "InvalidState",
    "Keys",
    "LinkState",
    "Log",
    "Note",
    "Posture",
    "RegisterFrame",
    "RequestTally",
    "Send",
    "Session",
    "SessionConfig",
    "SessionCore",
    "SessionState",
    "SessionStatus",
    "SessionView",
    "StartJob",
    "ThermalSampler",
    "advertised_models",
    "backend_capacity",
    "backoff_delays",
    "build_register",
    "check_dev_posture",
    "clock_jumped",
    "harden_process",
    "is_retryable",
    "load_or_create_keys",
    "read_host_posture",
    "should_reset_backoff",
    "websocket_connect",
]
