"""The trace context through the outbox, against real PostgreSQL and JetStream (in process, spans kept in memory):
the row and the envelope carry the writer's traceparent, the relay publishes it in that trace, and the consumer's
handling joins it."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import asyncpg
import pytest

from shared import tracing
from shared.bus import connect
from shared.events import Envelope
from shared.headers import HDR_LEGACY_COPY
from shared.outbox import enqueue
from shared.settings import CommonSettings
from tests.integration.bushelpers import (
    SETTLE_S,
    consuming,
    create_effects,
    record_effect,
    relay_broker,
    relay_for,
    spec,
    unique,
    video_created,
)
from tests.spans import Kept, kept_in_memory
from tests.stored import stored_events
from tests.waiting import wait_for


@pytest.fixture
def kept(monkeypatch: pytest.MonkeyPatch) -> Iterator[Kept]:
    """Weir's own spans on, into memory, for this test (the process's global provider, FastStream's, is left alone:
    the consumer then finds the trace in the envelope)."""
    yield from kept_in_memory(monkeypatch)


async def test_an_event_written_in_a_request_is_relayed_and_handled_in_its_trace(
    schema_pool: tuple[str, asyncpg.Pool], prepared: CommonSettings, kept: Kept
) -> None:
    schema, pool = schema_pool
    await create_effects(pool)
    event = video_created()
    with tracing.span("POST /v1/videos") as request:
        async with pool.acquire() as conn, conn.transaction():
            await enqueue(conn, event)
    traceparent = tracing.traceparent_of(request.get_span_context())
    async with pool.acquire() as conn:
        row = await conn.fetchrow("SELECT traceparent, payload FROM outbox WHERE id = $1", event.id)
    assert row is not None and row["traceparent"] == traceparent
    assert Envelope.from_bytes(bytes(row["payload"])).traceparent == traceparent

    async with relay_broker(prepared, ["video.created"]) as publishers, \
            consuming(prepared, pool, spec(unique("c"), record_effect), from_now=True):
        assert await relay_for(pool, publishers, schema, prepared).drain_once() == 1
        await wait_for(lambda: _handled(kept), SETTLE_S, "the kept event handled")
    (relay,) = kept.named("outbox relay video.created")
    (handled,) = kept.named("video.created process")
    trace_id = request.get_span_context().trace_id
    assert relay.context is not None and relay.context.trace_id == trace_id
    assert relay.parent is not None and relay.parent.span_id == request.get_span_context().span_id
    assert relay.attributes is not None
    assert (relay.attributes[tracing.VIDEO_ID], relay.attributes[tracing.EVENT_ID]) == (event.subject, event.id)
    assert handled.context is not None and handled.context.trace_id == trace_id
    assert handled.attributes is not None and handled.attributes["weir.outcome"] == "handled"
    assert handled.attributes[tracing.VIDEO_ID] == event.subject and handled.attributes["weir.deliveries"] == 1


async def test_an_events_legacy_copy_carries_its_trace_as_the_event_does(
    schema_pool: tuple[str, asyncpg.Pool], prepared: CommonSettings, kept: Kept
) -> None:
    """With the bare-type copies on (WEIR_EVENTS_LEGACY_SUBJECTS), the copy's `traceparent` header is the relay span's,
    as its account subject's is: a reader of the copy joins the trace from its headers too."""
    schema, pool = schema_pool
    event = video_created()
    with tracing.span("POST /v1/videos"):
        async with pool.acquire() as conn, conn.transaction():
            await enqueue(conn, event)
    async with relay_broker(prepared, ["video.created"]) as publishers:
        assert await relay_for(pool, publishers, schema, prepared, legacy_copies=True).drain_once() == 1
    nc = await connect(prepared, name="test")
    try:
        stored = [m for m, e in await stored_events(nc.jetstream(), "VIDEOS", "video.created.>")
                  + await stored_events(nc.jetstream(), "VIDEOS", "video.created") if e.id == event.id]
    finally:
        await nc.close()
    (relay,) = kept.named("outbox relay video.created")
    assert relay.context is not None
    assert len(stored) == 2 and {(m.headers or {}).get(HDR_LEGACY_COPY) for m in stored} == {None, "1"}
    assert {(m.headers or {}).get("traceparent") for m in stored} == {tracing.traceparent_of(relay.context)}


async def test_an_event_written_without_a_trace_is_relayed_in_a_trace_of_its_own(
    schema_pool: tuple[str, asyncpg.Pool], prepared: CommonSettings, kept: Kept
) -> None:
    schema, pool = schema_pool
    events = [video_created(), video_created()]
    async with pool.acquire() as conn, conn.transaction():
        await enqueue(conn, *events)  # no span is current (a background loop, say)
        rows = await conn.fetch("SELECT traceparent FROM outbox ORDER BY seq")
    assert [r["traceparent"] for r in rows] == [None, None]
    async with relay_broker(prepared, ["video.created"]) as publishers:
        assert await relay_for(pool, publishers, schema, prepared).drain_once() == 2
    relays = kept.named("outbox relay video.created")
    assert len(relays) == 2 and all(r.parent is None for r in relays)
    assert {r.attributes[tracing.VIDEO_ID] for r in relays if r.attributes} == {e.subject for e in events}


async def _handled(kept: Kept) -> bool:
    await asyncio.sleep(0)
    return bool(kept.named("video.created process"))


async def test_queries_are_spans_of_the_work_that_runs_them_and_the_pools_reset_is_none(
    schema_pool: tuple[str, asyncpg.Pool], kept: Kept
) -> None:
    """asyncpg's instrumentation, as `tracing.setup` installs it: a query inside traced work is its child; a query
    outside any (a poll) is not recorded, and the pool sends no reset query of its own when a connection goes back."""
    from opentelemetry.instrumentation.asyncpg import AsyncPGInstrumentor

    _, pool = schema_pool
    instrumentor = AsyncPGInstrumentor()
    instrumentor.instrument(tracer_provider=tracing._provider)  # type: ignore[no-untyped-call]
    try:
        async with pool.acquire() as conn:
            await conn.fetchval("SELECT 1")  # a poll: no span
        with tracing.span("POST /v1/videos") as request:
            async with pool.acquire() as conn:
                await conn.fetchval("SELECT 2")
    finally:
        instrumentor.uninstrument()  # type: ignore[no-untyped-call]
    statements = {s.attributes.get("db.statement") for s in kept.spans if s.attributes and s.kind.name == "CLIENT"}
    assert statements == {"SELECT 2"}
    (query,) = [s for s in kept.spans if s.name == "SELECT"]
    assert query.parent is not None and query.parent.span_id == request.get_span_context().span_id
