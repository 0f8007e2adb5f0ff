"""provider/engine: one MLX worker thread, an mlx-lm BatchGenerator per loaded model, async streams.

Public names are re-exported here; see `engine.py` for the usage sketch.
"""

from provider.engine.commands import ReleaseHook
from provider.engine.engine import Engine, RequestStream
from provider.engine.options import EngineOptions
from provider.engine.types import (
    Calibrated,
    ChatRequest,
    EngineError,
    EngineFailure,
    Event,
    Failed,
    Finished,
    FinishReason,
    LoadedModelInfo,
    LoadPhase,
    ModelStats,
    SamplingParams,
    TextDelta,
    TokenLogprob,
    ToolCallConstraint,
    Usage,
)

__all__ = [
    "Calibrated",
    "ChatRequest",
    "Engine",
    "EngineError",
    "EngineFailure",
    "EngineOptions",
    "Event",
    "Failed",
    "Finished",
    "FinishReason",
    "LoadedModelInfo",
    "LoadPhase",
    "ModelStats",
    "ReleaseHook",
    "RequestStream",
    "SamplingParams",
    "TextDelta",
    "TokenLogprob",
    "ToolCallConstraint",
    "Usage",
]
