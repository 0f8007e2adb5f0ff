"""Serving windows: when the owner lets the Mac serve, in the owner's local wall-clock time. Pure.

A window is written ``[DAYS ]HH:MM-HH:MM``:

* ``22:00-07:30``        every night, from 22:00 to 07:30 the next morning;
* ``sat 00:00-24:00``    all of Saturday;
* ``mon-fri 09:00-17:00`` weekdays (a day range may wrap: ``fri-mon``).

Days are ``mon tue wed thu fri sat sun`` (any case). A window belongs to the day it *starts* on:
``fri 22:00-07:30`` runs from Friday 22:00 to Saturday 07:30. ``24:00`` is allowed as an end
(midnight at the end of the day); a window whose start equals its end is refused (it would be
either empty or the whole day: write ``00:00-24:00`` for the latter). Overlapping windows simply
add up. No windows at all means "always".

Membership is a matter of wall-clock time in the owner's zone, so across a DST change a window
still opens and closes at the times written: on a spring-forward night ``01:00-03:00`` is one
hour long; a window that starts inside the skipped hour opens when the clock jumps past it. The
instants at which membership can change are the window edges on each day (both readings of a
repeated hour) and the zone's own transitions, so `next_flip` looks only at those.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta, tzinfo

DAY_NAMES = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
ALL_DAYS = frozenset(range(7))
HORIZON_DAYS = 16  # a week, plus a week for a window that a DST gap swallowed, plus margin
_WINDOW = re.compile(r"^(?:(?P<days>[a-z]{3}(?:-[a-z]{3})?)\s+)?(?P<start>\d{1,2}:\d{2})\s*-\s*(?P<end>\d{1,2}:\d{2})$")
_STEP = timedelta(hours=6)  # how finely the zone is sampled for offset changes


class WindowError(ValueError):
    """A window that cannot be read; the message says why in the operator's terms."""


@dataclass(frozen=True, slots=True)
class ServeWindow:
    days: frozenset[int]  # the weekdays it starts on (Monday = 0)
    start_min: int  # minutes after midnight, 0..1439
    end_min: int  # 1..1440; at or before the start: it ends the next day
    text: str  # as written (normalised), for status and doctor

    @property
    def crosses_midnight(self) -> bool:
        return self.end_min <= self.start_min

    def contains(self, weekday: int, second_of_day: float) -> bool:
        start, end = self.start_min * 60, self.end_min * 60
        if not self.crosses_midnight:
            return weekday in self.days and start <= second_of_day < end
        return (weekday in self.days and second_of_day >= start) or \
            ((weekday - 1) % 7 in self.days and second_of_day < end)


def parse_window(text: str) -> ServeWindow:
    raw = " ".join(text.strip().lower().split())
    match = _WINDOW.match(raw)
    if match is None:
        raise WindowError(f"{text!r} is not a window: write [DAYS ]HH:MM-HH:MM, e.g. 22:00-07:30 or sat 00:00-24:00")
    start = _minutes(match["start"], text, end=False)
    end = _minutes(match["end"], text, end=True)
    if start == end:
        raise WindowError(f"{text!r} starts when it ends: write 00:00-24:00 for a whole day")
    days = _days(match["days"], text) if match["days"] else ALL_DAYS
    canonical = f"{match['days'] + ' ' if match['days'] else ''}{_hhmm(start)}-{_hhmm(end)}"
    return ServeWindow(days, start, end, canonical)


def parse_windows(texts: Iterable[str]) -> tuple[ServeWindow, ...]:
    return tuple(parse_window(t) for t in texts)


def _minutes(hhmm: str, text: str, *, end: bool) -> int:
    hours, minutes = (int(p) for p in hhmm.split(":"))
    if minutes > 59 or hours > 24 or (hours == 24 and (minutes or not end)):
        raise WindowError(f"{text!r}: {hhmm} is not a time of day (00:00 to 23:59, or 24:00 as an end)")
    return hours * 60 + minutes


def _hhmm(minutes: int) -> str:
    return f"{minutes // 60:02d}:{minutes % 60:02d}"


def _days(spec: str, text: str) -> frozenset[int]:
    first, _, last = spec.partition("-")
    for name in (first, last or first):
        if name not in DAY_NAMES:
            raise WindowError(f"{text!r}: {name!r} is not a day ({', '.join(DAY_NAMES)})")
    a, b = DAY_NAMES.index(first), DAY_NAMES.index(last or first)
    return frozenset((a + i) % 7 for i in range((b - a) % 7 + 1))


# --- membership and the next change ---------------------------------------------------------------------


def _wall(instant: datetime, zone: tzinfo) -> tuple[int, float]:
    local = instant.astimezone(zone)
    return local.weekday(), local.hour * 3600 + local.minute * 60 + local.second + local.microsecond / 1e6


def is_open(instant: datetime, windows: Sequence[ServeWindow], zone: tzinfo) -> bool:
    """Is `instant` (aware) inside a window? No windows: always."""
    if not windows:
        return True
    weekday, second = _wall(instant, zone)
    return any(w.contains(weekday, second) for w in windows)


def next_flip(after: datetime, windows: Sequence[ServeWindow], zone: tzinfo) -> datetime | None:
    """The first instant later than `after` at which `is_open` differs from its value at `after`;
    None when it never changes (no windows, or windows covering every moment). Looks two days
    ahead first (the common case, cheap), then the whole horizon."""
    if not windows:
        return None
    state = is_open(after, windows, zone)
    for days in (2, HORIZON_DAYS):
        for candidate in _candidates(after, after + timedelta(days=days), windows, zone):
            if is_open(candidate, windows, zone) != state:
                return candidate
    return None


def next_open(at: datetime, windows: Sequence[ServeWindow], zone: tzinfo) -> datetime | None:
    """`at` itself when a window is open then, else the moment the next one opens (None: never)."""
    return at if is_open(at, windows, zone) else next_flip(at, windows, zone)


def _candidates(after: datetime, until: datetime, windows: Sequence[ServeWindow], zone: tzinfo) -> list[datetime]:
    """Every instant in (after, until] at which membership can change, sorted: the window edges of
    each local day that can reach into the range, and the zone's offset changes in it."""
    first_day = after.astimezone(zone).date() - timedelta(days=1)
    last_day = until.astimezone(zone).date() + timedelta(days=1)
    edges = sorted({m for w in windows for m in (w.start_min, w.end_min)})
    found: set[datetime] = set()
    for offset in range((last_day - first_day).days + 1):
        day = first_day + timedelta(days=offset)
        for minute in edges:
            found.update(_instants(day, minute, zone))
    found.update(_transitions(after, until, zone))
    return sorted(c for c in found if after < c <= until)


def _instants(day: date, minute: int, zone: tzinfo) -> set[datetime]:
    """The instants whose wall time in `zone` reads `day` + `minute` (two in a repeated hour; in a
    skipped hour, the instant zoneinfo maps it to, which the transition itself precedes)."""
    wall = datetime(day.year, day.month, day.day) + timedelta(minutes=minute)
    return {wall.replace(tzinfo=zone, fold=fold).astimezone(UTC) for fold in (0, 1)}


def _transitions(start: datetime, end: datetime, zone: tzinfo) -> set[datetime]:
    """Instants in [start, end] where the zone's UTC offset changes (to the second)."""
    found: set[datetime] = set()
    t = start.astimezone(UTC)
    previous = t.astimezone(zone).utcoffset()
    while t < end:
        nxt = min(t + _STEP, end.astimezone(UTC))
        offset = nxt.astimezone(zone).utcoffset()
        if offset != previous:
            lo, hi = int(t.timestamp()), int(nxt.timestamp())  # offset(lo) = previous, offset(hi) = new
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if datetime.fromtimestamp(mid, UTC).astimezone(zone).utcoffset() == previous:
                    lo = mid
                else:
                    hi = mid
            found.add(datetime.fromtimestamp(hi, UTC))
            previous = offset
        t = nxt
    return found


__all__ = ["ALL_DAYS", "DAY_NAMES", "ServeWindow", "WindowError", "is_open", "next_flip", "next_open",
           "parse_window", "parse_windows"]
