"""What the bus tests share: events to send, an effect table that counts applications, waiting."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable

import asyncpg
from nats.js import JetStreamContext, api

from shared.bus import ConsumerSpec, Handler
from shared.events import Envelope, MalformedEvent, RecordingCompleted, VideoCreated, new_event


def video_created() -> Envelope:
    vid = str(uuid.uuid4())
    return new_event(
        VideoCreated(video_id=vid, app_id=str(uuid.uuid4()), account_id=str(uuid.uuid4())),
        source="test",
        subject=vid,
    )


def recording_completed() -> Envelope:
    rid = str(uuid.uuid4())
    return new_event(
        RecordingCompleted(recording_id=rid, object_key=f"recordings/{rid}", size=1),
        source="test",
        subject=rid,
    )


async def create_effects(pool: asyncpg.Pool) -> None:
    async with pool.acquire() as conn:
        await conn.execute("CREATE TABLE IF NOT EXISTS effects (event_id uuid NOT NULL, at timestamptz DEFAULT now())")


async def record_effect(conn: asyncpg.Connection, event: Envelope) -> None:
    await conn.execute("INSERT INTO effects (event_id) VALUES ($1)", event.id)


async def effect_counts(pool: asyncpg.Pool, ids: list[str]) -> dict[str, int]:
    async with pool.acquire() as conn:
        rows = await conn.fetch(
            "SELECT event_id::text AS id, count(*) AS n FROM effects WHERE event_id = ANY($1::uuid[]) GROUP BY 1", ids
        )
    counts = {i: 0 for i in ids}
    counts.update({r["id"]: r["n"] for r in rows})
    return counts


def spec(
    name: str, handler: Handler, stream: str = "VIDEOS", subjects: tuple[str, ...] = ("video.created",)
) -> ConsumerSpec:
    return ConsumerSpec(name=name, stream=stream, subjects=subjects, handler=handler)


def unique(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:10]}"


async def eventually(check: Callable[[], Awaitable[bool]], timeout: float = 15.0, every: float = 0.05) -> None:
    """Poll until `check` holds, failing after `timeout` seconds (no fixed sleeps)."""
    deadline = time.monotonic() + timeout
    while True:
        if await check():
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        await asyncio.sleep(every)


async def stream_copies(js: JetStreamContext, stream: str, subject: str, msg_ids: set[str]) -> dict[str, int]:
    """How many messages of `subject` in `stream` carry each of these ids (read with an ephemeral consumer)."""
    counts = {i: 0 for i in msg_ids}
    sub = await js.pull_subscribe(
        subject, stream=stream,
        config=api.ConsumerConfig(ack_policy=api.AckPolicy.NONE, inactive_threshold=10.0, mem_storage=True),
    )
    try:
        pending = (await sub.consumer_info()).num_pending
        seen = 0
        while seen < pending:
            msgs = await sub.fetch(min(500, pending - seen), timeout=5)
            seen += len(msgs)
            for m in msgs:
                try:
                    env = Envelope.from_bytes(m.data)
                except MalformedEvent:  # another test's garbage
                    continue
                if env.id in counts:
                    counts[env.id] += 1
    finally:
        await sub.unsubscribe()
    return counts
