"""provider.units: the one way sizes are shown, GiB, aligned tables."""

from __future__ import annotations

import memory
from provider.units import GiB, KiB, MiB, gib, human_bytes, table


def test_gib_is_the_memory_policys() -> None:
    assert GiB == memory.GiB == 1024 * MiB == 1024 * 1024 * KiB


def test_human_bytes_takes_the_largest_unit_reached() -> None:
    assert [human_bytes(n) for n in (None, 0, 1023, KiB, 3 * MiB // 2, 12 * GiB, -2 * GiB)] == \
        ["-", "0 B", "1023 B", "1.0 KiB", "1.5 MiB", "12.0 GiB", "-2.0 GiB"]


def test_gib_is_always_gib() -> None:
    assert gib(3 * GiB // 10) == "0.3 GiB" and gib(GiB, 0) == "1 GiB" and gib(5 * GiB // 4, 2) == "1.25 GiB"


def test_table_aligns_columns_and_leaves_no_trailing_blanks() -> None:
    assert table([("id", "size", "x"), ("longer", "1", "")], "  ") == ["  id      size  x", "  longer  1"]
    assert table([]) == []
