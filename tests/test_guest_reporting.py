"""A pause reaches every place it must — admission (the single decision point), the heartbeat's
status, the local server's Retry-After, `doctor` (each signal's reading, the next window change), the
`status` command — and the settings read windows from the file, the environment and flags."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest

from memory import GiB, Ledger, MemorySnapshot, figures, pressure
from protocol import ThermalState
from protocol.errors import ErrorReason, Failure
from provider.config import ConfigError, Settings, load_settings
from provider.doctor import ProblemCode, report_json, run_doctor
from provider.doctor.guest import gather_guest, guest_lines
from provider.guest import Paused, PauseReason
from provider.guest.readers import Reading, Source
from provider.jobs.stats import ServingStats
from provider.local.backend import Refused as LocalRefused
from provider.session.heartbeat import HeartbeatSource
from provider.slots import CapacityReport, ManagerView, Refused, decide

NOON = datetime(2025, 1, 8, 12, 0, tzinfo=UTC)  # a Wednesday


# --- admission -------------------------------------------------------------------------------------------


def test_a_paused_view_is_refused_first_with_the_time_until_it_serves():
    paused = Paused(PauseReason.OUTSIDE_WINDOW, 900)
    view = ManagerView({}, 3, False, 0, 0, paused=paused)
    snap = MemorySnapshot(physical_bytes=16 * GiB, available_bytes=16 * GiB)
    fig = figures(16 * GiB, env={})
    # Refused before the model is even looked up: nothing is done for a paused agent.
    result = decide(view, fig, snap, model_id="anything", info=None, prompt_tokens=10, max_tokens=10)
    assert isinstance(result, Refused)
    assert result.status_code == 503 and result.error_reason is ErrorReason.DRAINING
    assert result.failure.feasible_after_ms == 900_000
    draining = decide(ManagerView({}, 3, True, 0, 0, paused=paused), fig, snap, model_id="m", info=None,
                      prompt_tokens=1, max_tokens=1)
    assert draining.failure == Failure.draining()  # shutting down says so, without a time to come back


def test_the_local_server_turns_it_into_retry_after():
    assert LocalRefused(Failure.paused(900)).retry_after_s == 900
    assert LocalRefused(Failure.draining()).retry_after_s == 5  # unchanged for a shutdown


def test_the_heartbeat_says_draining_while_paused():
    paused = {"now": False}
    report = CapacityReport(slots=(), mlx_active_bytes=0, mlx_peak_bytes=0, mlx_cache_bytes=0,
                            total_memory_bytes=GiB, free_for_load_bytes=0, available_bytes=0,
                            pressure=pressure(MemorySnapshot(physical_bytes=GiB, available_bytes=GiB)),
                            ledger=Ledger(figures(16 * GiB, env={})).snapshot())
    source = HeartbeatSource(stats=ServingStats(), capacity=lambda: report, cpu_percent=lambda: 0.0,
                             paused=lambda: paused["now"])
    assert source().status == "idle"
    paused["now"] = True
    assert source().status == "draining"


# --- doctor ----------------------------------------------------------------------------------------------


def readers(idle: float | None, on_battery: bool | None):
    return {"read_idle": lambda: Reading(idle, Source.IOREG if idle is not None else Source.UNAVAILABLE),
            "read_power": lambda: Reading(on_battery, Source.PMSET if on_battery is not None else Source.UNAVAILABLE),
            "read_thermal": lambda: ThermalState.FAIR}


def test_doctor_shows_each_signal_and_the_next_window_change():
    settings = Settings(serve_windows=["22:00-07:30"], serve_timezone="Europe/Paris", pause_when_active_mins=10,
                        pause_on_battery=True)
    report = gather_guest(settings, now=NOON, **readers(42.0, False))
    text = "\n".join(guest_lines(report))
    assert "22:00-07:30 (Europe/Paris): closed now; opens Wed 2025-01-08 22:00 CET" in text
    assert "42 s since the last input (ioreg)" in text and "pause_when_active_mins 10 min" in text
    assert "on AC (pmset); pause_on_battery on" in text and "thermal             fair" in text
    assert "PAUSED (outside_window), serves again in 32400 s" in text
    assert report.unreadable() == []


def test_doctor_warns_when_a_rule_cannot_read_its_signal():
    settings = Settings(pause_when_active_mins=10, pause_on_battery=True)
    report = run_doctor(settings, check_coordinator_url=False, explain_routing=False,
                        guest=lambda s: gather_guest(s, now=NOON, **readers(None, None)))
    warned = {(p.code, p.subject) for p in report.problems if p.code is ProblemCode.SIGNAL_UNAVAILABLE}
    assert warned == {(ProblemCode.SIGNAL_UNAVAILABLE, "pause_when_active_mins"),
                      (ProblemCode.SIGNAL_UNAVAILABLE, "pause_on_battery")}
    doc = report_json(report)["guest"]
    assert doc["state"] == "available" and doc["signals"]["idle_source"] == "unavailable"
    assert doc["windows"] == [] and doc["next_window_change"] is None


# --- status ----------------------------------------------------------------------------------------------


def test_status_prints_the_pause_and_its_reason():
    from provider.cli import render_status

    now = NOON.timestamp()
    text = render_status({"mode": "coordinator", "availability": {
        "state": "paused", "reason": "owner_active", "retry_after_s": 90, "memory_released": True,
        "windows": ["22:00-07:30"], "timezone": "UTC", "window_open": False, "next_window_change": now + 36000,
        "signals": {"idle_s": 510.0, "idle_source": "ioreg", "on_battery": False, "power_source": "pmset",
                    "thermal": "nominal"}}}, now=now)
    assert "availability: PAUSED (owner_active), serves again in 1 min 30 s; models unloaded" in text
    assert "windows: 22:00-07:30 (UTC), opens Wed 22:00 (in 10 h 00 min)" in text
    assert "idle 510 s (ioreg)" in text


# --- settings --------------------------------------------------------------------------------------------


def test_windows_from_file_environment_and_flags(tmp_path: Path):
    config = tmp_path / "provider.toml"
    config.write_text('serve_windows = ["22:00-07:30", "Sat 00:00-24:00"]\nserve_timezone = "Europe/Paris"\n')
    env = {"HOME": str(tmp_path)}
    from_file = load_settings(config_path=config, env=env)
    assert from_file.serve_windows == ("22:00-07:30", "sat 00:00-24:00")
    from_env = load_settings(env={**env, "DARKBLOOM_SERVE_WINDOWS": "mon-fri 19:00-23:00, sun 08:00-20:00",
                                  "DARKBLOOM_PAUSE_ON_BATTERY": "yes", "DARKBLOOM_PAUSE_WHEN_ACTIVE_MINS": "5"})
    assert from_env.serve_windows == ("mon-fri 19:00-23:00", "sun 08:00-20:00")
    assert from_env.pause_on_battery and from_env.pause_when_active_s == 300
    from provider.cli import build_parser, settings_from

    args = build_parser().parse_args(["doctor", "--serve-windows", "22:00-07:30", "--serve-windows", "sat 10:00-12:00"])
    assert settings_from(args).serve_windows == ("22:00-07:30", "sat 10:00-12:00")


@pytest.mark.parametrize("variable, value, words", [
    ("DARKBLOOM_SERVE_WINDOWS", "22:00-25:00", "25:00 is not a time of day"),
    ("DARKBLOOM_SERVE_WINDOWS", "someday 10:00-11:00", "is not a window"),
    ("DARKBLOOM_SERVE_TIMEZONE", "Mars/Olympus", "not a known IANA time zone"),
    ("DARKBLOOM_PAUSE_UNLOAD_GRACE_MINS", "-1", "greater than or equal to 0"),
])
def test_bad_values_name_where_they_came_from(tmp_path: Path, variable, value, words):
    with pytest.raises(ConfigError) as exc:
        load_settings(env={"HOME": str(tmp_path), variable: value})
    assert variable in str(exc.value) and words in str(exc.value)


async def test_doctor_reads_the_signals_from_inside_an_event_loop():
    """`gather_guest` is blocking but must not start an event loop of its own (it may run in one)."""
    report = gather_guest(Settings(), now=NOON, read_idle=lambda: Reading(None, Source.UNAVAILABLE),
                          read_power=lambda: Reading(False, Source.NO_SUPPLY))
    assert report.thermal is ThermalState.NOMINAL  # Linux: no thermal pressure to read
