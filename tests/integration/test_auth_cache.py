"""auth's credential cache on real PostgreSQL: a busy key is fetched again before it expires (no request waits for
the database), and a lookup that a revocation overtakes does not put the revoked key back."""

from __future__ import annotations

import asyncio
import time

import pytest
from nats.aio.client import Client as NATS

from services.auth import store
from services.auth.domain.credentials import key_hash
from services.auth.lookups import REFRESH_AHEAD
from shared.authcheck import CheckReply
from shared.settings import CommonSettings
from tests.integration.authhelpers import TEST_SECRETS, auth_instances, checker, fresh_address, new_app, request

pytestmark = pytest.mark.asyncio(loop_scope="session")

TTL = 1.0


@pytest.mark.parametrize("path", ["model", "payload"])  # check(): each request staged; check_payloads(): the memo
async def test_a_busy_key_is_fetched_again_before_it_expires(prepared: CommonSettings, nc: NATS, path: str) -> None:
    async with auth_instances(prepared, key_cache_seconds=TTL) as (rt,):
        c = checker(rt)
        demo = await new_app(nc)
        peer = fresh_address()
        slot = key_hash(TEST_SECRETS["key_hash_secret"].encode(), demo.app.secret_key)
        start = c.clock()
        c.clock = lambda: start  # the checker's clock, driven by the test: no sleeping into a narrow window
        req = request(demo.app.secret_key, peer=peer)

        async def allowed() -> bool:
            if path == "model":
                return (await c.check(req)).allowed
            (reply,) = await c.check_payloads([req.model_dump_json().encode()])
            return CheckReply.model_validate_json(reply).allowed

        assert await allowed()
        first = c.cache._entries[slot]
        lookups = rt.metrics.value("credential_lookups_total")
        c.clock = lambda: start + TTL * (REFRESH_AHEAD + 1) / 2  # past the refresh point, before the expiry
        assert await allowed()  # served from the cache
        assert rt.metrics.value("credential_lookups_total") in (lookups, lookups + 1)  # not waited for
        deadline = time.monotonic() + 5
        while c.cache._entries[slot].until == first.until:
            assert time.monotonic() < deadline, "the entry was never fetched again"
            await asyncio.sleep(0.01)
        assert rt.metrics.value("credential_lookups_total") == lookups + 1
        assert c.cache._entries[slot].until > first.until


async def test_a_lookup_overtaken_by_a_revocation_is_not_cached(prepared: CommonSettings, nc: NATS) -> None:
    async with auth_instances(prepared) as (rt,):
        c = checker(rt)
        demo = await new_app(nc)
        slot = key_hash(TEST_SECRETS["key_hash_secret"].encode(), demo.app.secret_key)

        async def read_while_revoked(conn: object) -> store.KeyRecord | None:
            record = await store.key_by_hash(conn, slot)  # type: ignore[arg-type]
            c.forget_key(demo.app.secret_key_id)  # key.revoked arrives while the read is in flight
            return record

        record = await c.lookups.fetch(slot, c.clock(), read_while_revoked)
        assert record is not None  # the read itself saw the key
        assert c.cache.get(slot, c.clock()) is None  # but it is not put back after the revocation
        record = await c.lookups.fetch(slot, c.clock(), lambda conn: store.key_by_hash(conn, slot))
        assert c.cache.get(slot, c.clock()) is not None  # an ordinary lookup is cached


async def test_a_remembered_payload_past_its_refresh_point_is_kept_while_its_record_is_the_same(
    prepared: CommonSettings, nc: NATS
) -> None:
    """The payloads of a busy key come due together; each is kept (no parse, no new plans) when the cache still finds
    the same record, and rebuilt once the record fetched again differs: here a revocation missed on the bus."""
    async with auth_instances(prepared, key_cache_seconds=TTL) as (rt,):
        c = checker(rt)
        demo = await new_app(nc)
        payload = request(demo.app.secret_key, peer=fresh_address()).model_dump_json().encode()
        slot = key_hash(TEST_SECRETS["key_hash_secret"].encode(), demo.app.secret_key)
        start = c.clock()
        c.clock = lambda: start

        async def status() -> int:
            (reply,) = await c.check_payloads([payload])
            return CheckReply.model_validate_json(reply).status

        assert await status() == 200
        (remembered,) = c._memo.values()
        assert remembered.lookup is not None
        first = remembered.lookup.record
        renewed = rt.metrics.value("check_payloads_renewed_total")

        # the key is revoked in the database, and key.revoked never reaches this instance
        async with c.pool.acquire() as conn:
            await conn.execute("UPDATE keys SET revoked_at = now() WHERE id = $1::uuid", demo.app.secret_key_id)

        due = start + TTL * (REFRESH_AHEAD + 1) / 2  # past the payload's refresh point, before the lookup's expiry
        c.clock = lambda: due
        assert await status() == 200  # the cached record is still the one the payload was built from: kept
        assert list(c._memo.values()) == [remembered] and c._memo[next(iter(c._memo))] is remembered
        assert remembered.until > due
        assert rt.metrics.value("check_payloads_renewed_total") == renewed + 1

        deadline = time.monotonic() + 5
        while c.cache._entries[slot].record == first:  # the hit past its refresh point fetched the record again
            assert time.monotonic() < deadline, "the record was never fetched again"
            await asyncio.sleep(0.01)
        assert c.cache._entries[slot].until <= remembered.until + TTL

        c.clock = lambda: remembered.until  # the renewed payload's own refresh point: the record now differs
        assert await status() == 401
        assert rt.metrics.value("check_payloads_renewed_total") == renewed + 1
        assert not c._memo  # a revoked key's payload is not remembered: the next one is looked up again
