"""auth's subjects on the real nats-server: a request that fails validation is answered at once (never left to the
caller's timeout), refusals arrive typed, and `auth.check` is served by the batched subscription alone."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from nats.aio.client import Client as NATS
from nats.errors import NoRespondersError

from shared.authcheck import (
    CHECK_SUBJECT,
    MANAGE_OPERATIONS,
    AppCreated,
    CreateAccount,
    KeyRevocation,
    RevokeKey,
    manage_subject,
)
from shared.authclient import AuthError, check_reply, manage
from shared.messaging import ErrorReply
from shared.runtime import build_http
from shared.settings import CommonSettings
from tests.integration.authhelpers import (
    TEST_SECRETS,
    ask,
    auth_instances,
    checker,
    fresh_address,
    new_app,
    request,
)

pytestmark = pytest.mark.asyncio(loop_scope="session")

PROMPT_S = 0.1  # the bound for a malformed auth.check's answer
MALFORMED = [b"not json", b"{}", b'{"peer": 1, "route_class": "secret", "route": "r"}',
             b'{"peer": "10.0.0.1", "route_class": 5, "route": "r"}']


async def test_a_malformed_check_is_refused_within_100_ms(prepared: CommonSettings, nc: NATS) -> None:
    async with auth_instances(prepared):
        await ask(nc, request(peer=fresh_address(), route_class="public"))  # connections and caches warm
        for payload in MALFORMED:
            started = time.perf_counter()
            msg = await nc.request(CHECK_SUBJECT, payload, timeout=5)
            elapsed = time.perf_counter() - started
            error = ErrorReply.model_validate_json(msg.data).error
            assert (error.status, error.code) == (400, "validation_error"), payload
            assert elapsed < PROMPT_S, f"{payload!r} answered after {elapsed * 1000:.0f} ms"
            with pytest.raises(AuthError) as refused:  # as the api's guard reads it
                check_reply(msg.data)
            assert refused.value.error.code == "validation_error"
        # and a well-formed request in the same batch as malformed ones still gets its decision
        good = request(peer=fresh_address(), route_class="public").model_dump_json().encode()
        answers = await asyncio.gather(*(nc.request(CHECK_SUBJECT, p, timeout=5) for p in [*MALFORMED, good]))
        assert [a.data.startswith(b'{"error"') for a in answers] == [True] * len(MALFORMED) + [False]
        assert check_reply(answers[-1].data).allowed


async def test_a_newer_edges_check_is_decided_with_its_unknowns_read_safely(prepared: CommonSettings, nc: NATS) -> None:
    """A field auth does not know is ignored; a route class it does not know is decided as `internal`: no customer
    credential passes (an older auth cannot know whom the newer class admits), Weir's own token does."""
    async with auth_instances(prepared):
        demo = await new_app(nc)
        newer = request(demo.app.secret_key, peer=fresh_address()).model_dump(mode="json")
        reply = check_reply((await nc.request(CHECK_SUBJECT, json.dumps({**newer, "priority": "high"}).encode(),
                                              timeout=5)).data)
        assert reply.allowed
        unknown_class = {**newer, "route_class": "partner"}
        refused = check_reply((await nc.request(CHECK_SUBJECT, json.dumps(unknown_class).encode(), timeout=5)).data)
        assert (refused.status, (refused.problem or {}).get("code")) == (401, "credential_not_allowed")
        internal = {**unknown_class, "authorization": None, "internal_token": TEST_SECRETS["internal_token"]}
        assert check_reply((await nc.request(CHECK_SUBJECT, json.dumps(internal).encode(), timeout=5)).data).allowed


async def test_a_malformed_management_request_is_refused_at_once(prepared: CommonSettings, nc: NATS) -> None:
    async with auth_instances(prepared):
        for operation, (request_model, _) in MANAGE_OPERATIONS.items():
            # an object without fields is a whole request to an operation that asks nothing (limits.list)
            asks = any(f.is_required() for f in request_model.model_fields.values())
            for payload in (b"not json", b"[1]", *((b"{}", b'{"unexpected": 1}') if asks else ())):
                started = time.perf_counter()
                msg = await nc.request(manage_subject(operation), payload, timeout=5)
                elapsed = time.perf_counter() - started
                error = ErrorReply.model_validate_json(msg.data).error
                assert (error.status, error.code) == (400, "validation_error"), (operation, payload)
                assert elapsed < 1.0, f"{operation} {payload!r} answered after {elapsed * 1000:.0f} ms"
        # through the client: another operation's model is refused, typed
        with pytest.raises(AuthError) as refused:
            await manage(nc, "app.create", CreateAccount(name="wrong model"), AppCreated)
        assert (refused.value.error.status, refused.value.error.code) == (400, "validation_error")


async def test_refusals_and_replies_arrive_typed(prepared: CommonSettings, nc: NATS) -> None:
    async with auth_instances(prepared):
        demo = await new_app(nc)
        revoke = RevokeKey(user_id=demo.account.user_id, account_id=demo.account.account_id,
                           key_id=demo.app.publishable_key_id)
        assert await manage(nc, "key.revoke", revoke, KeyRevocation) == KeyRevocation(revoked=True, already=False)
        assert await manage(nc, "key.revoke", revoke, KeyRevocation) == KeyRevocation(revoked=True, already=True)
        with pytest.raises(AuthError) as refused:
            await manage(nc, "key.revoke", revoke.model_copy(update={"key_id": "no-such-key"}), KeyRevocation)
        assert (refused.value.error.status, refused.value.error.code) == (404, "not_found")
        # an operation auth does not have: nobody listens on its subject, said at once
        started = time.perf_counter()
        with pytest.raises(NoRespondersError):
            await nc.request(manage_subject("account.delete"), b"{}", timeout=5)
        assert time.perf_counter() - started < 1.0


async def test_checks_are_decided_in_batches_on_one_subscription(prepared: CommonSettings, nc: NATS) -> None:
    """Every check goes through the batcher (weir_check_batches_total counts its batches), and a burst is decided
    in fewer batches than checks."""
    async with auth_instances(prepared) as (rt,):
        demo = await new_app(nc)
        n = 200
        batches, checks = rt.metrics.value("check_batches_total"), rt.metrics.value("checks_total", status="200")
        replies = await asyncio.gather(*(ask(nc, request(demo.app.secret_key, peer=fresh_address()))
                                         for _ in range(n)))
        assert all(r.allowed for r in replies)
        decided = rt.metrics.value("check_batches_total") - batches
        assert 1 <= decided < n, decided
        assert rt.metrics.value("checks_total", status="200") - checks == n


async def test_a_reconnect_forgets_every_cached_lookup(prepared: CommonSettings, nc: NATS) -> None:
    """Revocations may have passed while disconnected: on reconnect auth forgets its cached keys (through the
    broker's own reconnect callback, which FastStream wraps), and decides as before afterwards."""
    async with auth_instances(prepared) as (rt,):
        demo = await new_app(nc)
        assert (await ask(nc, request(demo.app.secret_key, peer=fresh_address()))).allowed
        cache = checker(rt).cache
        assert cache._entries
        epoch = cache.epoch
        assert rt.nc is not None
        await rt.nc.force_reconnect()
        async with asyncio.timeout(10):
            while cache.epoch == epoch or not rt.nc.is_connected:
                await asyncio.sleep(0.01)
        assert not cache._entries
        assert (await ask(nc, request(demo.app.secret_key, peer=fresh_address()))).allowed


async def test_the_running_services_asyncapi_document_has_auth_check(prepared: CommonSettings) -> None:
    """/asyncapi.json of a started auth lists auth.check (request, queue group, reply), while its running broker
    has no FastStream subscriber of it."""
    async with auth_instances(prepared) as (rt,):
        assert rt.broker is not None
        assert CHECK_SUBJECT not in {sub.subject.broker_address for sub in rt.broker.subscribers}
        transport = httpx.ASGITransport(app=build_http(rt))
        async with httpx.AsyncClient(transport=transport, base_url="http://auth") as http:
            doc = (await http.get("/asyncapi.json")).json()
        (channel,) = [c for c in doc["channels"].values() if c["address"] == CHECK_SUBJECT]
        assert channel["bindings"]["nats"]["queue"] == "auth"
        assert f"{CHECK_SUBJECT}:reply" in doc["channels"]
