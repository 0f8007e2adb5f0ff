"""A protocol-faithful [A] coordinator double for end-to-end tests (never shipped). See ``server.py``.

    async with CoordinatorDouble(DoubleConfig(first_response_timeout=2)) as double:
        ...  # start the provider against double.ws_url
        await double.wait_routable(1, model="m", timeout=30)
        client = AsyncOpenAI(base_url=double.http_url + "/v1", api_key="test", max_retries=0)
        mark = double.mark()
        ...
        sent = await double.wait_for(lambda e: isinstance(e, CancelSent), since=mark, timeout=5)
        assert double.anomalies() == []

Injection: ``send_raw(provider, text_or_bytes)``, ``send_challenge(provider)``, ``evict_stale()``, and the
hostile mode: ``send_hostile(provider, hostile_cases(seed, count=…, provider_key=…))`` (``hostile.py``);
lifecycle: ``kill()`` (abrupt) and ``restart()`` (same ports). Records and enums: ``events.py``.
"""

from . import events as _events
from .config import DoubleConfig
from .consumer_api import ATTESTED_HEADER, JOB_HEADER, TRUST_LEVEL_HEADER
from .events import *  # noqa: F403 - the record and enum types are the double's vocabulary
from .routing import ProviderView, Unroutable
from .server import WS_PATH, CoordinatorDouble, chunk_fault

__all__ = [
    "ATTESTED_HEADER",
    "JOB_HEADER",
    "TRUST_LEVEL_HEADER",
    "WS_PATH",
    "CoordinatorDouble",
    "DoubleConfig",
    "ProviderView",
    "Unroutable",
    "chunk_fault",
    *_events.__all__,
]
