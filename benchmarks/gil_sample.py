"""Which of a server's threads hold the GIL while its engine works: `py-spy dump` samples.

`GilSampler(pid)` runs `py-spy dump --nonblocking --json` on the process in a loop on a thread of
its own (one dump takes tens of milliseconds) between `start()` and `stop()`, and counts, over the
samples in which the engine thread (`mlx-engine`) was active, how often the engine thread held the
GIL, how often the event loop (`MainThread`) did, another thread did, or none did. "Active" is
py-spy's word for a thread that is running, not waiting in a known idle call; a thread inside MLX's
`eval` or `tolist` has released the GIL there, so a busy engine with "none" holding the GIL is an
engine waiting for its device. peer_bench (`--gil-cells`) samples our server during the cells named.

Needs py-spy on the PATH or beside the interpreter (`pip install py-spy`); without it every count is
zero and `error` says why. Nothing here reads what the server serves: py-spy reads thread states and
frame names only, and only the counts are kept.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path

ENGINE_THREAD = "mlx-engine"
LOOP_THREAD = "MainThread"


@dataclass
class GilCounts:
    samples: int = 0  # dumps that succeeded
    engine_active: int = 0  # of those, the engine thread was active
    engine_gil: int = 0  # ... and the engine thread held the GIL
    loop_gil: int = 0  # ... and the event loop held it
    other_gil: int = 0  # ... and another thread held it
    no_gil: int = 0  # ... and no thread did
    error: str | None = None
    extra: dict = field(default_factory=dict)

    def add(self, threads: list[dict]) -> None:
        self.samples += 1
        engine = next((t for t in threads if t.get("thread_name") == ENGINE_THREAD), None)
        if engine is None or not engine.get("active"):
            return
        self.engine_active += 1
        holder = next((t for t in threads if t.get("owns_gil")), None)
        if holder is None:
            self.no_gil += 1
        elif holder is engine:
            self.engine_gil += 1
        elif holder.get("thread_name") == LOOP_THREAD:
            self.loop_gil += 1
        else:
            self.other_gil += 1

    def shares(self) -> dict[str, float]:
        n = self.engine_active or 1
        return {"engine": self.engine_gil / n, "loop": self.loop_gil / n, "other": self.other_gil / n,
                "none": self.no_gil / n}

    def line(self) -> str:
        if not self.engine_active:
            return f"no sample with the engine active ({self.samples} samples{'; ' + self.error if self.error else ''})"
        s = self.shares()
        return (f"{self.engine_active} samples with the engine active (of {self.samples}): GIL held by the engine "
                f"{s['engine']:.1%}, the event loop {s['loop']:.1%}, another thread {s['other']:.1%}, none {s['none']:.1%}")

    def as_dict(self) -> dict:
        return {**asdict(self), "shares": self.shares()}


def py_spy() -> str | None:
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else shutil.which("py-spy")


class GilSampler:
    """Counts GIL holders of process `pid` from `start()` to `stop()` (see the module docstring)."""

    def __init__(self, pid: int, counts: GilCounts | None = None) -> None:
        self._pid = pid
        self.counts = counts or GilCounts()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="gil-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> GilCounts:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        return self.counts

    def _run(self) -> None:
        exe = py_spy()
        if exe is None:
            self.counts.error = "py-spy not found"
            return
        while not self._stop.is_set():
            done = subprocess.run([exe, "dump", "--nonblocking", "--json", "--pid", str(self._pid)],
                                  capture_output=True, text=True, check=False)
            if done.returncode != 0:
                self.counts.error = (done.stderr.strip().splitlines() or ["py-spy failed"])[0][:200]
                continue
            try:
                self.counts.add(json.loads(done.stdout))
            except (ValueError, TypeError):
                self.counts.error = "unreadable py-spy output"


__all__ = ["GilCounts", "GilSampler", "py_spy"]
