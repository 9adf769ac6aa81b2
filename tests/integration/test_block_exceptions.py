"""The auth_failure block's exception for recently accepted keys, on every instance (SPEC 3), in-process instances on
the session's real NATS and PostgreSQL: the instance that accepted a key learns of a block set elsewhere (through
auth.spent) and records its keys, so an instance started after the block lets that key through too."""

from __future__ import annotations

import asyncio

import asyncpg
import pytest
from nats.aio.client import Client as NATS

from services.auth import store
from shared.settings import CommonSettings
from tests.integration.authhelpers import auth_instances, checker, fresh_address, new_app, request

pytestmark = pytest.mark.asyncio(loop_scope="session")
FAILURES = 3


async def recorded(pool: asyncpg.Pool, address: str, key_id: str, deadline_s: float = 10.0) -> bool:
    """Wait until the shared record holds the pair (written in the background), or the deadline passes."""
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline_s
    while loop.time() < end:
        async with pool.acquire() as conn:
            if (address, key_id) in await store.recent_keys(conn, [(address, key_id)]):
                return True
        await asyncio.sleep(0.02)
    return False


async def test_a_block_set_elsewhere_makes_the_accepting_instance_share_its_keys(
    prepared: CommonSettings, nc: NATS
) -> None:
    limits = {"limit_auth_failure_per_minute": FAILURES}
    async with auth_instances(prepared, n=2, **limits) as (accepting, blocking):
        demo = await new_app(nc)
        address = fresh_address()
        assert (await checker(accepting).check(request(demo.app.secret_key, peer=address))).allowed
        pool = checker(accepting).pool
        # accepting a key writes nothing: only a blocked address needs the shared record
        assert not await recorded(pool, address, demo.app.secret_key_id, deadline_s=0.3)
        guesses = [await checker(blocking).check(request("wsk_" + "q" * 32, peer=address))
                   for _ in range(FAILURES + 1)]
        assert [g.status for g in guesses] == [401] * FAILURES + [429]
        # the accepting instance hears of the block (auth.spent) and records the key it let in from there
        assert await recorded(pool, address, demo.app.secret_key_id)
        async with auth_instances(prepared, **limits) as (later,):
            assert (await checker(later).check(request(demo.app.secret_key, peer=address))).allowed
            refused = await checker(later).check(request(None, peer=address, route_class="public"))
            assert refused.status == 429 and refused.problem is not None
            assert refused.problem["rule"] == "auth_failure"
