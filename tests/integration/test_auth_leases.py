"""Budget leases on the real counter stream: fewer round trips, the same exact limits across instances.

An instance takes counts of a busy counter ahead of its requests; these tests show that it then needs far fewer
round trips than requests, that counts held by one instance are admitted by it even after another has spent the rest,
that idle or stopped instances give their counts back so another can admit them, and that the reply bytes written
for the NATS path are the reply model.
"""

from __future__ import annotations

import asyncio
import math
import time

import pytest
from nats.aio.client import Client as NATS

from services.auth.checker import Checker
from services.auth.domain.windows import window_start
from services.auth.replies import reply_bytes, reply_model
from shared.authcheck import CheckDecision, CheckReply
from shared.authclient import check_decision
from shared.settings import CommonSettings
from tests.integration.authhelpers import TEST_SECRETS, auth_instances, checker, fresh_address, new_app, request

pytestmark = pytest.mark.asyncio(loop_scope="session")

# long enough that no lease is given back by accident in the middle of a test on a loaded machine
HOLD_MS = 60_000


async def admitted(c: Checker, key: str, peer: str, n: int) -> int:
    return sum([(await c.check(request(key, peer=peer))).allowed for _ in range(n)])


async def grants_landed(c: Checker) -> None:
    """Wait for the grants ahead of need that the last requests started (no fixed sleep: a loaded machine is slow)."""
    deadline = time.monotonic() + 10
    while any(lease.grant is not None for lease in c.leases._leases.values()):
        assert time.monotonic() < deadline, "a grant never landed"
        await asyncio.sleep(0.01)


async def test_a_busy_key_needs_far_fewer_round_trips_than_requests(prepared: CommonSettings, nc: NATS) -> None:
    n = 2000
    async with auth_instances(prepared, limit_key_per_minute=n * 10, limit_owner_per_minute=n * 10,
                              counter_lease_idle_ms=HOLD_MS) as (rt,):
        c = checker(rt)
        demo = await new_app(nc)
        window = rt.settings.limit_window_seconds  # type: ignore[attr-defined]
        started = c.clock()
        assert await admitted(c, demo.app.secret_key, fresh_address(), n) == n
        # a window that ends during the run starts new counters, each with its own doubling
        windows = (window_start(c.clock(), window) - window_start(started, window)) // window + 1
        max_lease = rt.settings.counter_lease_max  # type: ignore[attr-defined]
        # per counter (key and owner) and window: the doubling up to max_lease, then one grant per max_lease requests
        per_counter = math.ceil(math.log2(max_lease)) + 1 + math.ceil(n / max_lease)
        assert c.leases.grants <= 2 * per_counter * windows, (c.leases.grants, windows)
    async with auth_instances(prepared, limit_key_per_minute=n * 10, limit_owner_per_minute=n * 10,
                              counter_lease_max=1) as (rt,):
        c = checker(rt)
        assert await admitted(c, demo.app.secret_key, fresh_address(), n // 10) == n // 10
        assert c.leases.grants == 2 * (n // 10)  # leases off: one round trip per counter per request


async def test_counts_held_by_one_instance_are_admitted_after_another_spent_the_rest(
    prepared: CommonSettings, nc: NATS
) -> None:
    limit = 200
    async with auth_instances(prepared, n=2, limit_key_per_minute=limit, limit_owner_per_minute=limit * 10,
                              counter_lease_fraction=2, counter_lease_idle_ms=HOLD_MS) as (a, b):
        demo = await new_app(nc)
        key, peer = demo.app.secret_key, fresh_address()
        first = limit // 4
        assert await admitted(checker(a), key, peer, first) == first
        await grants_landed(checker(a))
        held = checker(a).leases.held(next(s for s in checker(a).leases._leases if ".key." in s))
        assert held > 0, "a holds no counts ahead: this test would show nothing"
        # b admits what neither used nor holds, then is refused (and tells a the budget is spent)
        assert await admitted(checker(b), key, peer, limit) == limit - first - held
        deadline = time.monotonic() + 5
        while not len(checker(a).memory):  # b's word that the budget is spent reaches a
            assert time.monotonic() < deadline, "a never heard that the key's budget is spent"
            await asyncio.sleep(0.01)
        # a still admits every count it holds, though the store's total is past the limit
        assert await admitted(checker(a), key, peer, held + 5) == held
        assert not (await checker(b).check(request(key, peer=peer))).allowed


@pytest.mark.parametrize("how", ["idle", "stopped"])
async def test_an_idle_or_stopped_instance_gives_its_counts_back(prepared: CommonSettings, nc: NATS, how: str) -> None:
    limit = 200
    idle_ms = 1000 if how == "idle" else HOLD_MS
    overrides = dict(limit_key_per_minute=limit, limit_owner_per_minute=limit * 10, counter_lease_fraction=2)
    async with auth_instances(prepared, counter_lease_idle_ms=HOLD_MS, **overrides) as (b,):
        demo = await new_app(nc)
        key, peer = demo.app.secret_key, fresh_address()
        async with auth_instances(prepared, counter_lease_idle_ms=idle_ms, **overrides) as (a,):
            first = limit // 4
            assert await admitted(checker(a), key, peer, first) == first
            await grants_landed(checker(a))
            leases = checker(a).leases
            assert sum(lease.held for lease in leases._leases.values()) > 0, "nothing held: nothing to give back"
            if how == "idle":
                deadline = time.monotonic() + 10
                while sum(lease.held for lease in leases._leases.values()):
                    assert time.monotonic() < deadline, "the idle lease was never given back"
                    await asyncio.sleep(idle_ms / 1000 / 4)
        # a gave back (idle) or stopped (shutdown gives everything back): b can admit all that a did not use
        assert await admitted(checker(b), key, peer, limit) == limit - first


async def test_reply_bytes_are_the_reply_model(prepared: CommonSettings, nc: NATS) -> None:
    per_address = 2
    async with auth_instances(prepared, limit_address_per_minute=per_address) as (rt,):
        c = checker(rt)
        demo = await new_app(nc)
        peer = fresh_address()
        requests = [
            request(demo.app.secret_key, peer=peer),
            request(demo.app.publishable_key, peer=peer),  # a publishable key on a secret route: 401
            request("wsk_" + "z" * 32, peer=peer),  # unknown key: 401, counted on auth_failure
            request(demo.app.publishable_key, peer=peer, route_class="sdk"),
            request(peer=peer, route_class="internal", internal=TEST_SECRETS["internal_token"]),
            request(peer=peer, route_class="internal", internal="forged"),
            request(demo.account.account_token, peer=peer, route_class="management", operation="app_create"),
            *[request(peer=peer, route_class="public") for _ in range(per_address + 1)],  # the last one is a 429
        ]
        now = c.clock()
        staged = [c._staged(await c._remembered(r, now), now) for r in requests]
        await c._decide(staged, now)
        statuses = set()
        for st in staged:
            model = reply_model(st, "shared")
            for mode in ("shared", "local"):
                data = reply_bytes(st, mode)
                expected = model.model_copy(update={"counter_mode": mode})
                assert CheckReply.model_validate_json(data) == expected
                # the edge reads it as its remembered decision and its headers (the headers come last)
                decision, headers = check_decision(data)
                assert type(decision) is CheckDecision, "read whole: the headers were not the last field"
                assert (decision.model_dump(), headers) == (expected.model_dump(exclude={"headers"}), expected.headers)
            statuses.add(model.status)
        assert {200, 401, 429} <= statuses
