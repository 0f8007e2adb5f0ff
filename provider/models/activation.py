"""A model's activation reserve where no load of it runs now: its config's estimate, or what a load measured.

The reserve itself is memory/activation.py's arithmetic, and the config's fields it needs are read with
the rest of the config (`metadata.model_shape`). Here: the estimate for a model never loaded here (`estimate_for`), and the measurements the
agent's loads keep in the state dir (`ActivationStore`), each under the model's id and the identity of
its weight files (path, sizes, modification times) and the form its KV is kept in, so a changed or
replaced model is estimated again until its next load. `with_activation` gives an inventory's models the figure each has: a measurement
kept for the same weights, else the estimate, else none (a vision model, whose vision tower's passes the
load does not measure, and a config without the shape: the fixed reserve).
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from memory.activation import ActivationProfile, ReserveSource, estimated_profile
from memory.policy import CapFigures
from provider.models.discovery import Inventory, ModelInfo
from provider.telemetry import get_logger

log = get_logger("provider.models")


def estimate_for(info: ModelInfo, *, window_tokens: int, batch_rows: int) -> ActivationProfile | None:
    """The config's estimate for a text model (memory/activation.py); None for a vision model or a config
    without the shape (the fixed reserve then stands)."""
    if info.is_vision or info.shape is None:
        return None
    return estimated_profile(info.shape, window_tokens=window_tokens, batch_rows=batch_rows)


def _identity(info: ModelInfo) -> dict[str, Any] | None:
    """What must not change for a measurement to stand: the folder, each weight file's size and mtime, and
    the form its KV is kept in (quantized KV adds a dequantized block to each attention)."""
    files = info.weight_files or ((info.gguf,) if info.gguf is not None else ())
    try:
        stats = [(p.name, p.stat()) for p in files]
    except OSError:
        return None
    return {"path": str(info.path), "files": [[name, st.st_size, st.st_mtime_ns] for name, st in stats],
            "kv_bits": None if info.kv_bits is None else info.kv_bits.as_json()}


class ActivationStore:
    """The measurements of earlier loads, one JSON file in the state dir. Reads never raise (a damaged or
    missing file is nothing stored); a write that fails is logged and changes nothing."""

    FILE = "activation.json"

    def __init__(self, state_dir: Path) -> None:
        self.path = Path(state_dir) / self.FILE

    def get(self, info: ModelInfo) -> ActivationProfile | None:
        """The profile a load measured for these same weights, as STORED; None if there is none."""
        entry = self._read().get(info.id)
        if not isinstance(entry, dict) or entry.get("identity") != _identity(info):
            return None
        profile = entry.get("profile")
        return ActivationProfile.from_json(profile, source=ReserveSource.STORED) if isinstance(profile, dict) else None

    def put(self, info: ModelInfo, profile: ActivationProfile) -> None:
        """Keep what a load measured for the model's weights as they are now (atomically replaced)."""
        identity = _identity(info)
        if identity is None:
            return
        entries = self._read()
        entries[info.id] = {"identity": identity, "profile": profile.as_json()}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".activation-", suffix=".json")
            with os.fdopen(fd, "w") as f:
                json.dump(entries, f, indent=1, sort_keys=True)
            os.replace(tmp, self.path)
        except OSError as exc:
            log.warning("activation_store_write_failed", model=info.id, error=type(exc).__name__)

    def _read(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            return {}
        return data if isinstance(data, dict) else {}


def reserve_json(info: ModelInfo, figures: CapFigures) -> dict[str, Any]:
    """The model's activation reserve as /status and doctor show it: its bytes, where they come from, the
    window they are for and, when a load measured them, the largest of its passes."""
    profile = info.activation
    if figures.activation_reserve_set:
        nbytes, source = figures.activation_reserve_bytes, ReserveSource.SETTING
    elif profile is None:
        nbytes, source = info.activation_reserve_bytes, ReserveSource.DEFAULT
    else:
        nbytes, source = info.activation_reserve_bytes, profile.source
    measured = profile is not None and profile.source in (ReserveSource.MEASURED, ReserveSource.STORED)
    return {"bytes": nbytes, "source": source.value,
            "window_tokens": profile.window_tokens if profile is not None else None,
            "measured_peak_bytes": profile.peak_bytes if measured else None,
            "measured_peak_tokens": profile.peak_tokens if measured else None}


def with_activation(inventory: Inventory, *, window_tokens: int, batch_rows: int,
                    store: ActivationStore | None) -> Inventory:
    """The inventory's models, each with the reserve figures it has before any load in this process."""
    models = []
    for m in inventory.models:
        stored = store.get(m) if store is not None and not m.is_vision else None
        profile = stored or estimate_for(m, window_tokens=window_tokens, batch_rows=batch_rows)
        models.append(dataclasses.replace(m, activation=profile))
    return dataclasses.replace(inventory, models=tuple(models))


__all__ = ["ActivationStore", "estimate_for", "reserve_json", "with_activation"]
