"""Downloading a model from the Hugging Face hub into its cache: `prefetch_model` and `pull ORG/NAME`.

`huggingface_hub.snapshot_download` does the transfer, into the standard cache layout (`models--org--name/{blobs,snapshots,refs}`) where
discovery finds it, from `HF_ENDPOINT` when set (read at each download). Resumable file by file: a
download that broke off keeps every file it completed and the next one fetches only the rest; within
a file the library continues from the byte it had on a transient error (huggingface_hub 2.x no longer
keeps a partial file across processes). Around it:

* the plan first (`plan_download`: the hub's dry run, one metadata request per file, nothing written):
  the commit, the files and how many bytes are still to come, so the disk budget is checked before the
  first byte (`DiskShort`): free space must hold what is missing plus `DISK_MARGIN_BYTES`;
* progress in bytes from the cache folder itself (completed blobs and `.incomplete` ones), polled by a
  thread: the same figure whatever transport or version of the hub library runs the transfer;
  `on_progress(done, total)` is called at most every `interval_s` (and once at the end);
* the download is pinned to the planned commit, so what was counted is what arrives.

Verification is the caller's: the weight hash (`provider/models/hashing.py`) of the snapshot folder.
Errors say what went wrong in a word (`DownloadFailed.reason`), never a server's or an exception's text;
`failure_sentence` says it to a person, with what to do.
"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from provider.units import GiB, gib

DISK_MARGIN_BYTES = GiB  # left free after a download: the cache is on the system disk
PROGRESS_INTERVAL_S = 0.25  # a few progress frames a second at most

Progress = Callable[[int, int], None]  # (bytes done, bytes total)


class DownloadFailed(Exception):
    """A download that did not happen or did not finish; `reason` is a closed word."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class DiskShort(DownloadFailed):
    def __init__(self, needed: int, free: int) -> None:
        super().__init__("disk_budget")
        self.needed, self.free = needed, free


@dataclass(frozen=True, slots=True)
class DownloadPlan:
    repo_id: str
    commit: str
    files: tuple[tuple[str, int], ...]  # (name in the repo, size)
    missing_bytes: int  # what is not in the cache yet

    @property
    def total_bytes(self) -> int:
        return sum(size for _, size in self.files)


def hub_endpoint() -> str | None:
    """`HF_ENDPOINT`, read now (the hub library reads it once, at import); None: the hub's default."""
    return os.environ.get("HF_ENDPOINT") or None


HUB_DEFAULT = "https://huggingface.co"


def failure_sentence(failed: DownloadFailed, repo_id: str, env: Mapping[str, str] | None = None) -> str:
    """What `pull` prints when a download fails: the reason in words and what to do about it."""
    env = os.environ if env is None else env
    endpoint = env.get("HF_ENDPOINT") or HUB_DEFAULT
    if isinstance(failed, DiskShort):
        return (f"{repo_id} needs {gib(failed.needed)} of disk (with a {gib(DISK_MARGIN_BYTES, 0)} "
                f"margin) and {gib(failed.free)} is free: make room, or set hf_cache_dir to a bigger disk")
    offline = env.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    if failed.reason == "hub_unreachable" and offline:
        return f"{repo_id} was not asked for: HF_HUB_OFFLINE is set in the environment; unset it to download"
    words = {
        "bad_model_id": f"{repo_id!r} is not a model id: the hub's are ORG/NAME (letters, digits, '-', '_', '.')",
        "not_found": f"{repo_id} was not found on {endpoint} (check the spelling; a private or gated model needs a "
                     "token: `hf auth login`, or HF_TOKEN)",
        "hub_unreachable": f"{endpoint} did not answer as a Hugging Face hub: check the network, or HF_ENDPOINT "
                           "for a mirror",
        "empty_repo": f"{repo_id} has no files on {endpoint}",
        "transfer_failed": f"the download of {repo_id} broke off: run the same command again, it fetches only the "
                           "files still missing",
    }
    return words.get(failed.reason, f"{repo_id} could not be downloaded ({failed.reason})")


def _silent_tqdm() -> type:
    """The hub library's bars off: progress is ours (`on_progress`), and an agent's stderr is its log."""
    from tqdm.auto import tqdm

    class Silent(tqdm):
        def __init__(self, *args, **kwargs) -> None:
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    return Silent


def repo_folder(cache_dir: Path, repo_id: str) -> Path:
    """The hub cache's folder of a model repo."""
    return Path(cache_dir) / ("models--" + repo_id.replace("/", "--"))


def valid_repo_id(repo_id: str) -> bool:
    """ORG/NAME, as the hub spells it (no path tricks: the id names a cache folder)."""
    parts = repo_id.split("/")
    return (len(parts) == 2 and all(parts) and len(repo_id) <= 96 and ".." not in repo_id
            and all(c.isalnum() or c in "-_." for c in repo_id.replace("/", "")))


def plan_download(repo_id: str, cache_dir: Path) -> DownloadPlan:
    """What a download of `repo_id` would fetch (blocking; the hub's dry run)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

    if not valid_repo_id(repo_id):
        raise DownloadFailed("bad_model_id")
    try:
        infos = snapshot_download(repo_id, cache_dir=str(cache_dir), dry_run=True, tqdm_class=_silent_tqdm(),
                                  endpoint=hub_endpoint())
    except (RepositoryNotFoundError, RevisionNotFoundError):
        raise DownloadFailed("not_found") from None
    except (HfHubHTTPError, OSError, ValueError) as exc:
        # The dry run wraps the hub's answer in its own error (DryRunError): a missing repo is its cause.
        if isinstance(exc.__cause__, RepositoryNotFoundError | RevisionNotFoundError):
            raise DownloadFailed("not_found") from None
        raise DownloadFailed("hub_unreachable") from None
    if not infos:
        raise DownloadFailed("empty_repo")
    commit = infos[0].commit_hash
    files = tuple((i.filename, int(i.file_size or 0)) for i in infos)
    missing = sum(int(i.file_size or 0) for i in infos if i.will_download)
    return DownloadPlan(repo_id, commit, files, missing)


def check_disk(plan: DownloadPlan, cache_dir: Path, margin_bytes: int = DISK_MARGIN_BYTES) -> None:
    """Raise `DiskShort` unless the cache's disk holds what is missing plus the margin."""
    folder = Path(cache_dir)
    folder.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(folder).free
    needed = plan.missing_bytes + margin_bytes
    if plan.missing_bytes and needed > free:
        raise DiskShort(needed, free)


def cached_bytes(cache_dir: Path, repo_id: str) -> int:
    """Bytes of the repo's blobs in the cache, complete or not."""
    blobs = repo_folder(cache_dir, repo_id) / "blobs"
    total = 0
    try:
        for entry in blobs.iterdir():
            try:
                total += entry.stat().st_size
            except OSError:
                pass  # renamed from .incomplete to its final name in between
    except OSError:
        return 0
    return total


def download(plan: DownloadPlan, cache_dir: Path, on_progress: Progress | None = None, *,
             interval_s: float = PROGRESS_INTERVAL_S) -> Path:
    """Fetch the planned commit into the cache (blocking); the snapshot folder. Raises `DownloadFailed`."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError

    total = plan.total_bytes
    already = cached_bytes(cache_dir, plan.repo_id) if on_progress is not None else 0
    base = max(0, total - plan.missing_bytes - already)  # cached files that share blobs with other commits
    stop = threading.Event()

    def poll() -> None:
        last = -1
        while not stop.wait(interval_s):
            # A blob renamed from .incomplete between listing and stat is missed for one poll: never report
            # less than before.
            done = min(total, base + cached_bytes(cache_dir, plan.repo_id))
            if done > last:
                on_progress(done, total)
                last = done

    watcher = threading.Thread(target=poll, name="download-progress", daemon=True) if on_progress else None
    if watcher is not None:
        watcher.start()
    try:
        folder = snapshot_download(plan.repo_id, revision=plan.commit, cache_dir=str(cache_dir),
                                   tqdm_class=_silent_tqdm(), endpoint=hub_endpoint())
    except (HfHubHTTPError, OSError, ValueError):
        raise DownloadFailed("transfer_failed") from None
    finally:
        stop.set()
        if watcher is not None:
            watcher.join()
    if on_progress is not None:
        on_progress(total, total)
    return Path(folder)


__all__ = [
    "DISK_MARGIN_BYTES",
    "PROGRESS_INTERVAL_S",
    "DiskShort",
    "DownloadFailed",
    "DownloadPlan",
    "cached_bytes",
    "check_disk",
    "download",
    "failure_sentence",
    "plan_download",
    "repo_folder",
    "valid_repo_id",
]
