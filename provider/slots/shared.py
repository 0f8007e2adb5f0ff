"""What the model manager and its parts share: the models' records and what they act through.

`ModelManager` (admission, booking, serving) builds one `ManagerState` and hands it to each of its
collaborators, which keep no other copy of it: `Loader` (loading.py), `Unloader` (unloading.py),
`Reporter` (reporting.py) and `VisionServer` (vision.py). Everything here runs on the event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from memory import CapFigures, Ledger, Probe
from provider.engine import Engine
from provider.metrics import Metrics
from provider.models.activation import ActivationStore
from provider.slots.broken import BrokenModels
from provider.slots.prefix import PrefixRoom
from provider.slots.state import ModelSlot, ModelState


@dataclass(eq=False, slots=True)
class ManagerState:
    engine: Engine
    ledger: Ledger
    probe: Probe
    prefix: PrefixRoom
    clock: Callable[[], float]
    metrics: Metrics | None
    slots: dict[str, ModelSlot]  # one record per inventory model (forget / adopt change the set)
    room_lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one room plan (evict, settle) at a time
    draining: bool = False  # every new request and load is refused
    activation_store: ActivationStore | None = None  # what loads measured, kept for the next start and doctor
    broken: BrokenModels = field(init=False)  # models whose failed load is remembered (slots/broken.py)

    def __post_init__(self) -> None:
        self.broken = BrokenModels(self.clock)

    @property
    def figures(self) -> CapFigures:
        return self.ledger.figures

    def sync_activation_reserve(self) -> None:
        """The reserve in force is the largest of the models that can run a pass (loading or loaded; one
        engine thread runs one at a time), each its own (memory/activation.py), unless the operator set one."""
        reserves = [s.info.activation_reserve_bytes for s in self.slots.values()
                    if s.state in (ModelState.LOADING, ModelState.LOADED)]
        self.ledger.replace_figures(self.ledger.figures.for_models(reserves))

    def leaving(self) -> list[asyncio.Task]:
        """The unloads under way (their models' memory is leaving)."""
        return [s.unload_task for s in self.slots.values()
                if s.state is ModelState.UNLOADING and s.unload_task is not None]

