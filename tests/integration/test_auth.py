"""auth.check over real NATS, PostgreSQL and JetStream counters: SPEC sections 2 and 3, across instances.

Every count is derived from the settings the instances run with; addresses are fresh per test.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from typing import Any

import pytest
from nats.aio.client import Client as NATS
from nats.js import api

from services.auth.app import AuthParts
from services.auth.domain.upload_tokens import sign_upload_token
from shared.authcheck import CheckReply, KeyList, ListKeys, RevokeKey
from shared.authclient import manage, manage_raw
from shared.bus import connect
from shared.events import Envelope
from shared.settings import CommonSettings
from tests.integration.authhelpers import (
    TEST_SECRETS,
    ask,
    auth_instances,
    auth_settings,
    checker,
    fresh_address,
    mint,
    new_app,
    request,
)
from tests.integration.privatenats import running_private_nats, wait_until_up
from weir.up import prepare

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def test_post_mortem_internal_token_exempt_forged_counted(prepared: CommonSettings, nc: NATS) -> None:
    """The post-mortem's three: real internal token never limited by address; ordinary and forged are."""
    limit = 5
    settings = auth_settings(prepared, limit_address_per_minute=limit)
    n = limit * 4
    async with auth_instances(prepared, limit_address_per_minute=limit):
        shared_edge = fresh_address()
        real = settings.internal_token.get_secret_value()
        replies = [await ask(nc, request(peer=shared_edge, route_class="internal", internal=real)) for _ in range(n)]
        assert [r.status for r in replies] == [200] * n

        ordinary = fresh_address()
        replies = [await ask(nc, request(peer=ordinary, route_class="public")) for _ in range(n)]
        assert [r.status for r in replies] == [200] * limit + [429] * (n - limit)
        refused = replies[-1]
        assert int(refused.headers["Retry-After"]) >= 1
        assert refused.problem is not None and refused.problem["rule"] == "address"

        forger = fresh_address()
        replies = [
            await ask(nc, request(peer=forger, route_class="internal", internal="not-the-token")) for _ in range(n)
        ]
        statuses = [r.status for r in replies]
        # refused exactly like ordinary requests by the address limit; before that, internal routes answer 401
        assert statuses == [401] * limit + [429] * (n - limit)
        assert replies[0].problem is not None and replies[0].problem["code"] == "invalid_credential"


async def test_owner_limit_holds_many_keys_of_one_account(prepared: CommonSettings, nc: NATS) -> None:
    per_key, owner, keys = 4, 10, 5
    async with auth_instances(prepared, limit_key_per_minute=per_key, limit_owner_per_minute=owner):
        demo = await new_app(nc)
        from shared.authcheck import AppCreated, CreateApp

        secrets = [demo.app.secret_key]
        for i in range(keys - 1):  # more apps of the same account, each with its own secret key
            extra = await manage(nc, "app.create", CreateApp(
                user_id=demo.account.user_id, account_id=demo.account.account_id, name=f"extra-{i}"), AppCreated)
            secrets.append(extra.secret_key)
        peer = fresh_address()
        admitted = {k: 0 for k in secrets}
        for _ in range(per_key):
            for key in secrets:
                r = await ask(nc, request(key, peer=peer))
                admitted[key] += r.allowed
                if not r.allowed:
                    assert r.problem is not None and r.problem["rule"] == "owner"
        assert sum(admitted.values()) == owner  # the account in all, though every key was within its own limit
        assert all(v <= per_key for v in admitted.values())


async def test_auth_failure_block_spares_recently_accepted_key_and_spends_no_key_budget(
    prepared: CommonSettings, nc: NATS
) -> None:
    failures, per_key = 3, 50
    limits = {"limit_auth_failure_per_minute": failures, "limit_key_per_minute": per_key}
    settings = auth_settings(prepared, **limits)
    # the key's own rule is the tightest that applies to its requests, so the headers show what is left of it
    assert settings.limit_key_per_minute < settings.limit_owner_per_minute
    async with auth_instances(prepared, **limits):
        demo = await new_app(nc)
        shared_address = fresh_address()
        good = await ask(nc, request(demo.app.secret_key, peer=shared_address))
        assert good.allowed
        assert good.headers["RateLimit"].startswith('"key";')
        remaining = int(good.headers["X-RateLimit-Remaining"])
        assert remaining == settings.limit_key_per_minute - 1

        guesses = [await ask(nc, request("wsk_" + "x" * 32, peer=shared_address)) for _ in range(failures + 3)]
        assert [r.status for r in guesses] == [401] * failures + [429] * 3
        assert guesses[-1].problem is not None and guesses[-1].problem["rule"] == "auth_failure"

        # everyone else at that address waits for the window to end...
        other = await ask(nc, request(None, peer=shared_address, route_class="public"))
        assert other.status == 429
        # ...but the customer whose key this instance accepted within the last minute keeps working
        again = await ask(nc, request(demo.app.secret_key, peer=shared_address))
        assert again.allowed, again.problem
        # and the rejected guesses spent nothing of that key's budget: two accepted requests, two counts spent
        assert again.headers["RateLimit"].startswith('"key";')
        assert again.headers["X-RateLimit-Limit"] == str(settings.limit_key_per_minute)
        assert int(again.headers["X-RateLimit-Remaining"]) == settings.limit_key_per_minute - 2 == remaining - 1
        # a key never accepted from that address is held by the block
        second = await new_app(nc)
        held = await ask(nc, request(second.app.secret_key, peer=shared_address))
        assert held.status == 429


async def test_upload_token_dies_within_a_second_of_key_revocation_on_another_instance(
    prepared: CommonSettings, nc: NATS
) -> None:
    async with auth_instances(prepared, n=2) as (a, b):
        demo = await new_app(nc)
        video = str(uuid.uuid4())
        token = await mint(nc, demo, video)
        peer = fresh_address()
        upload = request(token, peer=peer, route_class="sdk", video_id=video)
        assert (await checker(b).check(upload)).allowed  # b has the key cached now
        assert (await checker(b).check(request(token, peer=peer, route_class="sdk",
                                               video_id=str(uuid.uuid4())))).status == 403  # another video

        await manage_raw(nc, "key.revoke", RevokeKey(user_id=demo.account.user_id,
                                                      account_id=demo.account.account_id,
                                                      key_id=demo.app.secret_key_id))
        revoked_at = time.monotonic()
        while (await checker(b).check(upload)).allowed:
            assert time.monotonic() - revoked_at < 1.0, "instance b still accepts the token a second later"
            await asyncio.sleep(0.01)
        refused = await checker(b).check(upload)
        assert refused.status == 401 and refused.problem is not None
        assert refused.problem["code"] == "invalid_credential"
        keys = await manage(nc, "keys.list", ListKeys(account_id=demo.account.account_id, app_id=demo.app.id), KeyList)
        assert [k.revoked_at is not None for k in keys.keys if k.id == demo.app.secret_key_id] == [True]
        del a


async def test_three_instances_admit_exactly_the_key_limit(prepared: CommonSettings, nc: NATS) -> None:
    """Exact while the store answers. The three instances share this test's one event loop and core, so a burst
    queues for longer than the 25 ms budget; the budget is raised here so the store counts as answering."""
    per_key, total = 300, 2000
    async with auth_instances(prepared, n=3, limit_key_per_minute=per_key, limit_owner_per_minute=total * 2,
                              counter_store_timeout_ms=5000) as instances:
        demo = await new_app(nc)
        peer = fresh_address()
        clients = [nc]

        for _ in range(2):
            clients.append(await connect(prepared, name="test"))
        try:
            sem = asyncio.Semaphore(400)

            async def one(i: int) -> bool:
                async with sem:
                    return (await ask(clients[i % len(clients)], request(demo.app.secret_key, peer=peer))).allowed

            results = await asyncio.gather(*(one(i) for i in range(total)))
        finally:
            for c in clients[1:]:
                await c.close()
        assert sum(results) == per_key
        assert all(rt.parts_of(AuthParts).counters.mode == "shared" for rt in instances)


async def test_counter_store_outage_falls_back_locally_without_waiting(
    prepared: CommonSettings, caplog: pytest.LogCaptureFixture
) -> None:
    """The counter store freezes (SIGSTOP: still connected, answering nothing), under two auth instances on a NATS
    server of this test's own: the first check may wait out the store's budget, no later one waits it (the circuit
    breaker), and once the store answers again the instances count in it together."""
    limit = 10
    overrides: dict[str, Any] = {
        "limit_address_per_minute": limit,
        # the store's budget, long enough that "waited for it" and "did not" cannot be confused on a loaded machine
        "counter_store_timeout_ms": 1000,
        # no leases: every check asks the store for its count, so only the breaker keeps a check from waiting
        "counter_lease_max": 1,
    }
    caplog.set_level(logging.WARNING, logger="weir.auth.counters")
    with running_private_nats("weir-auth-outage-") as server:
        await wait_until_up(server.url)
        private = prepared.model_copy(update={"nats_url": server.url})
        await prepare(private)  # its streams (the counter stream among them); the database and bucket are shared
        settings = auth_settings(private, **overrides)
        budget_s = settings.counter_store_timeout_ms / 1000
        async with auth_instances(private, n=2, **overrides) as (a, b):

            async def together(peer: str) -> list[CheckReply]:
                """Twice the limit from one address, alternating between the instances."""
                return [await checker((a, b)[i % 2]).check(request(peer=peer, route_class="public"))
                        for i in range(2 * limit)]

            def statuses(replies: list[CheckReply]) -> list[int]:
                return [r.status for r in replies]

            # the store answers: the two instances' counts add up to one limit
            before = await together(fresh_address())
            assert statuses(before) == [200] * limit + [429] * limit
            assert {r.counter_mode for r in before} == {"shared"}
            assert a.metrics.value("counter_store_shared") == 1

            server.freeze(True)
            try:
                peer = fresh_address()
                durations: list[float] = []
                replies: list[CheckReply] = []
                for _ in range(2 * limit):
                    started = time.perf_counter()
                    replies.append(await checker(a).check(request(peer=peer, route_class="public")))
                    durations.append(time.perf_counter() - started)
                # the first check asked the silent store and waited out its budget (the store really was silent,
                # not refusing at once), and no longer; after it, the breaker is open and no check waits (half the
                # budget: a wait that a timer ends a hair early still counts as waiting it)
                assert budget_s * 0.9 <= durations[0] < budget_s * 1.5, durations
                assert max(durations[1:]) < budget_s / 2, durations
                # decided on local windows, with the same numbers
                assert statuses(replies) == [200] * limit + [429] * limit
                assert [r.counter_mode for r in replies] == ["local"] * len(replies)
                assert a.parts_of(AuthParts).counters.mode == "local"
                assert a.metrics.value("counter_store_shared") == 0
                assert a.metrics.value("counter_store_switches_total", to="local") == 1
                assert any("local windows on" in r.getMessage() for r in caplog.records)
            finally:
                server.freeze(False)

            deadline = time.monotonic() + 20
            while a.parts_of(AuthParts).counters.mode != "shared":
                assert time.monotonic() < deadline, "shared counting did not resume"
                await asyncio.sleep(0.05)
            assert a.metrics.value("counter_store_shared") == 1
            assert a.metrics.value("counter_store_switches_total", to="shared") == 1
            # back on the shared store: the two instances' counts add up to one limit again (on local windows
            # each would admit the limit by itself)
            after = await together(fresh_address())
            assert statuses(after) == [200] * limit + [429] * limit
            assert {r.counter_mode for r in after} == {"shared"}
            assert a.parts_of(AuthParts).counters.mode == "shared"


async def test_spoofed_forwarded_for_from_untrusted_peer_changes_nothing(prepared: CommonSettings, nc: NATS) -> None:
    limit = 3
    async with auth_instances(prepared, limit_address_per_minute=limit, trusted_proxies="127.0.0.9/32"):
        peer = fresh_address()
        replies = [
            await ask(nc, request(peer=peer, route_class="public", forwarded_for=fresh_address()))
            for _ in range(limit + 2)
        ]
        assert [r.status for r in replies] == [200] * limit + [429] * 2
        assert {r.client_address for r in replies} == {peer}
        # behind the trusted proxy, the rightmost untrusted hop is the client
        client = fresh_address()
        r = await ask(nc, request(peer="127.0.0.9", route_class="public", forwarded_for=f"6.6.6.6, {client}"))
        assert r.client_address == client


async def test_credentials_of_every_kind(prepared: CommonSettings, nc: NATS) -> None:
    async with auth_instances(prepared):
        demo = await new_app(nc)
        peer = fresh_address()
        pub_on_secret = await ask(nc, request(demo.app.publishable_key, peer=peer))
        assert pub_on_secret.status == 401 and pub_on_secret.problem is not None
        assert pub_on_secret.problem["code"] == "credential_not_allowed"
        assert pub_on_secret.problem["detail"] == "publishable keys cannot be used on this route"
        sdk = await ask(nc, request(demo.app.publishable_key, peer=peer, route_class="sdk"))
        assert sdk.allowed and sdk.identity is not None and sdk.identity.key_type == "publishable"
        secret = await ask(nc, request(demo.app.secret_key, peer=peer))
        assert secret.identity is not None
        assert (secret.identity.app_id, secret.identity.account_id, secret.identity.key_id) == (
            demo.app.id, demo.account.account_id, demo.app.secret_key_id,
        )
        missing = await ask(nc, request(None, peer=peer))
        assert missing.status == 401 and missing.problem is not None and missing.problem["code"] == "missing_credential"
        for reply in (pub_on_secret, sdk, secret, missing):
            assert {"RateLimit-Policy", "RateLimit", "X-RateLimit-Limit", "X-RateLimit-Remaining",
                    "X-RateLimit-Reset"} <= set(reply.headers)
        expired_secret = auth_settings(prepared).upload_token_secret.get_secret_value().encode()
        old = sign_upload_token(expired_secret, "v", demo.app.id, demo.app.secret_key_id, int(time.time()) - 5)
        expired = await ask(nc, request(old, peer=peer, route_class="sdk", video_id="v"))
        assert expired.status == 401 and expired.problem is not None and expired.problem["code"] == "token_expired"
        assert TEST_SECRETS["key_hash_secret"] not in str(expired)


async def test_rejections_are_published_and_folded_past_the_limit(prepared: CommonSettings, nc: NATS) -> None:
    failures = 3
    js = nc.jetstream()
    sub = await js.pull_subscribe(
        "credential.rejected", stream="AUTH",
        config=api.ConsumerConfig(deliver_policy=api.DeliverPolicy.NEW, ack_policy=api.AckPolicy.NONE),
    )
    peer = fresh_address()
    extra = 7
    async with auth_instances(prepared, limit_auth_failure_per_minute=failures) as (rt,):
        for _ in range(failures + extra):
            await ask(nc, request("wsk_" + "y" * 32, peer=peer))
        mine: list[dict[str, object]] = []
        deadline = time.monotonic() + 10
        while len(mine) < failures and time.monotonic() < deadline:
            try:
                msgs = await sub.fetch(10, timeout=1)
            except TimeoutError:
                continue
            mine += [d for d in (Envelope.from_bytes(m.data).data for m in msgs) if d["client_address"] == peer]
        assert len(mine) == failures  # one event each, up to the limit
        assert all(m["key_prefix"] == "wsk_yyyyyyyy" for m in mine)  # 12 characters, never the key
        folded = checker(rt).rejections.folding.folded
        assert sum(c for (addr, _), (_, c) in folded.items() if addr == peer) == extra
    # stopping the instance flushes what was folded: one event with the count
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            msgs = await sub.fetch(10, timeout=1)
        except TimeoutError:
            continue
        folded_events = [d for d in (Envelope.from_bytes(m.data).data for m in msgs) if d["client_address"] == peer]
        if folded_events:
            assert [e["count"] for e in folded_events] == [extra]
            break
    else:
        raise AssertionError("the folded event never arrived")


async def test_a_spent_budget_is_known_to_every_instance(prepared: CommonSettings, nc: NATS) -> None:
    """Instance a sees an address spend its auth_failure budget; b refuses that address from then on, from memory."""
    failures = 3
    async with auth_instances(prepared, n=2, limit_auth_failure_per_minute=failures) as (a, b):
        address = fresh_address()
        for _ in range(failures):
            await checker(a).check(request("wsk_" + "z" * 32, peer=address))
        deadline = time.monotonic() + 1.0
        while (await checker(b).check(request(peer=address, route_class="public"))).status != 429:
            assert time.monotonic() < deadline, "instance b never learned of the block"
            await asyncio.sleep(0.01)
        refused = await checker(b).check(request(peer=address, route_class="public"))
        assert refused.problem is not None and refused.problem["rule"] == "auth_failure"
        assert b.metrics.value("limit_refusals_from_memory_total") >= 1
        # another address at b is untouched
        assert (await checker(b).check(request(peer=fresh_address(), route_class="public"))).allowed


async def test_a_revoked_key_cached_both_ways_is_refused_everywhere(prepared: CommonSettings, nc: NATS) -> None:
    """A key cached by its hash (used directly) and by its id (behind an upload token) leaves both caches."""
    async with auth_instances(prepared, n=2) as (_, b):
        demo = await new_app(nc)
        video = str(uuid.uuid4())
        token = await mint(nc, demo, video)
        peer = fresh_address()
        direct = request(demo.app.secret_key, peer=peer)
        assert (await checker(b).check(direct)).allowed
        assert (await checker(b).check(request(token, peer=peer, route_class="sdk", video_id=video))).allowed
        await manage_raw(nc, "key.revoke", RevokeKey(user_id=demo.account.user_id,
                                                      account_id=demo.account.account_id,
                                                      key_id=demo.app.secret_key_id))
        revoked_at = time.monotonic()
        while (await checker(b).check(direct)).allowed:
            assert time.monotonic() - revoked_at < 1.0, "the revoked key still works a second later"
            await asyncio.sleep(0.01)
        refused = await checker(b).check(direct)
        assert refused.status == 401 and refused.problem is not None


async def test_key_events_are_published_without_secrets(prepared: CommonSettings, nc: NATS) -> None:
    js = nc.jetstream()
    subs = {t: await js.pull_subscribe(t, stream="AUTH", config=api.ConsumerConfig(
        deliver_policy=api.DeliverPolicy.NEW, ack_policy=api.AckPolicy.NONE)) for t in ("key.created", "key.revoked")}
    async with auth_instances(prepared):
        demo = await new_app(nc)
        await manage_raw(nc, "key.revoke", RevokeKey(user_id=demo.account.user_id,
                                                      account_id=demo.account.account_id,
                                                      key_id=demo.app.publishable_key_id))

        async def events(kind: str, n: int) -> list[Envelope]:
            got: list[Envelope] = []
            deadline = time.monotonic() + 10
            while len(got) < n and time.monotonic() < deadline:
                with contextlib.suppress(TimeoutError):
                    got += [e for e in map(Envelope.from_bytes, (m.data for m in await subs[kind].fetch(10, timeout=1)))
                            if e.data["app_id"] == demo.app.id]
            return got

        created = await events("key.created", 2)
        assert {e.data["key_id"] for e in created} == {demo.app.secret_key_id, demo.app.publishable_key_id}
        revoked = await events("key.revoked", 1)
        assert [e.data["key_id"] for e in revoked] == [demo.app.publishable_key_id]
        for e in created + revoked:
            raw = e.to_bytes().decode()
            assert demo.app.secret_key not in raw and demo.app.publishable_key not in raw
