"""Readers of the owner's signals: how long since the keyboard or mouse was used, and the power source.

Each reader is a parser over one command's (or sysfs's) output plus a thin shell that runs it
(`provider.hostcmd`); the parsers are tested on recorded output (tests/macos_samples, tests/linux_samples). A reader that cannot read
returns a `Reading` with `value=None` and a closed-vocabulary `source` saying why, which `doctor`
and /status show; it never raises.

Owner activity (`read_idle_seconds`):
* macOS: ``ioreg -r -d 1 -c IOHIDSystem``, property ``"HIDIdleTime" = <nanoseconds>`` since the last
  HID event (the smallest when several IOHIDSystem objects answer);
* Linux: what the desktop session offers: ``xprintidle`` (X11, milliseconds), else GNOME's
  ``org.gnome.Mutter.IdleMonitor.GetIdletime`` over ``gdbus`` (``(uint64 <ms>,)``); a headless
  machine or a service without the session's environment has neither: ``unavailable``.

Power (`read_on_battery`):
* macOS: ``pmset -g batt``, first line ``Now drawing from 'AC Power' | 'Battery Power' | 'UPS Power'``
  (a UPS counts as a battery: the mains are out);
* Linux: ``/sys/class/power_supply/*/uevent`` as systemd's ``on_ac_power`` reads it: an online
  ``Mains``/``USB``/… supply means AC; supplies with ``SCOPE=Device`` (a mouse's battery) are
  ignored; with supplies but none online, a system battery means battery; with no mains supply
  reported at all, a system battery that is ``Discharging`` means battery. No supply: a desktop (AC).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from provider.hostcmd import COMMAND_TIMEOUT_S, Runner, run_command

SYSFS_POWER = Path("/sys/class/power_supply")
IOREG = ("ioreg", "-r", "-d", "1", "-c", "IOHIDSystem")
PMSET_BATT = ("pmset", "-g", "batt")
XPRINTIDLE = ("xprintidle",)
MUTTER_IDLE = ("gdbus", "call", "--session", "--dest", "org.gnome.Mutter.IdleMonitor", "--object-path",
               "/org/gnome/Mutter/IdleMonitor/Core", "--method", "org.gnome.Mutter.IdleMonitor.GetIdletime")
# The session's variables a desktop idle query needs (the command runs with nothing else).
SESSION_ENV = ("DISPLAY", "WAYLAND_DISPLAY", "XAUTHORITY", "DBUS_SESSION_BUS_ADDRESS", "XDG_RUNTIME_DIR", "HOME")


class Source(StrEnum):
    """Where a reading came from, or why there is none."""

    IOREG = "ioreg"
    PMSET = "pmset"
    XPRINTIDLE = "xprintidle"
    MUTTER = "gnome_idle_monitor"
    SYSFS = "sysfs"
    NO_SUPPLY = "no_power_supply"  # nothing under /sys/class/power_supply: a desktop on mains
    UNAVAILABLE = "unavailable"  # nothing on this system can say
    UNREADABLE = "unreadable"  # the command ran but its output made no sense


@dataclass(frozen=True, slots=True)
class Reading:
    value: float | bool | None  # idle seconds / on battery; None: unknown
    source: Source


# --- parsers ------------------------------------------------------------------------------------------

_HID_IDLE = re.compile(r'"HIDIdleTime"\s*=\s*(\d+)')
_PMSET_SOURCE = re.compile(r"Now drawing from '([^']+)'")
_MUTTER = re.compile(r"^\(\s*uint(?:32|64)\s+(\d+)\s*,\s*\)$")


def parse_ioreg_idle(output: str | None) -> float | None:
    """Seconds since the last keyboard/mouse event, from ``ioreg`` (HIDIdleTime is in nanoseconds)."""
    values = [int(v) for v in _HID_IDLE.findall(output or "")]
    return min(values) / 1e9 if values else None


def parse_pmset_batt(output: str | None) -> bool | None:
    """True on battery (or UPS) power, False on AC, None when the output names no source."""
    match = _PMSET_SOURCE.search(output or "")
    if match is None:
        return None
    return match.group(1) in ("Battery Power", "UPS Power")


def parse_xprintidle(output: str | None) -> float | None:
    text = (output or "").strip()
    return int(text) / 1000 if text.isdigit() else None


def parse_mutter_idle(output: str | None) -> float | None:
    match = _MUTTER.match((output or "").strip())
    return int(match.group(1)) / 1000 if match else None


def parse_uevent(text: str) -> dict[str, str]:
    """``POWER_SUPPLY_KEY=value`` lines -> {"KEY": value}."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and key.startswith("POWER_SUPPLY_"):
            out[key.removeprefix("POWER_SUPPLY_")] = value.strip()
    return out


def on_battery_from_supplies(supplies: Mapping[str, Mapping[str, str]]) -> bool | None:
    """systemd's on_ac_power rule over parsed uevents (name -> fields); None: no supply at all."""
    system = {n: f for n, f in supplies.items() if f.get("SCOPE", "").lower() != "device"}
    if not system:
        return None
    batteries = [f for f in system.values() if f.get("TYPE") == "Battery"]
    mains = [f for f in system.values() if f.get("TYPE") not in ("Battery", None)]
    if any(f.get("ONLINE") == "1" for f in mains):
        return False
    if mains:
        return bool(batteries)
    return any(f.get("STATUS") == "Discharging" for f in batteries)


def read_sysfs_supplies(root: Path = SYSFS_POWER) -> dict[str, dict[str, str]]:
    supplies: dict[str, dict[str, str]] = {}
    try:
        entries = sorted(root.iterdir())
    except OSError:
        return supplies
    for entry in entries:
        try:
            supplies[entry.name] = parse_uevent((entry / "uevent").read_text(encoding="utf-8", errors="replace"))
        except OSError:
            continue
    return supplies


# --- the shells ---------------------------------------------------------------------------------------


def session_run(argv: Sequence[str]) -> str | None:
    """`provider.hostcmd.run_command`, but with the desktop session's variables (`SESSION_ENV`), which
    an X11 or D-Bus query needs to find the session; nothing else of this process's environment."""
    env = {"PATH": "/usr/bin:/bin:/usr/sbin:/sbin:/usr/local/bin", "LANG": "C"}
    env.update({k: os.environ[k] for k in SESSION_ENV if k in os.environ})
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S,
                              check=False, env=env)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def _from_command(run: Runner, argv: Sequence[str], parse: Callable[[str], Any], source: Source) -> Reading:
    """A macOS command's reading: unavailable when it cannot run, unreadable when its output does not parse."""
    output = run(argv)
    if output is None:
        return Reading(None, Source.UNAVAILABLE)
    value = parse(output)
    return Reading(value, source if value is not None else Source.UNREADABLE)


def read_idle_seconds(*, platform: str = sys.platform, run: Runner = run_command,
                      session_run: Runner = session_run) -> Reading:
    """Seconds since the owner last used the keyboard or mouse. Blocking: call off the event loop."""
    if platform == "darwin":
        return _from_command(run, IOREG, parse_ioreg_idle, Source.IOREG)
    for argv, parse, source in ((XPRINTIDLE, parse_xprintidle, Source.XPRINTIDLE),
                                (MUTTER_IDLE, parse_mutter_idle, Source.MUTTER)):
        seconds = parse(session_run(argv))
        if seconds is not None:
            return Reading(seconds, source)
    return Reading(None, Source.UNAVAILABLE)


def read_on_battery(*, platform: str = sys.platform, run: Runner = run_command,
                    sysfs: Path = SYSFS_POWER) -> Reading:
    """Whether the machine runs on battery now. Blocking: call off the event loop."""
    if platform == "darwin":
        return _from_command(run, PMSET_BATT, parse_pmset_batt, Source.PMSET)
    value = on_battery_from_supplies(read_sysfs_supplies(sysfs))
    return Reading(False, Source.NO_SUPPLY) if value is None else Reading(value, Source.SYSFS)


__all__ = ["IOREG", "MUTTER_IDLE", "PMSET_BATT", "XPRINTIDLE", "Reading", "Runner", "Source",
           "on_battery_from_supplies", "parse_ioreg_idle", "parse_mutter_idle", "parse_pmset_batt", "parse_uevent",
           "parse_xprintidle", "read_idle_seconds", "read_on_battery", "read_sysfs_supplies", "session_run"]
