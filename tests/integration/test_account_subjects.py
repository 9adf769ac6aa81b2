"""Public events move onto their account's subject (`video.created.<account_id>`, SPEC 12) the way SPEC 11 ships a
subject change, the old beside the new for a release: `weir streams apply` (and each consumer of this release as it
starts) widens a durable of the release before from the bare type to both subjects, so the consumer of the release
before, reading through that durable, gets every event on the account subject; this release's consumers read both,
so an event the release before published on the bare type is applied too. A marked copy on the bare type
(WEIR_EVENTS_LEGACY_SUBJECTS) is there for a durable nobody widens. On real PostgreSQL and JetStream."""

from __future__ import annotations

import contextlib
import json
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest
from nats.aio.client import Client as NATS
from nats.js import api
from nats.js.errors import NotFoundError

from shared.bus import HDR_ORIGINAL_SUBJECT
from shared.consumer import EventConsumer, apply_service_durables
from shared.contracts import contract, replay_filter
from shared.events import Event, VideoCreated
from shared.outbox import enqueue
from shared.publishers import EventPublishers
from shared.replay import replay
from shared.settings import CommonSettings
from tests.integration.bushelpers import (
    SETTLE_S,
    consumer_idle,
    consuming,
    create_effects,
    effect_counts,
    record_effect,
    relay_broker,
    relay_for,
    spec,
    stream_copies,
    unique,
    video_created,
)
from tests.stored import stored_messages
from tests.waiting import wait_for


async def _applied(pool: asyncpg.Pool, ids: list[str]) -> bool:
    return set((await effect_counts(pool, ids)).values()) == {1}


async def old_durable(nc: NATS, name: str) -> None:
    """The durable as 1.0.0 made it: its filter is the bare type."""
    await nc.jetstream().add_consumer("VIDEOS", api.ConsumerConfig(
        durable_name=name, name=name, ack_policy=api.AckPolicy.EXPLICIT, filter_subject="video.created",
        deliver_policy=api.DeliverPolicy.NEW))


async def test_the_operator_widens_the_durables_of_the_release_before_so_they_read_the_account_subjects(
    schema_pool: tuple[str, asyncpg.Pool], nc: NATS, prepared: CommonSettings
) -> None:
    """`weir streams apply` widens every declared service durable (never narrows it); 1.0.0's consumer, pulling from
    it, then gets each event on its account subject, with no copy published."""
    schema, pool = schema_pool
    js = nc.jetstream()
    declared = "encode_videos"  # a durable of this release's declaration, as an earlier release left it
    with contextlib.suppress(NotFoundError):
        await js.delete_consumer("VIDEOS", declared)
    await old_durable(nc, declared)
    try:
        done = await apply_service_durables(js, prepared)
        assert f"widened durable {declared}" in done
        info = await js.consumer_info("VIDEOS", declared)
        assert sorted(info.config.filter_subjects or []) == sorted(contract("video.created").subjects)
        assert await apply_service_durables(js, prepared) == []  # nothing more to do: never narrowed, never again
        events = [video_created() for _ in range(3)]
        async with pool.acquire() as conn, conn.transaction():
            await enqueue(conn, *events)
        async with relay_broker(prepared, ["video.created"]) as publishers:
            assert await relay_for(pool, publishers, schema, prepared).drain_once() == len(events)
        sub = await js.pull_subscribe_bind(durable=declared, stream="VIDEOS")  # as 1.0.0's consumer pulls it
        got = [m for m in await sub.fetch(len(events) + 10, timeout=5) if m.subject.startswith("video.created.")]
        await sub.unsubscribe()
        mine = {e.id for e in events}
        assert sorted(m.subject for m in got if json.loads(m.data)["id"] in mine) == sorted(
            f"video.created.{e.data['account_id']}" for e in events)
        assert (await stream_copies(js, "VIDEOS", "video.created", mine)) == dict.fromkeys(mine, 0)  # no copy
    finally:
        await js.delete_consumer("VIDEOS", declared)
        await apply_service_durables(js, prepared)  # as the session's stack had it


async def test_with_the_copies_on_a_durable_nobody_widens_gets_them_and_this_release_skips_them(
    schema_pool: tuple[str, asyncpg.Pool], nc: NATS, prepared: CommonSettings
) -> None:
    """WEIR_EVENTS_LEGACY_SUBJECTS: a durable of 1.0.0 that no apply widened (one Weir does not declare) gets the
    copies on the bare type; once this release's consumer widens it, it skips them and applies each event once."""
    schema, pool = schema_pool
    await create_effects(pool)
    js = nc.jetstream()
    name = unique("moved")
    await old_durable(nc, name)
    events = [video_created() for _ in range(4)]
    async with pool.acquire() as conn, conn.transaction():
        await enqueue(conn, *events)
    async with relay_broker(prepared, ["video.created"]) as publishers:
        relay = relay_for(pool, publishers, schema, prepared)
        relay.legacy_copies = True
        assert await relay.drain_once() == len(events)
    ids = [e.id for e in events]
    # what 1.0.0's durable reads: one message per event, the copy on the bare type
    assert set((await stream_copies(js, "VIDEOS", "video.created", set(ids))).values()) == {1}

    async with consuming(prepared, pool, spec(name, record_effect)) as _:
        await wait_for(lambda: _applied(pool, ids), SETTLE_S, "every event applied")
        info = await js.consumer_info("VIDEOS", name)
        assert sorted(info.config.filter_subjects or []) == sorted(["video.created", "video.created.*"])
        later = [video_created() for _ in range(3)]  # now on both subjects of the widened durable
        async with pool.acquire() as conn, conn.transaction():
            await enqueue(conn, *later)
        async with relay_broker(prepared, ["video.created"]) as publishers:
            relay = relay_for(pool, publishers, schema, prepared)
            relay.legacy_copies = True
            assert await relay.drain_once() == len(later)
        ids += [e.id for e in later]
        await wait_for(lambda: _applied(pool, ids), SETTLE_S, "the later events applied")
        await wait_for(lambda: consumer_idle(js, "VIDEOS", name), SETTLE_S, "the durable idle")
    assert set((await effect_counts(pool, ids)).values()) == {1}  # never twice, though each came on two subjects


async def test_by_default_only_the_account_subject_is_published(
    schema_pool: tuple[str, asyncpg.Pool], nc: NATS, prepared: CommonSettings
) -> None:
    """WEIR_EVENTS_LEGACY_SUBJECTS off (the default): no copy on the bare type."""
    schema, pool = schema_pool
    assert not prepared.events_legacy_subjects
    event = video_created()
    async with pool.acquire() as conn, conn.transaction():
        await enqueue(conn, event)
    async with relay_broker(prepared, ["video.created"]) as publishers:
        relay = relay_for(pool, publishers, schema, prepared)
        assert not relay.legacy_copies
        assert await relay.drain_once() == 1
    js = nc.jetstream()
    assert (await stream_copies(js, "VIDEOS", f"video.created.{event.data['account_id']}", {event.id}))[event.id] == 1
    assert (await stream_copies(js, "VIDEOS", "video.created", {event.id}))[event.id] == 0


async def test_an_event_of_the_release_before_on_the_bare_type_is_still_applied(
    schema_pool: tuple[str, asyncpg.Pool], nc: NATS, prepared: CommonSettings
) -> None:
    """1.0.0's relay publishes the bare type alone, without the copy mark: this release's consumer applies it."""
    _, pool = schema_pool
    await create_effects(pool)
    event = video_created()
    name = unique("old_pub")
    async with consuming(prepared, pool, spec(name, record_effect), from_now=True):
        await nc.jetstream().publish("video.created", event.to_bytes(), headers={"Nats-Msg-Id": event.id})
        await wait_for(lambda: _applied(pool, [event.id]), SETTLE_S, "the event of 1.0.0 applied")


async def test_replaying_a_type_delivers_each_event_once_with_the_subject_it_was_published_on(
    schema_pool: tuple[str, asyncpg.Pool], nc: NATS, prepared: CommonSettings
) -> None:
    """`weir replay --subject video.created` takes every account's subject and skips the copies; a handler that asks
    for the subject gets the one the event was published on (the account's), not the replay subject."""
    schema, pool = schema_pool
    await create_effects(pool)
    seen: dict[str, list[str]] = {}  # event id -> the subjects its handler was given

    async def origin_recorded(conn: asyncpg.Connection, event: Event[VideoCreated], origin: str) -> None:
        seen.setdefault(event.id, []).append(origin)
        await record_effect(conn, event)

    name = unique("replayed")
    events = [video_created() for _ in range(3)]
    async with consuming(prepared, pool, spec(name, origin_recorded), from_now=True) as (consumer,):
        assert isinstance(consumer, EventConsumer)
        async with pool.acquire() as conn, conn.transaction():
            await enqueue(conn, *events)
        since = datetime.now(UTC) - timedelta(seconds=1)
        async with relay_broker(prepared, ["video.created"]) as publishers:
            assert await relay_for(pool, publishers, schema, prepared).drain_once() == len(events)
        ids = [e.id for e in events]
        await wait_for(lambda: _applied(pool, ids), SETTLE_S, "the events applied")
        published_on = {e.id: f"video.created.{e.data['account_id']}" for e in events}
        assert {i: seen[i] for i in ids} == {i: [published_on[i]] for i in ids}  # the copies skipped
        async with relay_broker(prepared, []) as publishers:
            replay_publishers = EventPublishers(publishers.broker, timeout=publishers.timeout, replay=True)
            await replay(replay_publishers, stream="VIDEOS", subject="video.created", since=since, to=[name],
                         reprocess=True)
        copies = await stored_messages(nc.jetstream(), "REPLAY", replay_filter(name))
        mine = {i: [m for m in copies if i.encode() in m.data] for i in ids}
        assert {i: len(found) for i, found in mine.items()} == {i: 1 for i in ids}  # not the copies on the bare type
        assert {i: (found[0].headers or {}).get(HDR_ORIGINAL_SUBJECT) for i, found in mine.items()} == published_on

        async def replayed() -> bool:
            return all(len(seen[i]) == 2 for i in ids)

        await wait_for(replayed, SETTLE_S, "the replayed events handled again")
        assert {i: seen[i] for i in ids} == {i: [published_on[i]] * 2 for i in ids}


@pytest.mark.parametrize("event_type", ["video.created", "upload.completed", "encode.progress"])
def test_each_public_event_is_read_on_both_subjects_for_one_release(event_type: str) -> None:
    assert contract(event_type).subjects == (f"{event_type}.*", event_type)
