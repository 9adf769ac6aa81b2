"""The idempotent consumer and replay against real JetStream and PostgreSQL."""

from __future__ import annotations

import asyncio
from collections import Counter
from datetime import UTC, datetime

import asyncpg
from nats.aio.client import Client as NATS
from nats.js import api
from nats.js.errors import NotFoundError

from shared.bus import HDR_CONSUMER, HDR_DELIVERIES, HDR_ERROR, IdempotentConsumer
from shared.events import Envelope, dlq_subject
from shared.replay import replay
from shared.settings import CommonSettings
from tests.integration.bushelpers import (
    create_effects,
    effect_counts,
    eventually,
    record_effect,
    recording_completed,
    spec,
    unique,
    video_created,
)


async def test_handler_crashing_midway_is_redelivered_and_applied_once(
    schema_pool: tuple[str, asyncpg.Pool], nc: NATS, prepared: CommonSettings
) -> None:
    _, pool = schema_pool
    await create_effects(pool)
    settings = prepared.model_copy(update={"consumer_nak_delay_seconds": 0.05})
    event = video_created()
    attempts: Counter[str] = Counter()

    async def flaky(conn: asyncpg.Connection, ev: Envelope) -> None:
        await record_effect(conn, ev)  # the effect is written...
        attempts[ev.id] += 1
        if ev.id == event.id and attempts[ev.id] < 3:
            raise RuntimeError("crash after part of the work")  # ...then the handler dies

    consumer = IdempotentConsumer(spec(unique("c"), flaky), js=nc.jetstream(), pool=pool, settings=settings)
    stop = asyncio.Event()
    task = asyncio.create_task(consumer.run(stop))
    try:
        await nc.jetstream().publish("video.created", event.to_bytes(), headers={"Nats-Msg-Id": event.id})
        await eventually(lambda: _has(pool, event.id, 1))
        await eventually(lambda: _idle(consumer))
    finally:
        stop.set()
        await task
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

    async def always_fails(conn: asyncpg.Connection, ev: Envelope) -> None:
        calls[ev.id] += 1
        if ev.id == poison.id:
            raise ValueError("cannot handle this one")

    name = unique("c")
    dlq = await js.pull_subscribe(
        dlq_subject("video.created"), stream="DLQ",
        config=api.ConsumerConfig(deliver_policy=api.DeliverPolicy.NEW, ack_policy=api.AckPolicy.NONE),
    )
    consumer = IdempotentConsumer(spec(name, always_fails), js=js, pool=pool, settings=settings)
    stop = asyncio.Event()
    task = asyncio.create_task(consumer.run(stop))
    try:
        await js.publish("video.created", poison.to_bytes(), headers={"Nats-Msg-Id": poison.id})
        # a message that is not even an envelope is parked the same way
        await js.publish("video.created", b"{not json", headers={"Nats-Msg-Id": unique("garbage")})
        parked = []
        while len(parked) < 2:
            parked += await dlq.fetch(2 - len(parked), timeout=15)
        await eventually(lambda: _idle(consumer))
    finally:
        stop.set()
        await task
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
    info = await js.consumer_info("VIDEOS", name)
    assert info.num_ack_pending == 0 and info.num_redelivered == 0  # acknowledged, not retried forever


async def test_replay_delivers_exactly_the_slice_and_changes_nothing_unless_reprocess(
    schema_pool: tuple[str, asyncpg.Pool], nc: NATS, prepared: CommonSettings
) -> None:
    _, pool = schema_pool
    await create_effects(pool)
    js = nc.jetstream()
    name = unique("c")
    consumer = IdempotentConsumer(
        spec(name, record_effect, stream="RECORDINGS", subjects=("recording.completed",)),
        js=js, pool=pool, settings=prepared,
    )
    stop = asyncio.Event()
    task = asyncio.create_task(consumer.run(stop))
    try:
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
        await eventually(lambda: _all(pool, every, 1))

        middle = [e.id for e in batches[1]]
        args = {"stream": "RECORDINGS", "subject": "recording.completed", "since": marks[1], "until": marks[2]}
        dry = await replay(js, **args, to=[name], dry_run=True)  # type: ignore[arg-type]
        assert dry.matched == len(middle) and dry.delivered == {name: 0}

        again = await replay(js, **args, to=[name])  # type: ignore[arg-type]
        assert again.matched == len(middle) and again.delivered == {name: len(middle)}
        await eventually(lambda: _idle(consumer, f"{name}_replay", "REPLAY"))
        assert set((await effect_counts(pool, every)).values()) == {1}  # handled before: nothing changes

        redo = await replay(js, **args, to=[name], reprocess=True)  # type: ignore[arg-type]
        assert redo.matched == len(middle)
        await eventually(lambda: _all(pool, middle, 2))
        counts = await effect_counts(pool, every)
        assert {i: counts[i] for i in middle} == dict.fromkeys(middle, 2)  # exactly the slice ran again
        assert all(counts[i] == 1 for i in every if i not in middle)
    finally:
        stop.set()
        await task


async def _has(pool: asyncpg.Pool, event_id: str, n: int) -> bool:
    return (await effect_counts(pool, [event_id]))[event_id] == n


async def _all(pool: asyncpg.Pool, ids: list[str], n: int) -> bool:
    return set((await effect_counts(pool, ids)).values()) == {n}


async def _idle(consumer: IdempotentConsumer, durable: str | None = None, stream: str | None = None) -> bool:
    try:
        info = await consumer.js.consumer_info(stream or consumer.spec.stream, durable or consumer.spec.name)
    except NotFoundError:  # not created yet
        return False
    return info.num_pending == 0 and info.num_ack_pending == 0
