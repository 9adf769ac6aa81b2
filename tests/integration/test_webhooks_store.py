"""The webhooks store against the real PostgreSQL: what two consumers (or two instances) writing about one video at
the same moment must not lose."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime, timedelta

import pytest

from services.webhooks import store
from shared.settings import CommonSettings
from tests.conftest import fresh_schema

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def test_an_encoding_event_kept_while_its_video_is_learned_beside_it_is_still_delivered(
        prepared: CommonSettings) -> None:
    """encode.started read while video.created is applied in another transaction: the event's transaction sees no
    video and keeps the event without an app; video.created's must then find that event and deliver it, not miss it
    because it was not committed when it looked (this lost a delivery under load once)."""
    async with fresh_schema(prepared.database_url, "webhooks") as (_, pool):
        async with pool.acquire() as conn:
            made = await store.create_endpoint(conn, app_id="app1", account_id="acc1", url="http://127.0.0.1:9/x",
                                               events=["encode.*"], description="", secret="whsec_x")
        video_id = f"v_{uuid.uuid4().hex[:10]}"
        event = store.Received(str(uuid.uuid4()), "encode.started", None, video_id, datetime.now(UTC), b"{}")
        async with pool.acquire() as encoding, pool.acquire() as learning:
            tx = encoding.transaction()
            await tx.start()
            assert await store.video(encoding, video_id) is None
            await store.receive(encoding, event, source_seen=False, hold=timedelta(seconds=5))

            async def learn() -> int:
                async with learning.transaction():
                    return await store.learn_video(learning, video_id, "app1", "acc1", hold=timedelta(seconds=5))

            learned = asyncio.create_task(learn())
            await asyncio.sleep(0.5)  # the learning transaction has run as far as it can
            await tx.commit()
            assert await asyncio.wait_for(learned, 10) == 1
        async with pool.acquire() as conn:
            rows = await conn.fetch("SELECT endpoint_id::text FROM deliveries WHERE event_id = $1",
                                    uuid.UUID(event.id))
        assert [r[0] for r in rows] == [made.id]
