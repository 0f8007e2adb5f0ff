"""The copied golden vectors (see README.md here): one loader, so every test reads the same files and
nothing reads outside the repository."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

DIR = Path(__file__).resolve().parent


def load(name: str) -> Any:
    """A vector file of this folder, parsed. A missing file fails loudly (never a skip)."""
    path = DIR / name
    if not path.is_file():
        raise FileNotFoundError(f"golden vector {name} is missing from {DIR}")
    return json.loads(path.read_text(encoding="utf-8"))
