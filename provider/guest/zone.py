"""The owner's time zone and the rules the settings describe."""

from __future__ import annotations

import os
from datetime import datetime, tzinfo
from pathlib import Path
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from provider.config import Settings
from provider.guest.availability import Rules
from provider.guest.windows import parse_windows

LOCALTIME = Path("/etc/localtime")


def _zone(name: str) -> ZoneInfo | None:
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        return None


def local_zone(*, env: dict[str, str] | None = None, localtime: Path = LOCALTIME) -> tzinfo:
    """This machine's zone with its DST rules: ``$TZ`` when it names an IANA zone, else the zone
    ``/etc/localtime`` links to (macOS: /var/db/timezone/zoneinfo/<name>, Linux:
    /usr/share/zoneinfo/<name>), else the current fixed offset (no DST rules known)."""
    tz = (os.environ if env is None else env).get("TZ", "").removeprefix(":")
    if tz and (zone := _zone(tz)) is not None:
        return zone
    try:
        target = str(localtime.resolve())
    except OSError:
        target = ""
    if "zoneinfo/" in target and (zone := _zone(target.split("zoneinfo/", 1)[1])) is not None:
        return zone
    offset = datetime.now().astimezone().tzinfo
    assert offset is not None
    return offset


def zone_name(zone: tzinfo) -> str:
    return getattr(zone, "key", None) or str(zone)


def rules_from_settings(settings: Settings, *, zone: tzinfo | None = None) -> Rules:
    """The availability rules the settings describe, in `zone` (default: the configured or local one)."""
    if zone is None:
        zone = ZoneInfo(settings.serve_timezone) if settings.serve_timezone else local_zone()
    return Rules(windows=parse_windows(settings.serve_windows), zone=zone,
                 pause_when_active_s=settings.pause_when_active_s, pause_on_battery=settings.pause_on_battery,
                 pause_on_thermal=settings.pause_on_thermal)


__all__ = ["local_zone", "rules_from_settings", "zone_name"]
