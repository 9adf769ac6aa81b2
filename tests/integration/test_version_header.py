"""What Weir sends names its release: the real auth's auth.check answers (its batched seam) and refusals, its
management replies (FastStream handlers) and refusals of an invalid request, the events its outbox relay publishes,
each with the `Weir-Version` header of this release (the header a reader names in its unreadable-reply line)."""

from __future__ import annotations

import json

import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from shared.authcheck import CHECK_SUBJECT, manage_subject
from shared.bus import HDR_VERSION, subscriptions_in_place
from shared.release import VERSION
from shared.settings import CommonSettings
from tests.integration.authhelpers import auth_instances, fresh_address, new_app, request
from tests.waiting import wait_for

pytestmark = pytest.mark.asyncio(loop_scope="session")


def release_of(msg: Msg) -> str | None:
    return (msg.headers or {}).get(HDR_VERSION)


async def test_auth_replies_and_events_carry_this_release(prepared: CommonSettings, nc: NATS) -> None:
    published: list[Msg] = []

    async def seen(msg: Msg) -> None:
        published.append(msg)

    sub = await nc.subscribe("key.created", cb=seen)  # the relay's JetStream publishes, seen on the subject
    await subscriptions_in_place(nc)
    try:
        async with auth_instances(prepared):
            demo = await new_app(nc)  # account.create and app.create: FastStream replies; key.created events
            decided = await nc.request(CHECK_SUBJECT, request(demo.app.secret_key, peer=fresh_address())
                                       .model_dump_json().encode(), timeout=5)
            assert json.loads(decided.data)["allowed"] is True
            refused_check = await nc.request(CHECK_SUBJECT, b"not json", timeout=5)
            assert refused_check.data.startswith(b'{"error"')
            listed = await nc.request(manage_subject("keys.list"), json.dumps(
                {"account_id": demo.account.account_id, "app_id": demo.app.id}).encode(), timeout=5)
            assert b'"keys"' in listed.data, listed.data
            refused_manage = await nc.request(manage_subject("keys.list"), b'{"app_id": 7}', timeout=5)
            assert refused_manage.data.startswith(b'{"error"'), refused_manage.data
            for reply in (decided, refused_check, listed, refused_manage):
                assert release_of(reply) == VERSION, (reply.subject, reply.headers)

            async def two_keys() -> bool:
                ours = [m for m in published if demo.app.id in m.data.decode()]
                return len(ours) >= 2

            await wait_for(two_keys, 10, "the two key.created events")
        ours = [m for m in published if demo.app.id in m.data.decode()]
        assert ours and all(release_of(m) == VERSION for m in ours), [m.headers for m in ours]
    finally:
        await sub.unsubscribe()
