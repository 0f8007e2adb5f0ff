"""Coordinator-directed models, as the [N] coordinator does them (Layr-Labs/d-inference
docs/reference/protocol-messages.md, coordinator/api/provider.go): the double sends ``load_model``,
``prefetch_model`` and ``desired_models`` when a test asks, and accepts the provider's answers,
``load_model_status``, ``prefetch_model_status`` and ``models_update``, which [A] would drop as unknown.

What [N] does with the answers and the double copies: the status frames are observability only (logged,
counted; a status outside the closed set is invalid); ``models_update`` is the provider's authoritative
inventory and replaces what it advertises (``MergeProviderModels``: new ids merged, missing ids dropped),
without a re-register and without resetting trust. Not copied: [N]'s cross-check of each
``weight_hash`` against its catalog (the double's catalog has no hashes) and its version gate (it sends
these only to ``backend == "mlx-swift"`` of a recent enough version; a test sends them on purpose).
"""

from __future__ import annotations

from protocol import DesiredModels, LoadModel, LoadModelStatus, ModelsUpdate, PrefetchModel, PrefetchModelStatus
from protocol.to_provider import DesiredModel

from . import events as ev
from .routing import ProviderSession

MODEL_REPLY_TYPES = (LoadModelStatus, PrefetchModelStatus, ModelsUpdate)
"""The [N] provider frames about models that the double accepts besides [A]'s seven."""


def on_model_reply(session: ProviderSession, message: LoadModelStatus | PrefetchModelStatus | ModelsUpdate,
                   events: ev.EventLog) -> None:
    """Record the answer; a ``models_update`` replaces the advertised models."""
    if isinstance(message, ModelsUpdate):
        if session.register is not None:
            before = set(session.models)
            session.register = session.register.model_copy(update={"models": message.models})
            after = set(session.models)
            events.append(ev.ModelsUpdated(session.provider_id, tuple(sorted(after - before)),
                                           tuple(sorted(before - after))))
        return
    events.append(ev.ModelStatus(session.provider_id, message.type, message.model_id, message.status.value,
                                 message.error, getattr(message, "bytes_done", 0), getattr(message, "bytes_total", 0)))


def load_model(model_id: str) -> LoadModel:
    return LoadModel(model_id=model_id)


def prefetch_model(model_id: str, priority: int = 0) -> PrefetchModel:
    return PrefetchModel(model_id=model_id, priority=priority)


def desired_models(builds: dict[str, str], previous: dict[str, str] | None = None) -> DesiredModels:
    """``{public name: build}``; ``previous`` names the build each name ran before, where it changed."""
    previous = previous or {}
    return DesiredModels(models=tuple(DesiredModel(model_name=name, desired_build=build,
                                                   previous_build=previous.get(name, ""))
                                      for name, build in builds.items()))
