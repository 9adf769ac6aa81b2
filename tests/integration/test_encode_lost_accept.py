"""encode's answer to a result for an output whose acceptance it never recorded (real PostgreSQL, in process).

encode commits an offer (the output `offered`, a new attempt) before sending it. If encode is killed after the worker
accepted but before encode recorded the acceptance with its `encode.started`, and the job is done before any
heartbeat reports it running, the worker's result is the first word encode has of it. The output is then started and
completed in one transaction: each output still has exactly one `encode.started`, before its `encode.completed`.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime

import asyncpg
import pytest

from services.encode import store
from services.encode.farm import Farm, Registry
from services.encode.processing import Processing, event
from services.encode.settings import EncodeSettings
from shared.events import EncodeStarted, Envelope
from shared.media.protocol import OutputResult
from shared.messaging import make_broker
from shared.outbox import enqueue
from shared.settings import CommonSettings
from shared.videos import JobClass
from tests.conftest import fresh_schema


@pytest.fixture
async def encode_pool(prepared: CommonSettings) -> AsyncIterator[asyncpg.Pool]:
    async with fresh_schema(prepared.database_url, "encode", max_size=4) as (_, pool):
        yield pool


async def _outbox(pool: asyncpg.Pool, video_id: str) -> list[Envelope]:
    rows = await pool.fetch("SELECT payload FROM outbox ORDER BY seq")
    events = [Envelope.from_bytes(r["payload"]) for r in rows]
    return [e for e in events if e.data.get("video_id") == video_id]


@pytest.mark.parametrize("accepted_first", [False, True])
async def test_a_result_for_an_offer_never_seen_accepted_starts_it_once(
    encode_pool: asyncpg.Pool, prepared: CommonSettings, accepted_first: bool
) -> None:
    settings = EncodeSettings(nats_url=prepared.nats_url, database_url=prepared.database_url,
                              nats_nkey_seed_dir=prepared.nats_nkey_seed_dir, nats_identity=prepared.nats_identity)
    farm = Farm.declare(make_broker(settings, name="encode"),  # never connected: this test offers nothing
                        Registry(timeout_seconds=settings.media_heartbeat_timeout_seconds,
                                 large_height=settings.large_output_height),
                        answer_timeout=settings.dispatch_answer_timeout_ms / 1000)
    processing = Processing(settings=settings, pool=encode_pool, farm=farm, s3=None)
    video_id = str(uuid.uuid4())
    now = datetime.now(UTC)
    async with encode_pool.acquire() as conn, conn.transaction():
        await processing.open(conn, video_id=video_id, job_class=JobClass.DEVELOPER, object_key=f"sources/{video_id}",
                              source_height=360)
        attempts = await store.mark_offered(conn, video_id, [360], now)
        if accepted_first:  # the usual order: the acceptance (and its encode.started) was recorded
            assert await processing_accept(conn, video_id, attempts[360], now)
    result = OutputResult(video_id=video_id, output=360, attempt=attempts[360], worker="media-1", instance="i-1",
                          outcome="completed", object_key=f"renditions/{video_id}/360p.mp4", size=1000,
                          finished_at=now)
    ack = await processing.apply_result(result)
    assert ack.applied
    again = await processing.apply_result(result)  # the worker sends it again (its ack was lost): nothing new
    assert not again.applied
    kinds = [e.type for e in await _outbox(encode_pool, video_id)]
    assert kinds == ["encode.started", "encode.completed"]
    async with encode_pool.acquire() as conn:
        video = await store.load(conn, video_id)
    assert video is not None and video.state.value == "ready"


async def processing_accept(conn: asyncpg.Connection, video_id: str, attempt: int, now: datetime) -> bool:
    """What a round does with an accepted answer: the output encoding, and its encode.started, in one transaction."""
    moved = await store.accept(conn, video_id, 360, attempt, worker="media-1", instance="i-1", now=now)
    if moved:
        await enqueue(conn, event(EncodeStarted(video_id=video_id, output=360, worker="media-1"), video_id))
    return moved
