"""The settings most tests of the serving core start from."""

from __future__ import annotations

from pathlib import Path

from provider.config import Settings

CLOSED_COORDINATOR = "ws://127.0.0.1:1/ws/provider"  # nothing listens there


def settings_for(tmp_path: Path, models: dict[str, Path], **overrides: object) -> Settings:
    """Settings for `models` (id -> folder) on an emulated 8 GB machine (0.5 GB reserve): the state in
    `tmp_path / "state"`, an empty hub cache beside it, no idle unload, a coordinator nothing listens on;
    `overrides` on top."""
    hub = tmp_path / "hf"
    hub.mkdir(parents=True, exist_ok=True)
    return Settings(**{"coordinator_url": CLOSED_COORDINATOR, "state_dir": tmp_path / "state", "hf_cache_dir": hub,
                       "model_aliases": models, "memory_limit_gb": 8.0, "memory_reserve_gb": 0.5,
                       "idle_timeout_mins": 0, **overrides})
