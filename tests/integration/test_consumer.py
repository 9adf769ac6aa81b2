"""The idempotent consumer (nats-py pulls) and replay against real JetStream and PostgreSQL."""

from __future__ import annotations

import random
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from datetime import UTC, datetime

import asyncpg
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api

from services.encode.app import consumers as encode_consumers
from services.encode.processing import Processing
from services.encode.settings import EncodeSettings
from shared.bus import (
    HDR_CONSUMER,
    HDR_DELIVERIES,
    HDR_ERROR,
    HDR_MSG_ID,
    HDR_REPROCESS,
    HDR_TYPE,
    connect,
)
from shared.consumer import ConsumerSpec
from shared.contracts import replay_subject
from shared.events import Envelope, Event, RecordingCompleted, UploadCompleted, VideoCreated, dlq_subject, new_event
from shared.messaging import tool_broker
from shared.publishers import EventPublishers
from shared.replay import replay
from shared.runtime import Runtime
from shared.settings import CommonSettings
from shared.streams import apply_streams
from shared.videos import JobClass
from tests.integration.bushelpers import (
    SETTLE_S,
    consumer_idle,
    consuming,
    create_effects,
    effect_counts,
    record_effect,
    record_recording,
    recording_completed,
    spec,
    unique,
    video_created,
)
from tests.integration.privatenats import running_private_nats, wait_until_up
from tests.waiting import wait_for


async def test_handler_crashing_midway_is_redelivered_and_applied_once(
    schema_pool: tuple[str, asyncpg.Pool], nc: NATS, prepared: CommonSettings
) -> None:
    _, pool = schema_pool
    await create_effects(pool)
    settings = prepared.model_copy(update={"consumer_nak_delay_seconds": 0.05})
    event = video_created()
    attempts: Counter[str] = Counter()

    async def flaky(conn: asyncpg.Connection, ev: Event[VideoCreated]) -> None:
        await record_effect(conn, ev)  # the effect is written...
        attempts[ev.id] += 1
        if ev.id == event.id and attempts[ev.id] < 3:
            raise RuntimeError("crash after part of the work")  # ...then the handler dies

    name = unique("c")
    async with consuming(settings, pool, spec(name, flaky)):
        await nc.jetstream().publish("video.created", event.to_bytes(), headers={"Nats-Msg-Id": event.id})
        await wait_for(lambda: _has(pool, event.id, 1), SETTLE_S, "the event handled once")
        await wait_for(lambda: consumer_idle(nc.jetstream(), "VIDEOS", name), SETTLE_S, "the consumer idle")
    assert attempts[event.id] == 3
    assert (await effect_counts(pool, [event.id]))[event.id] == 1


async def test_poison_message_is_parked_on_dlq_after_max_deliver(
    schema_pool: tuple[str, asyncpg.Pool], nc: NATS, prepared: CommonSettings
) -> None:
    _, pool = schema_pool
    settings = prepared.model_copy(update={"consumer_nak_delay_seconds": 0.05, "consumer_max_deliver": 3})
    js = nc.jetstream()
    poison = video_created()
    calls: Counter[str] = Counter()

    async def always_fails(conn: asyncpg.Connection, ev: Event[VideoCreated]) -> None:
        calls[ev.id] += 1
        if ev.id == poison.id:
            raise ValueError("cannot handle this one")

    name = unique("c")
    dlq = await js.pull_subscribe(
        dlq_subject("video.created"), stream="DLQ",
        config=api.ConsumerConfig(deliver_policy=api.DeliverPolicy.NEW, ack_policy=api.AckPolicy.NONE),
    )
    async with consuming(settings, pool, spec(name, always_fails)):
        await js.publish("video.created", poison.to_bytes(), headers={"Nats-Msg-Id": poison.id})
        # a message that is not even an envelope is parked the same way, at once
        await js.publish("video.created", b"{not json", headers={"Nats-Msg-Id": unique("garbage")})
        parked: list[Msg] = []
        while len(parked) < 2:
            parked += await dlq.fetch(2 - len(parked), timeout=15)
        await wait_for(lambda: consumer_idle(js, "VIDEOS", name), SETTLE_S, "the consumer idle")
    # every delivery ran the handler (alone, or first within its batch's transaction too)
    assert calls[poison.id] >= settings.consumer_max_deliver
    by_body = {m.data: m for m in parked}
    assert set(by_body) == {poison.to_bytes(), b"{not json"}
    for m in parked:
        assert m.headers is not None and m.headers[HDR_CONSUMER] == name
        assert m.headers[HDR_ERROR]
    poison_headers = by_body[poison.to_bytes()].headers or {}
    assert "cannot handle this one" in poison_headers[HDR_ERROR]
    assert poison_headers[HDR_DELIVERIES] == str(settings.consumer_max_deliver)
    assert (by_body[b"{not json"].headers or {})[HDR_DELIVERIES] == "1"  # never retried: it cannot get better
    info = await js.consumer_info("VIDEOS", name)
    assert info.num_ack_pending == 0 and info.num_redelivered == 0  # acknowledged, not retried forever


async def test_malformed_upload_completed_is_parked_at_once_and_the_next_event_is_handled(
    schema_pool: tuple[str, asyncpg.Pool], nc: NATS, prepared: CommonSettings
) -> None:
    """encode's own upload handler on the real VIDEOS stream: an envelope whose data fails UploadCompleted goes to
    dlq.upload.completed with the validation error after one delivery, and the upload after it is opened."""
    _, pool = schema_pool
    js = nc.jetstream()
    opened: list[str] = []

    class OpensOnly(Processing):  # encode's processing as far as its upload handler reaches: `open`, recorded
        async def open(self, conn: asyncpg.Connection, *, video_id: str, job_class: JobClass, object_key: str,
                       source_height: int | None, **_: object) -> None:
            opened.append(video_id)

    rt = Runtime(definition=None, settings=EncodeSettings(), metrics=None)  # type: ignore[arg-type]
    rt.parts = OpensOnly(settings=EncodeSettings(), pool=None, farm=None, s3=None)  # type: ignore[arg-type]
    (uploads,) = [c for c in encode_consumers(rt) if c.name == "encode_uploads"]
    name = unique("uploads")
    good, bad = _upload(), _upload()
    bad_data = {**bad.data, "size": "a lot"}  # the envelope is fine; its data is not an UploadCompleted
    malformed = Envelope.model_validate({**bad.model_dump(), "data": bad_data}).to_bytes()

    dlq = await js.pull_subscribe(
        dlq_subject("upload.completed"), stream="DLQ",
        config=api.ConsumerConfig(deliver_policy=api.DeliverPolicy.NEW, ack_policy=api.AckPolicy.NONE),
    )
    async with consuming(prepared, pool, ConsumerSpec(name=name, handler=uploads.handler), from_now=True) as (c,):
        assert c.broker is not None and not c.broker.subscribers  # the pulls are nats-py's, not FastStream's
        await js.publish("upload.completed", malformed, headers={HDR_MSG_ID: bad.id})
        await js.publish("upload.completed", good.to_bytes(), headers={HDR_MSG_ID: good.id})
        parked: list[Msg] = []
        while not parked:
            parked += [m for m in await dlq.fetch(1, timeout=15) if m.data == malformed]
        await wait_for(lambda: _opened(opened, good.data["video_id"]), SETTLE_S, "the good event handled")
        await wait_for(lambda: consumer_idle(js, "VIDEOS", name), SETTLE_S, "the consumer idle")
    headers = parked[0].headers or {}
    assert headers[HDR_CONSUMER] == name and headers[HDR_DELIVERIES] == "1"
    assert "data.size" in headers[HDR_ERROR] and "integer" in headers[HDR_ERROR]
    assert bad.data["video_id"] not in opened
    info = await js.consumer_info("VIDEOS", name)
    assert info.num_ack_pending == 0 and info.num_redelivered == 0
    async with pool.acquire() as conn:  # the inbox knows the good one only
        handled = {r[0] for r in await conn.fetch("SELECT event_id::text FROM inbox WHERE consumer = $1", name)}
    assert handled == {good.id}


async def test_replay_delivers_exactly_the_slice_and_changes_nothing_unless_reprocess(
    schema_pool: tuple[str, asyncpg.Pool], nc: NATS, prepared: CommonSettings
) -> None:
    _, pool = schema_pool
    await create_effects(pool)
    js = nc.jetstream()
    name = unique("c")
    async with consuming(prepared, pool, spec(name, record_recording)), tool_broker(prepared, "test-replay") as tool:
        # what `weir replay` does: the copies through a FastStream publisher on its own broker, PubAck awaited
        publishers = EventPublishers(tool, replay=True, timeout=prepared.bus_publish_timeout_seconds)
        batches: list[list[Envelope]] = []
        marks: list[datetime] = []
        for _ in range(3):
            marks.append(datetime.now(UTC))
            batch = [recording_completed() for _ in range(7)]
            for ev in batch:
                await js.publish("recording.completed", ev.to_bytes(), headers={"Nats-Msg-Id": ev.id})
            batches.append(batch)
        marks.append(datetime.now(UTC))
        every = [e.id for b in batches for e in b]
        await wait_for(lambda: _all(pool, every, 1), SETTLE_S, "every event handled once")

        middle = [e.id for e in batches[1]]
        args = {"stream": "RECORDINGS", "subject": "recording.completed", "since": marks[1], "until": marks[2]}
        dry = await replay(publishers, **args, to=[name], dry_run=True)  # type: ignore[arg-type]
        assert dry.matched == len(middle) and dry.delivered == {name: 0}

        again = await replay(publishers, **args, to=[name])  # type: ignore[arg-type]
        assert again.matched == len(middle) and again.delivered == {name: len(middle)}
        copy = await js.get_last_msg("REPLAY", replay_subject(name, "recording.completed"))
        assert Envelope.from_bytes(copy.data).id == middle[-1]  # the event as stored, in stream order
        assert copy.headers is not None
        assert copy.headers[HDR_TYPE] == "recording.completed" and copy.headers[HDR_REPROCESS] == "0"
        assert copy.headers[HDR_MSG_ID].startswith(f"replay-{again.replay_id}-{name}-")  # then the stored sequence
        await wait_for(lambda: consumer_idle(js, "REPLAY", f"{name}_replay", started=True), SETTLE_S,
                       "the replay consumer idle")
        assert set((await effect_counts(pool, every)).values()) == {1}  # handled before: nothing changes

        redo = await replay(publishers, **args, to=[name], reprocess=True)  # type: ignore[arg-type]
        assert redo.matched == len(middle)
        await wait_for(lambda: _all(pool, middle, 2), SETTLE_S, "the replayed events handled twice")
        counts = await effect_counts(pool, every)
        assert {i: counts[i] for i in middle} == dict.fromkeys(middle, 2)  # exactly the slice ran again
        assert all(counts[i] == 1 for i in every if i not in middle)


async def test_events_of_one_entity_are_applied_in_stream_order(
    schema_pool: tuple[str, asyncpg.Pool], nc: NATS, prepared: CommonSettings
) -> None:
    """Lanes by entity: batches split into lanes that run side by side, each handler taking a varying time, and
    every entity's events still apply in the order they were stored (within a batch and across batches)."""
    _, pool = schema_pool
    settings = prepared.model_copy(update={"consumer_batch": 16, "consumer_lanes": 4})
    js = nc.jetstream()
    seen: dict[str, list[int]] = {}

    async def record_order(conn: asyncpg.Connection, ev: Event[RecordingCompleted]) -> None:
        await conn.execute("SELECT pg_sleep($1)", random.uniform(0, 0.004))  # work that takes a varying time
        seen.setdefault(ev.subject, []).append(ev.data.size)

    entities = [str(uuid.uuid4()) for _ in range(12)]
    name = unique("order")
    async with consuming(settings, pool, spec(name, record_order), from_now=True):
        for position in range(1, 6):  # entity-interleaved: 12 entities x 5 events each
            for entity in entities:
                ev = new_event(RecordingCompleted(recording_id=entity, object_key="k", size=position),
                               source="test", subject=entity)
                await js.publish("recording.completed", ev.to_bytes(), headers={HDR_MSG_ID: ev.id})
        await wait_for(lambda: _count(seen, len(entities) * 5), SETTLE_S, "every event seen")
        await wait_for(lambda: consumer_idle(js, "RECORDINGS", name), SETTLE_S, "the consumer idle")
    assert {entity: seen[entity] for entity in entities} == {entity: [1, 2, 3, 4, 5] for entity in entities}


async def test_a_consumer_whose_stream_is_not_there_yet_binds_once_it_is(
    schema_pool: tuple[str, asyncpg.Pool], prepared: CommonSettings
) -> None:
    """A service started before `weir streams apply` runs (its consumer cannot make its durable), and the consumer
    binds and consumes once the streams exist; it never makes a stream itself."""
    _, pool = schema_pool
    await create_effects(pool)
    with running_private_nats() as server:
        await wait_until_up(server.url)
        settings = prepared.model_copy(update={"nats_url": server.url, "consumer_fetch_wait_seconds": 0.2})
        name = unique("late")
        async with consuming(settings, pool, spec(name, record_effect)):
            nc = await connect(settings, name="test-late")
            try:
                js = nc.jetstream()
                assert [s.config.name async for s in _streams(js)] == []  # the subscriber made none
                await apply_streams(js, settings)
                event = video_created()
                await js.publish("video.created", event.to_bytes(), headers={HDR_MSG_ID: event.id})
                await wait_for(lambda: _has(pool, event.id, 1), SETTLE_S, "the event handled once")
            finally:
                await nc.close()


async def _streams(js: JetStreamContext) -> AsyncIterator[api.StreamInfo]:
    for info in await js.streams_info():
        yield info


def _upload() -> Envelope:
    vid = str(uuid.uuid4())
    return new_event(UploadCompleted(video_id=vid, app_id=vid, account_id=vid, key_id=vid, object_key=f"s/{vid}",
                                     size=1, content_type="video/mp4", source_height=None),
                     source="test", subject=vid)


async def _opened(opened: list[str], video_id: str) -> bool:
    return video_id in opened


async def _count(seen: dict[str, list[int]], n: int) -> bool:
    return sum(len(v) for v in seen.values()) >= n


async def _has(pool: asyncpg.Pool, event_id: str, n: int) -> bool:
    return (await effect_counts(pool, [event_id]))[event_id] == n


async def _all(pool: asyncpg.Pool, ids: list[str], n: int) -> bool:
    return set((await effect_counts(pool, ids)).values()) == {n}
