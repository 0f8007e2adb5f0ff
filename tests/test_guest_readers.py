"""provider/guest readers on recorded output: ``ioreg`` HIDIdleTime, ``pmset -g batt``,
/sys/class/power_supply, xprintidle and GNOME's idle monitor. Each sample (tests/macos_samples,
tests/linux_samples) names its command, its source and its provenance: ``verbatim`` (a real output pasted
in a public issue), ``derived`` (a real one with parts constructed, said which) or ``constructed`` (from
the documented format, when no public recording was found: the ioreg dumps, the UPS line, xprintidle,
gdbus).
No Mac here: the commands are replaced by the recorded text; the sysfs samples are laid out as files."""

from __future__ import annotations

from pathlib import Path

import pytest

from macos_samples import sample as macos_sample
from provider.guest.readers import (
    IOREG,
    MUTTER_IDLE,
    PMSET_BATT,
    XPRINTIDLE,
    Source,
    on_battery_from_supplies,
    parse_ioreg_idle,
    parse_mutter_idle,
    parse_pmset_batt,
    parse_xprintidle,
    read_idle_seconds,
    read_on_battery,
)

LINUX_SAMPLES = Path(__file__).parent / "linux_samples"


def sample(name: str) -> str:
    """A recorded output: macOS ones from tests/macos_samples (its __init__ states the header
    rules), Linux ones from tests/linux_samples (the same ``#`` header: command, source, provenance)."""
    if not name.startswith(("sysfs_", "xprintidle", "gdbus_")):
        return macos_sample(name)
    lines = (LINUX_SAMPLES / name).read_text(encoding="utf-8").splitlines(keepends=True)
    head = "".join(line for line in lines if line.startswith("#"))
    assert "# command:" in head and "# source:" in head and "# provenance:" in head, name
    return "".join(line for line in lines if not line.startswith("#"))


def commands(outputs: dict[tuple[str, ...], str | None]):
    """A runner answering each argv with its recorded output (None: the command is missing or failed)."""
    seen: list[tuple[str, ...]] = []

    def run(argv):
        seen.append(tuple(argv))
        return outputs.get(tuple(argv))

    run.seen = seen  # type: ignore[attr-defined]
    return run


# --- macOS ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, seconds", [
    ("ioreg_hidsystem_root.txt", 164.247344708),
    ("ioreg_hidsystem_tree.txt", 0.812044833),
])
def test_hid_idle_time_is_nanoseconds(name, seconds):
    assert parse_ioreg_idle(sample(name)) == pytest.approx(seconds)
    reading = read_idle_seconds(platform="darwin", run=commands({IOREG: sample(name)}))
    assert reading.value == pytest.approx(seconds) and reading.source is Source.IOREG


def test_no_hid_idle_time_is_unreadable_not_zero():
    nothing = ""  # ioreg -r with no matching object exits 0 and prints nothing (ioreg(8): only matching roots)
    assert parse_ioreg_idle(nothing) is None
    reading = read_idle_seconds(platform="darwin", run=commands({IOREG: nothing}))
    assert reading.value is None and reading.source is Source.UNREADABLE
    missing = read_idle_seconds(platform="darwin", run=commands({}))
    assert missing.value is None and missing.source is Source.UNAVAILABLE


def test_several_hid_systems_take_the_most_recent_input():
    text = sample("ioreg_hidsystem_root.txt") + sample("ioreg_hidsystem_tree.txt")
    assert parse_ioreg_idle(text) == pytest.approx(0.812044833)


@pytest.mark.parametrize("name, on_battery", [
    ("pmset_batt_battery.txt", True),
    ("pmset_batt_battery_early_warning.txt", True),
    ("pmset_batt_battery_no_estimate.txt", True),
    ("pmset_batt_ac_charging.txt", False),
    ("pmset_batt_ac_not_charging.txt", False),
    ("pmset_batt_desktop.txt", False),
    ("pmset_batt_ups.txt", True),
])
def test_pmset_power_source(name, on_battery):
    assert parse_pmset_batt(sample(name)) is on_battery
    reading = read_on_battery(platform="darwin", run=commands({PMSET_BATT: sample(name)}))
    assert reading.value is on_battery and reading.source is Source.PMSET


def test_pmset_without_a_source_line_is_unreadable():
    assert parse_pmset_batt("pmset: no power source information") is None
    assert read_on_battery(platform="darwin", run=commands({PMSET_BATT: ""})).source is Source.UNREADABLE
    assert read_on_battery(platform="darwin", run=commands({})).source is Source.UNAVAILABLE


# --- Linux ----------------------------------------------------------------------------------------------


def lay_out(name: str, root: Path) -> Path:
    """Write a recorded sysfs sample ("== DIR/uevent" sections) under root/power_supply."""
    supply = root / "power_supply"
    supply.mkdir()
    current: Path | None = None
    for line in sample(name).splitlines():
        if line.startswith("== "):
            current = supply / line[3:]
            current.parent.mkdir(parents=True, exist_ok=True)
            current.write_text("")
        elif current is not None:
            current.write_text(current.read_text() + line + "\n")
    return supply


@pytest.mark.parametrize("name, on_battery, source", [
    ("sysfs_laptop_charging.txt", False, Source.SYSFS),
    ("sysfs_thinkpad_on_battery.txt", True, Source.SYSFS),
    ("sysfs_xps_no_adapter_discharging.txt", True, Source.SYSFS),
    ("sysfs_desktop_wireless_mouse.txt", False, Source.NO_SUPPLY),
    ("sysfs_server_none.txt", False, Source.NO_SUPPLY),
])
def test_sysfs_power_source(tmp_path, name, on_battery, source):
    reading = read_on_battery(platform="linux", sysfs=lay_out(name, tmp_path))
    assert (reading.value, reading.source) == (on_battery, source)


def test_sysfs_rules():
    mains_off = {"TYPE": "Mains", "ONLINE": "0"}
    battery = {"TYPE": "Battery", "STATUS": "Not charging"}
    assert on_battery_from_supplies({"AC": mains_off, "BAT0": battery}) is True  # no mains online, a battery
    assert on_battery_from_supplies({"AC": mains_off}) is False  # an offline USB-C port on a desktop
    assert on_battery_from_supplies({"BAT0": battery}) is False  # no adapter reported, not discharging
    assert on_battery_from_supplies({"AC": {"TYPE": "Mains", "ONLINE": "1"},
                                     "BAT0": {"TYPE": "Battery", "STATUS": "Discharging"}}) is False
    assert on_battery_from_supplies({}) is None


def test_no_sysfs_directory_is_a_desktop(tmp_path):
    reading = read_on_battery(platform="linux", sysfs=tmp_path / "absent")
    assert (reading.value, reading.source) == (False, Source.NO_SUPPLY)


def test_linux_idle_from_xprintidle_then_gnome():
    xprint, mutter = sample("xprintidle.txt"), sample("gdbus_mutter_idletime.txt")
    assert parse_xprintidle(xprint) == 95.21 and parse_mutter_idle(mutter) == 1843.217
    both = read_idle_seconds(platform="linux", session_run=commands({XPRINTIDLE: xprint, MUTTER_IDLE: mutter}))
    assert (both.value, both.source) == (95.21, Source.XPRINTIDLE)
    gnome = commands({MUTTER_IDLE: mutter})
    wayland = read_idle_seconds(platform="linux", session_run=gnome)
    assert (wayland.value, wayland.source) == (1843.217, Source.MUTTER)
    assert gnome.seen == [XPRINTIDLE, MUTTER_IDLE]


def test_linux_idle_without_a_session_is_unavailable():
    error = "Error: GDBus.Error:org.freedesktop.DBus.Error.ServiceUnknown: The name is not activatable"
    assert parse_mutter_idle(error) is None and parse_xprintidle("") is None
    reading = read_idle_seconds(platform="linux", session_run=commands({MUTTER_IDLE: error}))
    assert (reading.value, reading.source) == (None, Source.UNAVAILABLE)
