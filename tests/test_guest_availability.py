"""provider/guest: the one pure decision, `availability(now, signals, rules)`, and the serving
windows it reads — across midnight, weekdays, DST changes (zoneinfo), empty and overlapping windows,
owner activity, battery and heat — with the property that `retry_after_s` points at the next moment the
function says Available."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol import ThermalState
from protocol.errors import ErrorReason, Failover, FailureCode
from provider.guest import (
    MAX_RETRY_AFTER_S,
    UNKNOWN_RETRY_AFTER_S,
    Available,
    Paused,
    PauseReason,
    Rules,
    Signals,
    WindowError,
    availability,
    is_open,
    next_flip,
    next_window_change,
    parse_window,
    parse_windows,
)

PARIS = ZoneInfo("Europe/Paris")  # DST: 2025-03-30 02:00 -> 03:00, 2025-10-26 03:00 -> 02:00
NEW_YORK = ZoneInfo("America/New_York")  # DST: 2025-03-09 02:00 -> 03:00, 2025-11-02 02:00 -> 01:00
LORD_HOWE = ZoneInfo("Australia/Lord_Howe")  # a 30-minute DST shift


def at(zone, *args, fold=0) -> datetime:
    """A wall time in `zone`, as a UTC instant (a repeated-hour time never compares equal across zones)."""
    return datetime(*args, tzinfo=zone, fold=fold).astimezone(UTC)


def rules(*windows: str, zone=PARIS, **kw) -> Rules:
    return Rules(windows=parse_windows(windows), zone=zone, **kw)


# --- parsing ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, days, start, end, canonical", [
    ("22:00-07:30", set(range(7)), 22 * 60, 7 * 60 + 30, "22:00-07:30"),
    ("Sat 00:00-24:00", {5}, 0, 1440, "sat 00:00-24:00"),
    ("mon-fri 9:00 - 17:00", {0, 1, 2, 3, 4}, 540, 1020, "mon-fri 09:00-17:00"),
    ("fri-mon 23:00-01:00", {4, 5, 6, 0}, 1380, 60, "fri-mon 23:00-01:00"),
    ("sun-sun 10:00-11:00", {6}, 600, 660, "sun-sun 10:00-11:00"),
])
def test_windows_parse(text, days, start, end, canonical):
    w = parse_window(text)
    assert (set(w.days), w.start_min, w.end_min, w.text) == (days, start, end, canonical)


@pytest.mark.parametrize("text", ["", "22:00", "22-07", "24:00-01:00", "10:60-11:00", "funday 10:00-11:00",
                                  "10:00-10:00", "00:00-00:00", "mon,tue 10:00-11:00", "10:00-24:30"])
def test_bad_windows_are_refused_with_a_reason(text):
    with pytest.raises(WindowError):
        parse_window(text)


# --- windows ---------------------------------------------------------------------------------------------


def test_no_windows_means_always():
    r = rules()
    assert availability(at(PARIS, 2025, 1, 1, 3, 0), Signals(), r) == Available()
    assert next_window_change(at(PARIS, 2025, 1, 1, 3, 0), r) is None


def test_a_window_across_midnight_is_open_until_the_next_morning():
    r = rules("22:00-07:30")
    assert availability(at(PARIS, 2025, 1, 7, 21, 59, 59), Signals(), r) == Paused(PauseReason.OUTSIDE_WINDOW, 1)
    for moment in ((2025, 1, 7, 22, 0), (2025, 1, 7, 23, 59), (2025, 1, 8, 0, 0), (2025, 1, 8, 7, 29, 59)):
        assert availability(at(PARIS, *moment), Signals(), r) == Available()
    closed = availability(at(PARIS, 2025, 1, 8, 7, 30), Signals(), r)
    assert closed == Paused(PauseReason.OUTSIDE_WINDOW, 14 * 3600 + 30 * 60)
    assert closed.resumes_at == at(PARIS, 2025, 1, 8, 22, 0)


def test_a_weekday_window_belongs_to_the_day_it_starts_on():
    r = rules("fri 22:00-07:30")  # 2025-01-10 is a Friday
    assert is_open(at(PARIS, 2025, 1, 10, 23, 0), r.windows, PARIS)
    assert is_open(at(PARIS, 2025, 1, 11, 7, 0), r.windows, PARIS)  # Saturday morning: still Friday's window
    assert not is_open(at(PARIS, 2025, 1, 11, 23, 0), r.windows, PARIS)  # Saturday night is not Friday
    assert not is_open(at(PARIS, 2025, 1, 10, 7, 0), r.windows, PARIS)  # Friday morning is Thursday's slot
    paused = availability(at(PARIS, 2025, 1, 11, 8, 0), Signals(), r)
    assert paused.resumes_at == at(PARIS, 2025, 1, 17, 22, 0)  # next Friday


def test_whole_days_and_overlapping_windows_add_up():
    r = rules("sat 00:00-24:00", "sun 00:00-24:00", "sat 10:00-12:00", "22:00-07:30")
    # Friday 22:00 opens a stretch that overlapping windows keep open until Monday 07:30.
    friday = at(PARIS, 2025, 1, 10, 21, 0)
    assert availability(friday, Signals(), r).resumes_at == at(PARIS, 2025, 1, 10, 22, 0)
    assert next_flip(at(PARIS, 2025, 1, 10, 22, 0), r.windows, PARIS) == at(PARIS, 2025, 1, 13, 7, 30)


def test_windows_covering_every_moment_never_change():
    r = rules("00:00-24:00", "23:00-01:00")
    assert next_window_change(at(PARIS, 2025, 6, 1, 12, 0), r) is None
    assert availability(at(PARIS, 2025, 6, 1, 23, 30), Signals(), r) == Available()


# --- DST -------------------------------------------------------------------------------------------------


def test_spring_forward_a_night_window_is_an_hour_shorter_in_real_time():
    r = rules("22:00-07:30")
    opened = at(PARIS, 2025, 3, 29, 22, 0)
    closes = next_flip(opened, r.windows, PARIS)
    assert closes == at(PARIS, 2025, 3, 30, 7, 30)
    assert closes - opened == timedelta(hours=8, minutes=30)  # 9.5 h of wall clock, one hour skipped


def test_a_window_starting_in_the_skipped_hour_opens_when_the_clock_jumps():
    r = rules("02:30-04:00")
    paused = availability(at(PARIS, 2025, 3, 30, 1, 0), Signals(), r)
    assert paused.resumes_at == datetime(2025, 3, 30, 1, 0, tzinfo=UTC)  # 02:00 CET -> 03:00 CEST
    assert paused.retry_after_s == 3600
    assert paused.resumes_at.astimezone(PARIS).hour == 3


def test_a_window_inside_the_skipped_hour_waits_for_the_next_day():
    paused = availability(at(NEW_YORK, 2025, 3, 9, 1, 0), Signals(), rules("02:00-02:30", zone=NEW_YORK))
    assert paused.resumes_at == at(NEW_YORK, 2025, 3, 10, 2, 0)
    assert paused.retry_after_s == 24 * 3600  # 01:00 EST -> 02:00 EDT the next day: 25 h wall, 24 h real


def test_fall_back_the_repeated_hour_counts_twice():
    r = rules("01:00-02:00", zone=NEW_YORK)  # 2025-11-02: 01:00-02:00 EDT, then 01:00-02:00 EST again
    first = at(NEW_YORK, 2025, 11, 2, 1, 0)
    closes = next_flip(first, r.windows, NEW_YORK)
    assert closes - first == timedelta(hours=2)
    assert closes == at(NEW_YORK, 2025, 11, 2, 2, 0)


def test_fall_back_a_window_ending_in_the_repeated_hour_closes_at_its_first_reading():
    r = rules("22:00-01:30", zone=NEW_YORK)
    closes = next_flip(at(NEW_YORK, 2025, 11, 1, 22, 0), r.windows, NEW_YORK)
    # 01:30 EDT ends the window; the repeated 01:00-01:30 EST is wall time inside it again.
    assert closes == at(NEW_YORK, 2025, 11, 2, 1, 30, fold=0)
    reopens = next_flip(closes, r.windows, NEW_YORK)
    assert reopens == at(NEW_YORK, 2025, 11, 2, 1, 0, fold=1)
    assert next_flip(reopens, r.windows, NEW_YORK) == at(NEW_YORK, 2025, 11, 2, 1, 30, fold=1)


def test_a_half_hour_dst_zone():
    r = rules("02:00-02:45", zone=LORD_HOWE)  # 2025-10-05 02:00 -> 02:30 at Lord Howe
    opens = availability(at(LORD_HOWE, 2025, 10, 5, 1, 0), Signals(), r).resumes_at
    assert opens.astimezone(LORD_HOWE).strftime("%H:%M") == "02:30"  # the clock skips 02:00-02:30
    assert next_flip(opens, r.windows, LORD_HOWE).astimezone(LORD_HOWE).strftime("%H:%M") == "02:45"


# --- owner activity, battery, heat -------------------------------------------------------------------------

NOON = at(PARIS, 2025, 1, 8, 12, 0)


def test_owner_activity_pauses_until_idle_long_enough():
    r = rules(pause_when_active_s=600)
    typing = Signals(last_input_at=NOON - timedelta(seconds=30))
    paused = availability(NOON, typing, r)
    assert paused == Paused(PauseReason.OWNER_ACTIVE, 570)
    assert availability(NOON + timedelta(seconds=570), typing, r) == Available()
    assert availability(NOON, Signals(last_input_at=NOON - timedelta(minutes=11)), r) == Available()


def test_an_unread_signal_never_pauses():
    r = rules(pause_when_active_s=600, pause_on_battery=True, pause_on_thermal=True)
    assert availability(NOON, Signals(), r) == Available()


def test_signals_pause_only_when_their_rule_is_on():
    hot_on_battery_typing = Signals(last_input_at=NOON, on_battery=True, thermal=ThermalState.CRITICAL)
    assert availability(NOON, hot_on_battery_typing, rules(pause_on_thermal=False)) == Available()
    assert availability(NOON, Signals(thermal=ThermalState.FAIR), rules()) == Available()
    assert availability(NOON, Signals(thermal=ThermalState.SERIOUS), rules()) == Paused(PauseReason.THERMAL, None)


@pytest.mark.parametrize("window, hot, battery, active, reason", [
    (False, True, True, True, PauseReason.OUTSIDE_WINDOW),
    (True, True, True, True, PauseReason.THERMAL),
    (True, False, True, True, PauseReason.ON_BATTERY),
    (True, False, False, True, PauseReason.OWNER_ACTIVE),
    (True, False, False, False, None),
])
def test_one_reason_in_a_fixed_order(window, hot, battery, active, reason):
    r = rules("10:00-11:00" if not window else "11:00-13:00", pause_when_active_s=600, pause_on_battery=True)
    signals = Signals(last_input_at=NOON if active else None, on_battery=battery,
                      thermal=ThermalState.SERIOUS if hot else ThermalState.NOMINAL)
    result = availability(NOON, signals, r)
    assert (result.reason if isinstance(result, Paused) else None) is reason


def test_battery_and_heat_have_no_foreseeable_end():
    r = rules("22:00-07:30", pause_on_battery=True)
    paused = availability(NOON, Signals(on_battery=True), r)  # outside the window and on battery
    assert paused == Paused(PauseReason.OUTSIDE_WINDOW, None)  # the window opening would not be enough
    assert paused.retry_hint_s == UNKNOWN_RETRY_AFTER_S
    assert availability(NOON, Signals(on_battery=False), r).retry_after_s == 10 * 3600


def test_activity_and_window_together_wait_for_both():
    r = rules("12:05-13:00", pause_when_active_s=1200)
    typing = Signals(last_input_at=NOON)  # idle enough at 12:20; the window opened at 12:05
    assert availability(NOON, typing, r) == Paused(PauseReason.OUTSIDE_WINDOW, 1200)
    late = rules("12:05-12:10", "12:30-13:00", pause_when_active_s=1200)  # idle enough inside neither window
    assert availability(NOON, typing, late).retry_after_s == 1800


def test_the_refusal_hint_is_capped():
    far = availability(NOON, Signals(), rules("sun 10:00-11:00"))
    assert far.retry_after_s > MAX_RETRY_AFTER_S and far.retry_hint_s == MAX_RETRY_AFTER_S


def test_a_pause_is_a_draining_refusal_with_feasible_after():
    from protocol.errors import Failure, inference_error_frame

    failure = Failure.paused(Paused(PauseReason.OUTSIDE_WINDOW, 125).retry_hint_s)
    assert failure.status_code == 503 and failure.code is FailureCode.CAPACITY
    assert failure.reason is ErrorReason.DRAINING and failure.failover is Failover.DRAIN
    assert failure.retry_after_s == 125
    frame = inference_error_frame("r1", failure)
    assert frame.feasible_after_ms == 125_000 and frame.error_reason is ErrorReason.DRAINING


# --- the property: retry_after points at the next moment the function says Available ------------------------

ZONES = [PARIS, NEW_YORK, LORD_HOWE, ZoneInfo("UTC"), ZoneInfo("Asia/Kolkata")]
window_text = st.builds(
    lambda days, start, length: f"{days} {start // 60:02d}:{start % 60:02d}-"
                                f"{(start + length) % 1440 // 60:02d}:{(start + length) % 1440 % 60:02d}"
    if (start + length) % 1440 else f"{days} {start // 60:02d}:{start % 60:02d}-24:00",
    st.sampled_from(["mon", "tue", "sat", "sun", "mon-fri", "fri-mon", "wed-wed"]),
    st.integers(0, 1439), st.integers(1, 1439))
instants = st.datetimes(min_value=datetime(2024, 1, 1), max_value=datetime(2027, 12, 31),
                        timezones=st.just(UTC))


@settings(max_examples=300, deadline=None)
@given(windows=st.lists(window_text, max_size=4), zone=st.sampled_from(ZONES), now=instants,
       idle_s=st.none() | st.floats(0, 7200), threshold_s=st.none() | st.floats(1, 3600))
def test_retry_after_points_at_the_next_moment_the_function_says_available(windows, zone, now, idle_s, threshold_s):
    r = Rules(windows=parse_windows(windows), zone=zone, pause_when_active_s=threshold_s)
    signals = Signals(last_input_at=None if idle_s is None else now - timedelta(seconds=idle_s))
    result = availability(now, signals, r)
    if isinstance(result, Available):
        return
    assert result.retry_after_s is not None and result.retry_after_s >= 1
    resumes = result.resumes_at
    assert resumes is not None and now < resumes <= now + timedelta(seconds=result.retry_after_s)
    assert result.retry_after_s - 1 < (resumes - now).total_seconds()  # whole seconds, rounded up
    assert isinstance(availability(resumes, signals, r), Available)
    assert isinstance(availability(now + timedelta(seconds=result.retry_after_s), signals, r), Available)
    # Paused everywhere before it: at the window edges and DST changes in between, and a few other points.
    probes = {now + (resumes - now) * k / 7 for k in range(7)} | {resumes - timedelta(microseconds=1)}
    probes |= {c for c in (next_flip(now, r.windows, zone),) if c is not None and c < resumes}
    for t in probes:
        if now <= t < resumes:
            assert isinstance(availability(t, signals, r), Paused), t
