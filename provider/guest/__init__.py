"""provider/guest: be a good guest on the owner's Mac.

The owner says when the Mac serves (`serve_windows`, local time), and may ask it to step aside
while they use it (`pause_when_active_mins`), while it runs on battery (`pause_on_battery`) or
while it is hot (`pause_on_thermal`). Outside those moments the agent stays connected, refuses
new requests at admission with a fast 503 ``draining`` whose Retry-After (``feasible_after_ms``)
is the time until it serves again, lets in-flight requests finish, says ``draining`` in its
heartbeats, and after `pause_unload_grace_mins` unloads its models so the owner gets the memory
back; when it may serve again it reloads `preload_models`.

Modules:
* `windows`       parsing ``[DAYS ]HH:MM-HH:MM`` windows; membership and the next change (zoneinfo, DST)
* `availability`  the one pure decision: ``availability(now, signals, rules) -> Available | Paused``
* `readers`       HIDIdleTime (ioreg), pmset, /sys/class/power_supply, xprintidle, GNOME's idle monitor
* `zone`          the owner's time zone; the rules from the settings
* `monitor`       `GuestMonitor`: reads the signals, steps the state, logs changes, unloads and reloads

Admission (`provider/slots/admission.decide`) asks `GuestMonitor.paused()` through the manager's
view, so a pause is refused where every other refusal is.
"""

from provider.guest.availability import (
    MAX_RETRY_AFTER_S,
    UNKNOWN_RETRY_AFTER_S,
    Availability,
    Available,
    Paused,
    PauseReason,
    Rules,
    Signals,
    availability,
    next_window_change,
)
from provider.guest.windows import ServeWindow, WindowError, is_open, next_flip, parse_window, parse_windows

__all__ = [
    "MAX_RETRY_AFTER_S",
    "UNKNOWN_RETRY_AFTER_S",
    "Availability",
    "Available",
    "PauseReason",
    "Paused",
    "Rules",
    "ServeWindow",
    "Signals",
    "WindowError",
    "availability",
    "is_open",
    "next_flip",
    "next_window_change",
    "parse_window",
    "parse_windows",
]
