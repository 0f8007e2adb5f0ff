"""A protocol-faithful coordinator double for end-to-end tests (never shipped). See ``server.py``."""

from . import events as _events
from .config import DoubleConfig
from .consumer_api import JOB_HEADER
from .events import *  # noqa: F403 - the record and enum types are the double's vocabulary
from .routing import ProviderView, Unroutable
from .server import WS_PATH, CoordinatorDouble, chunk_fault

__all__ = [
    "JOB_HEADER",
    "WS_PATH",
    "CoordinatorDouble",
    "DoubleConfig",
    "ProviderView",
    "Unroutable",
    "chunk_fault",
    *_events.__all__,
]
