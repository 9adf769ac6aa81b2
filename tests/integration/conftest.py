"""Fixtures shared by the integration modules that run services of their own (tests/integration/apihelpers.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import httpx
import pytest

from tests.integration.apihelpers import Services, private_bus


@pytest.fixture(scope="module")
def bus_env(stack_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A NATS server of the module's own beside the session's PostgreSQL and S3: its limit counters start at zero,
    and no other test's auth (with other limits) answers in its queue group."""
    with private_bus(stack_env, tmp_path_factory.mktemp("nats")) as env:
        yield env


@pytest.fixture
async def http(services: Services) -> AsyncIterator[httpx.AsyncClient]:
    """A client of the module's own api (its `services` fixture)."""
    async with httpx.AsyncClient(base_url=services.api_url, timeout=30) as client:
        yield client
