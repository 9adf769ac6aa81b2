"""`weir rebuild api-status`: the api's status projection, cleared, rebuilt from the start of the ENCODE stream by
the operator's CLI and swapped in while the consumer keeps running (real JetStream and PostgreSQL)."""

from __future__ import annotations

import uuid
from typing import Any

import asyncpg
from nats.aio.client import Client as NATS

from services.api import store
from services.api.app import project_encode_event
from shared.bus import HDR_MSG_ID
from shared.consumer import ConsumerSpec
from shared.events import EncodeCompleted, EncodeFailed, EncodeStarted, EventData, new_event
from shared.outbox import bus_subject
from shared.settings import CommonSettings
from tests.conftest import fresh_schema
from tests.integration.bushelpers import SETTLE_S, consuming, unique
from tests.integration.test_dlq_cli import cli
from tests.waiting import wait_for

PROJECTED = "status, processing, renditions, failure_reason, failure_message, artwork"


async def projected(pool: asyncpg.Pool, ids: list[str]) -> dict[str, tuple[Any, ...]]:
    async with pool.acquire() as conn:
        rows = await conn.fetch(f"SELECT id::text, {PROJECTED} FROM videos WHERE id = ANY($1::uuid[])", ids)
    return {r[0]: tuple(r[1:]) for r in rows}


async def test_a_cleared_status_projection_is_rebuilt_from_the_stream(
    nc: NATS, prepared: CommonSettings, stack_env: dict[str, str],
) -> None:
    js = nc.jetstream()
    async with fresh_schema(prepared.database_url, "api") as (schema, pool):
        account = str(uuid.uuid4())
        async with pool.acquire() as conn:
            videos = [await store.create(conn, app_id=str(uuid.uuid4()), account_id=account, key_id=str(uuid.uuid4()),
                                         name=f"v{i}", metadata=None) for i in range(2)]
            await conn.execute("UPDATE videos SET status = 'uploaded'")  # its upload completed
        done, failed = (v.id for v in videos)
        data: list[EventData] = [
            EncodeStarted(video_id=done, output=720, worker="w1", account_id=account),
            EncodeStarted(video_id=done, output=360, worker="w2", account_id=account),
            EncodeCompleted(video_id=done, output=360, worker="w2", object_key=str(uuid.uuid4()), size=10,
                            outputs_remaining=1, account_id=account),
            EncodeCompleted(video_id=done, output=720, worker="w1", object_key=str(uuid.uuid4()), size=20,
                            outputs_remaining=0, account_id=account),
            EncodeStarted(video_id=failed, output=720, worker="w1", account_id=account),
            EncodeFailed(video_id=failed, output=None, worker=None, reason="deadline", message="took too long",
                         account_id=account),
        ]
        events = [new_event(d, source="encode", subject=d.video_id) for d in data]  # type: ignore[attr-defined]
        name = unique("status")
        async with consuming(prepared, pool, ConsumerSpec(name=name, handler=project_encode_event), from_now=True):
            for ev in events:
                await js.publish(bus_subject(ev) or ev.type, ev.to_bytes(), headers={HDR_MSG_ID: ev.id})

            async def all_handled() -> bool:
                async with pool.acquire() as conn:
                    return int(await conn.fetchval("SELECT count(*) FROM inbox WHERE consumer = $1", name)) == len(
                        events)

            await wait_for(all_handled, SETTLE_S, "every encode event handled")
            before = await projected(pool, [done, failed])
            assert before[done][0] == "ready" and before[failed][0] == "failed"  # what the consumer made of them

            async with pool.acquire() as conn:  # the projection lost
                await conn.execute("UPDATE videos SET status = 'uploaded', processing = NULL, renditions = '[]',"
                                   " failure_reason = NULL, failure_message = NULL, artwork = NULL")
            assert (await projected(pool, [done]))[done] != before[done]

            result = await cli(stack_env, "rebuild", "api-status", "--schema", schema, "--consumer", name)
            assert result.returncode == 0, result.stdout + result.stderr
            assert "rebuilt and swapped in 2 videos" in result.stdout, result.stdout
            assert await projected(pool, [done, failed]) == before
            async with pool.acquire() as conn:  # the fresh table went with the swap
                assert await conn.fetchval("SELECT count(*) FROM pg_tables WHERE schemaname = $1 AND tablename"
                                           " LIKE 'status_rebuild_%'", schema) == 0

            # the consumer goes on from there: a later event is applied on the rebuilt projection
            later = new_event(EncodeStarted(video_id=done, output=1080, worker="w3", account_id=account),
                              source="encode", subject=done)
            await js.publish(bus_subject(later) or later.type, later.to_bytes(), headers={HDR_MSG_ID: later.id})

            async def shows_1080() -> bool:
                processing = (await projected(pool, [done]))[done][1]
                return processing is not None and '"height": 1080' in processing

            await wait_for(shows_1080, SETTLE_S, "the later event applied")
