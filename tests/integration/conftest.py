"""Fixtures shared by the integration modules that run services of their own (tests/integration/apihelpers.py),
and by those that run an encoding farm (tests/integration/test_encode_helpers.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from nats.aio.client import Client as NATS

from shared.settings import CommonSettings
from tests.integration.apihelpers import Services, private_bus
from tests.integration.test_encode_helpers import (
    Events,
    Procs,
    clean_encode_state,
    listening,
    prepare_encode_consumers,
    processes,
)


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


@pytest.fixture
async def farm(stack_env: dict[str, str], prepared: CommonSettings, tmp_path: Path) -> AsyncIterator[Procs]:
    """encode and media processes a test starts (`farm.start(...)`), on the session's servers: encode's durables
    start at the end of their streams, and no worker of an earlier test is left in encode's table."""
    await prepare_encode_consumers(prepared)
    await clean_encode_state(prepared)
    with processes(stack_env, tmp_path) as procs:
        yield procs
    await clean_encode_state(prepared)


@pytest.fixture
async def events(nc: NATS) -> AsyncIterator[Events]:
    """Every event on the bus from now on, by video (tests/integration/test_encode_helpers.py `listening`)."""
    async with listening(nc) as ev:
        yield ev
