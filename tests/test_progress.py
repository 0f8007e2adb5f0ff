"""Long operations draw a progress line on a terminal, and nothing anywhere else."""

from __future__ import annotations

import io

from clock import Clock
from manager_rigs import serve_once
from provider.models import weight_hash_sync
from provider.progress import Progress, terminal_progress
from provider.runtime import WeightHashes


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


async def test_a_model_load_reports_progress_on_a_terminal(rigs, tiny_model_path):
    make, _ = rigs
    tty = FakeTerminal()
    rig = make({"tiny": tiny_model_path}, 100 * 10**6, progress=lambda label: Progress(label, tty, 0.0))
    await serve_once(rig.manager, "r1", "tiny")
    out = tty.getvalue()
    assert "loading tiny [" in out and out.rstrip().endswith("100%")


# --- not on a terminal: log events


class Events:
    """A structlog-shaped logger that keeps what it was told."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, dict]] = []

    def info(self, event: str, **fields) -> None:
        self.seen.append((event, fields))


def test_default_progress_is_a_line_on_a_terminal_and_log_events_elsewhere():
    from provider.progress import LogProgress, default_progress

    assert isinstance(default_progress(FakeTerminal())("hashing x"), Progress)
    assert default_progress(io.StringIO()) is LogProgress


def test_log_progress_reports_every_interval_and_once_at_the_end():
    from provider.progress import LogProgress

    clock, events = Clock(100.0), Events()
    with LogProgress("hashing org/model", interval_s=5.0, clock=clock, logger=events) as bar:
        bar.update(10, 100)  # 0 s in: too soon
        clock.now += 5.0
        bar.update(40, 100)
        clock.now += 1.0
        bar.update(60, 100)  # 1 s after the last event: too soon
        clock.now += 5.0
        bar.update(100, 100)  # the end is logged by close, once
    assert [e for e, _ in events.seen] == ["progress", "progress_done"]
    (_, during), (_, end) = events.seen
    assert during == {"phase": "hashing", "model": "org/model", "done_bytes": 40, "total_bytes": 100,
                      "done_pct": 40.0, "elapsed_s": 5.0}
    assert (end["done_bytes"], end["done_pct"], end["elapsed_s"]) == (100, 100.0, 11.0)


async def test_hashing_under_a_service_logs_events_and_persists_its_cache(tiny_model_path, tmp_path):
    from provider.models import DigestCache
    from provider.models.hashing import hashed_files
    from provider.progress import LogProgress

    events = Events()
    cache_file = tmp_path / "state" / "weight-hashes.json"
    hashes = WeightHashes({"tiny": tiny_model_path}, cache=DigestCache.open(cache_file),
                          progress=lambda label: LogProgress(label, interval_s=0.0, logger=events))
    assert await hashes.get("tiny") == weight_hash_sync(tiny_model_path)
    names = [e for e, _ in events.seen]
    assert names[-1] == "progress_done" and names.count("progress_done") == 1
    assert all(f["phase"] == "hashing" and f["model"] == "tiny" for _, f in events.seen)
    assert len(DigestCache.open(cache_file)) == len(hashed_files(tiny_model_path))  # a restart reads none
