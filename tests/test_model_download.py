"""Downloads from a loopback hub (tests/hub_double.py; HF_ENDPOINT points at it, never the internet):
the plan and disk budget before the first byte, progress in bytes, a broken-off download taken up, and
`darkbloom-provider pull ORG/NAME` with its progress bar on a terminal."""

from __future__ import annotations

import os
import pty
import subprocess
import sys
from collections import Counter

import pytest

from hub_double import COMMIT, HubDouble
from provider.models.download import (
    DiskShort,
    DownloadFailed,
    cached_bytes,
    check_disk,
    download,
    plan_download,
    repo_folder,
)
from provider.models.hashing import weight_hash_sync


def test_plan_download_progress_and_the_same_weight_hash(hub, tmp_path, tiny_model_path):
    plan = plan_download("org/tiny", tmp_path)
    sizes = {p.name: p.stat().st_size for p in tiny_model_path.iterdir() if p.is_file()}
    assert plan.commit == COMMIT and dict(plan.files) == sizes and plan.missing_bytes == sum(sizes.values())
    assert cached_bytes(tmp_path, "org/tiny") == 0  # the plan wrote nothing
    seen: list[tuple[int, int]] = []
    folder = download(plan, tmp_path, lambda done, total: seen.append((done, total)), interval_s=0.005)
    assert folder.parent.parent == repo_folder(tmp_path, "org/tiny") and folder.name == COMMIT
    assert weight_hash_sync(folder) == weight_hash_sync(tiny_model_path)
    assert seen[-1] == (plan.total_bytes, plan.total_bytes)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)  # never backwards
    assert plan_download("org/tiny", tmp_path).missing_bytes == 0


def test_an_interrupted_download_fetches_only_what_it_lacks(hub, tmp_path):
    """huggingface_hub 2.x resumes a file only within one transfer (its retries); a download that broke
    off keeps every file it completed, and the next one fetches only the rest. Which files completed is
    read from the cache (the snapshot's entries): the failure cancels the transfers not yet started."""
    plan = plan_download("org/tiny", tmp_path)
    hub.withheld.add("model.safetensors")
    with pytest.raises(DownloadFailed):
        download(plan, tmp_path)
    completed = {p.name for p in (repo_folder(tmp_path, "org/tiny") / "snapshots" / plan.commit).iterdir()}
    assert completed and "model.safetensors" not in completed  # the others that started arrived
    before = Counter(hub.gets)
    hub.withheld.clear()
    folder = download(plan, tmp_path)
    assert (folder / "model.safetensors").read_bytes() == hub._files["org/tiny"]["model.safetensors"]
    assert hub.gets - before == Counter(name for name, _ in plan.files if name not in completed)


def test_the_disk_budget_is_checked_before_the_first_byte(hub, tmp_path, monkeypatch):
    plan = plan_download("org/tiny", tmp_path)
    import shutil
    monkeypatch.setattr(shutil, "disk_usage", lambda _: shutil._ntuple_diskusage(1 << 40, 1 << 40, 1 << 20))
    with pytest.raises(DiskShort):
        check_disk(plan, tmp_path)
    assert cached_bytes(tmp_path, "org/tiny") == 0


def test_a_bad_repo_id_is_refused_before_asking(tmp_path):
    with pytest.raises(DownloadFailed) as failed:
        plan_download("../etc", tmp_path)
    assert failed.value.reason == "bad_model_id"


def test_pull_on_a_terminal_draws_a_bar_and_prints_the_weight_hash(tiny_model_path, tmp_path):
    with HubDouble({"org/tiny": tiny_model_path}) as hub:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("DARKBLOOM_", "HF_"))}
        env.update(HOME=str(tmp_path), HF_ENDPOINT=hub.url, HF_HUB_OFFLINE="0")
        leader, follower = pty.openpty()
        proc = subprocess.Popen([sys.executable, "-m", "provider.cli", "pull", "org/tiny",
                                 "--hf-cache-dir", str(tmp_path / "hub")],
                                env=env, stdin=follower, stdout=subprocess.PIPE, stderr=follower)
        os.close(follower)
        out, _ = proc.communicate(timeout=120)
        screen = b""
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:
                break
            if not chunk:
                break
            screen += chunk
        os.close(leader)
    assert proc.returncode == 0, screen
    assert b"pulling org/tiny" in screen and b"100%" in screen
    lines = out.decode().splitlines()
    assert lines[0].startswith("org/tiny 0123456789ab: 7 files")
    assert lines[1] == f"weight hash {weight_hash_sync(tiny_model_path)}"
