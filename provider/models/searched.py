"""Saying where discovery looked for models.

`discover()` records each place it searched (`Inventory.searched`, `SearchedPlace`): every alias
path, every `model_dirs` entry, the imported models, Ollama's store, the Hugging Face cache, each with
whether a directory is there.
`models`, `doctor` and the start of `serve` / `serve --local` name them when nothing was found, so an
operator with no model sees where the provider looked instead of a silent 404. These are the words.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from typing import TextIO

from provider.models.discovery import Inventory, SearchedPlace
from provider.units import table

README_MODELS_HEADING = "Pointing the provider at real MLX models"  # a heading of README.md (a test checks)
# The project's own download first (the disk is checked, the weights hashed); the hub's CLI puts the
# same files in the same cache.
PULL_HINT = "`darkbloom-provider pull mlx-community/<model>` (or the hub's `hf download mlx-community/<model>`)"


def place_lines(places: Iterable[SearchedPlace], indent: str = "  ") -> list[str]:
    """One aligned line per place: "Hugging Face cache  /path  (exists)"."""
    return table([(p.label, str(p.path), f"({p.state})") for p in places], indent)


def places_text(places: Iterable[SearchedPlace]) -> str:
    """The places on one line: "Hugging Face cache /path (exists); model_dirs /x (missing)"."""
    return "; ".join(p.words for p in places) or "nowhere (no source configured)"


def no_models_lines(places: Sequence[SearchedPlace], disabled: Sequence[str] = (), *, consequence: str = "") -> list[str]:
    """Where the provider looked when it found no model, and what to do."""
    lines = [f"no models found{consequence}. Looked in:", *(place_lines(places) or ["  nowhere (no source configured)"])]
    if disabled:
        lines.append(f"  found, but not in enabled_models: {', '.join(disabled)}")
    lines.append(f"Download one: {PULL_HINT}; import a GGUF: `darkbloom-provider import FILE.gguf` (or a model "
                 f"pulled with Ollama: `ollama:NAME`); or set model_dirs / model_aliases: '{README_MODELS_HEADING}' "
                 "in the README.")
    return lines


def no_models_text(places: Sequence[SearchedPlace], disabled: Sequence[str] = ()) -> str:
    """What `serve --local` prints on stderr when it starts with no model."""
    return "\n".join(no_models_lines(places, disabled, consequence=": every request will get 404 until there is one"))


def say_if_no_models(inventory: Inventory, stream: TextIO | None = None) -> None:
    """`serve --local`: with no model, tell the owner on stderr, in words, where it looked."""
    if not inventory.models:
        print(no_models_text(inventory.searched, inventory.disabled), file=stream or sys.stderr, flush=True)
