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

import importlib

# Imported on first use (PEP 562): a command that needs one submodule (doctor, the CLI) does not
# pay for the rest, the engine and MLX among them.
_WHERE = {
    "Action": "provider.session.core",
    "AdvertisedModel": "provider.session.register",
    "CancelJob": "provider.session.core",
    "DevPostureRefused": "provider.session.posture",
    "Hardening": "provider.session.posture",
    "HeartbeatSource": "provider.session.heartbeat",
    "HostPosture": "provider.session.posture",
    "InvalidState": "provider.session.core",
    "Keys": "provider.session.identity",
    "LinkState": "provider.session.status",
    "Log": "provider.session.core",
    "Note": "provider.session.core",
    "Posture": "provider.session.posture",
    "RegisterFrame": "provider.session.register",
    "RequestTally": "provider.session.status",
    "Send": "provider.session.core",
    "Session": "provider.session.connection",
    "SessionConfig": "provider.session.connection",
    "SessionCore": "provider.session.core",
    "SessionState": "provider.session.core",
    "SessionStatus": "provider.session.status",
    "SessionView": "provider.session.status",
    "StartJob": "provider.session.core",
    "ThermalSampler": "provider.session.heartbeat",
    "advertised_models": "provider.session.register",
    "backend_capacity": "provider.session.heartbeat",
    "backoff_delays": "provider.session.backoff",
    "build_register": "provider.session.register",
    "check_dev_posture": "provider.session.posture",
    "clock_jumped": "provider.session.backoff",
    "harden_process": "provider.session.posture",
    "is_retryable": "provider.session.backoff",
    "load_or_create_keys": "provider.session.identity",
    "read_host_posture": "provider.session.posture",
    "should_reset_backoff": "provider.session.backoff",
    "websocket_connect": "provider.session.connection",
}


def __getattr__(name: str):
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value

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
