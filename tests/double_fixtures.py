"""Fixtures for tests that drive the coordinator double: ``coordinator_double``, ``double_config`` and
``openai_consumer`` (conftest.py shares them with every test module), and the helpers beside them.

Override ``double_config`` in a module to shrink timers (``DoubleConfig(first_response_timeout=1, …)``).
``coordinator_double`` fails the test at teardown if the double itself raised (``double.errors``).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest
from openai import AsyncOpenAI

from coordinator_double import CoordinatorDouble, DoubleConfig


def quick_config(**overrides: float | int | str | bool) -> DoubleConfig:
    """[A] timers, except a short queue wait so a request nobody can serve fails within seconds."""
    settings: dict[str, float | int | str | bool] = {"queue_timeout": 5.0}
    settings.update(overrides)
    return DoubleConfig(**settings)  # type: ignore[arg-type]


def consumer_for(double: CoordinatorDouble, *, timeout: float = 60.0) -> AsyncOpenAI:
    """An OpenAI client on the double. No SDK retries: a 5xx from the double is the answer under test."""
    return AsyncOpenAI(base_url=double.http_url + "/v1", api_key="test", max_retries=0, timeout=timeout)


def sealed_request(provider_key: str, request_id: str, body: dict) -> str:
    """An [A]-shaped inference_request frame sealed to ``provider_key`` with a fresh session key."""
    from nacl.public import Box, PrivateKey

    from coordinator_double.dispatch import inference_request_frame
    from protocol.crypto import RequestBox, b64encode, parse_public_key

    session = PrivateKey.generate()
    box = RequestBox(Box(session, parse_public_key(provider_key)), b64encode(bytes(session.public_key)))
    return inference_request_frame(request_id, box, json.dumps(body).encode())


@pytest.fixture
def double_config() -> DoubleConfig:
    return quick_config()


@pytest.fixture
async def coordinator_double(double_config: DoubleConfig) -> AsyncIterator[CoordinatorDouble]:
    async with CoordinatorDouble(double_config) as double:
        yield double
        assert not double.errors, f"the coordinator double raised: {double.errors!r}"


@pytest.fixture
async def openai_consumer(coordinator_double: CoordinatorDouble) -> AsyncIterator[AsyncOpenAI]:
    client = consumer_for(coordinator_double)
    try:
        yield client
    finally:
        await client.close()
