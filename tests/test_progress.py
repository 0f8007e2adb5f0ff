"""Long operations draw a progress line on a terminal, and nothing anywhere else."""

from __future__ import annotations

import io

from provider.models import weight_hash_sync
from provider.progress import Progress, terminal_progress
from provider.runtime import WeightHashes
from test_slots_manager import serve_once  # noqa: F401  (re-exported fixture helpers below)
from test_slots_manager import rigs  # noqa: F401


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_no_progress_where_stderr_is_not_a_terminal():
    assert terminal_progress(io.StringIO()) is None
    quiet = io.StringIO()
    with Progress("hashing x", quiet) as bar:
        bar.update(5, 10)
    assert quiet.getvalue() == ""


def test_progress_line_is_redrawn_in_place_and_ends_at_100_percent():
    tty = FakeTerminal()
    with Progress("hashing x", tty, min_interval_s=0.0) as bar:
        bar.update(1, 4)
        bar.update(4, 4)
    out = tty.getvalue()
    assert out.startswith("\rhashing x [") and out.count("\r") == 2
    assert " 25%" in out and "100%" in out and out.endswith("\n")


async def test_weight_hashing_reports_progress_and_gives_the_same_hash(tiny_model_path):
    tty = FakeTerminal()
    hashes = WeightHashes({"tiny": tiny_model_path}, progress=lambda label: Progress(label, tty, 0.0))
    assert await hashes.get("tiny") == weight_hash_sync(tiny_model_path)
    assert "hashing tiny [" in tty.getvalue() and "100%" in tty.getvalue()


async def test_a_model_load_reports_progress_on_a_terminal(rigs, tiny_model_path):  # noqa: F811
    make, _ = rigs
    tty = FakeTerminal()
    rig = make({"tiny": tiny_model_path}, 100 * 10**6, progress=lambda label: Progress(label, tty, 0.0))
    await serve_once(rig.manager, "r1", "tiny")
    out = tty.getvalue()
    assert "loading tiny [" in out and out.rstrip().endswith("100%")
