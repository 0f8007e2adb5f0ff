"""Small helpers for what the agent shows people: byte sizes, GiB, aligned tables.

The standard library only, on purpose: the CLI's `--help` and `--version` load this module. `GiB` is
`memory.GiB` too (memory/ imports nothing of provider/, so it keeps its own; a test checks they agree).

* `human_bytes(n)`: a size in the largest unit it reaches ("1.5 GiB", "12.0 MiB", "3 B");
* `gib(n)`: a size in GiB whatever it is ("0.3 GiB"), for figures read beside the coordinator's own,
  which are GiB;
* `table(rows)`: rows of cells as aligned lines.
"""

from __future__ import annotations

from collections.abc import Sequence

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30


def human_bytes(n: int | None) -> str:
    """`n` bytes in the largest binary unit it reaches, one decimal ("1.5 GiB"); "-" for None."""
    if n is None:
        return "-"
    if n < 0:
        return "-" + human_bytes(-n)
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def gib(nbytes: float, digits: int = 1) -> str:
    """`nbytes` in GiB whatever its size, with `digits` decimals: "12.0 GiB"."""
    return f"{nbytes / GiB:.{digits}f} GiB"


def table(rows: Sequence[Sequence[str]], indent: str = "") -> list[str]:
    """One line per row: each column as wide as its widest cell, two spaces between columns, no
    trailing blanks. Every row has the same number of cells."""
    if not rows:
        return []
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]


__all__ = ["GiB", "KiB", "MiB", "gib", "human_bytes", "table"]
