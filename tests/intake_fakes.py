"""What provider.request's intake asks of the rest of the agent, without an engine: a ledger on a
machine of a given size, and a model manager that admits everything."""

from __future__ import annotations

from memory import GiB, Ledger, compute_figures
from memory.snapshot import MemorySnapshot


def snapshot(physical: int) -> MemorySnapshot:
    return MemorySnapshot(physical_bytes=physical, available_bytes=physical)


class Manager:
    """The three questions the intake asks of the model manager."""

    def __init__(self, context: int = 2048) -> None:
        self.context = context

    def model_refusal(self, model_id):
        return None

    def precheck(self, model_id, prompt_tokens, max_tokens=None, *, queued=False):
        return None

    def context_length(self, model_id):
        return self.context


def ledger_of(physical_gib: float) -> Ledger:
    physical = int(physical_gib * GiB)
    return Ledger(compute_figures(physical), sample=lambda: snapshot(physical))
