"""Watching the engine prepare a conversation's next turn while it is idle."""

from __future__ import annotations

import asyncio
import threading


class NextTurnTrace:
    """The engine's trace hook: counts preparation steps and signals each stored preparation."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.stored: asyncio.Queue[str] = asyncio.Queue()
        self.steps = 0
        self.hold: tuple[threading.Event, threading.Event] | None = None  # (reached, release)

    def __call__(self, model_id: str, request_id: str | None, phase: str) -> None:
        if phase == "next_turn":
            self.steps += 1
            if self.hold is not None:
                reached, release = self.hold
                reached.set()
                release.wait(30)
        elif phase.startswith("next_turn_"):
            self.loop.call_soon_threadsafe(self.stored.put_nowait, phase.removeprefix("next_turn_"))
