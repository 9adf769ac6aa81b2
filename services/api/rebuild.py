"""Rebuild the api's status projection from the start of its stream (SPEC 7), beside a running api.

1. Read api_status's events from the stream's first message to its last one now (L1), keeping those the consumer's
   inbox records as handled (a parked or pending one is not in what the api shows either), and fold them per video
   from where the video was before encode's first event (`domain.rebuild_base`) into a fresh table.
2. In one transaction: lock those videos' rows (the consumer applies an event, and the sweep retires a video, under
   the same lock), fold on the handled events stored after L1, and swap the rebuilt columns in. An event the
   consumer had not handled at step 1 but has by step 2 cannot be put in its place without reading again: such a
   video is left as it was (reported; a second run takes it). A video older than the stream's first message (its
   early events are past retention) is left as it was too.

Events are kept per video in memory until folded (a video has a few dozen at most)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import asyncpg
import uuid6
from nats.js import JetStreamContext
from pydantic import TypeAdapter, ValidationError

from services.api import domain, store
from shared.bus import HDR_LEGACY_COPY
from shared.contracts import consumed_by, contract, event_subjects
from shared.streamread import stream_messages

CONSUMER = "api_status"
_EVENTS: TypeAdapter[Any] = TypeAdapter(domain.EncodeEvent)


@dataclass
class RebuildReport:
    stream: str
    table: str
    read: int = 0  # events of the stream read
    handled: int = 0  # of them, handled by the consumer: folded
    videos: int = 0  # videos rebuilt and swapped in
    left: list[str] = field(default_factory=list)  # videos left as they were (see the module docstring)
    last_seq: int = 0


def _stream() -> tuple[str, list[str]]:
    types = consumed_by(CONSUMER)
    return contract(types[0]).stream, list(event_subjects(types))


async def _events(js: JetStreamContext, stream: str, subjects: list[str], *, after: int, until: int,
                  batch: int) -> AsyncIterator[tuple[int, datetime, Any | None]]:
    """(sequence, time, event or None when unreadable) of the stream's messages after `after`, up to `until`."""
    async for msg in stream_messages(js, stream, subjects, last_seq=until, from_seq=after + 1, batch=batch):
        if msg.headers and msg.headers.get(HDR_LEGACY_COPY) == "1":
            continue  # the same event is on its account subject
        try:
            event = _EVENTS.validate_json(msg.data)
        except ValidationError:
            event = None
        yield msg.metadata.sequence.stream, msg.metadata.timestamp, event


async def _handled(conn: asyncpg.Connection, consumer: str, ids: list[str]) -> set[str]:
    rows = await conn.fetch("SELECT event_id::text FROM inbox WHERE consumer = $1 AND event_id = ANY($2::uuid[])",
                            consumer, ids)
    return {r[0] for r in rows}


async def rebuild_status(js: JetStreamContext, conn: asyncpg.Connection, *, consumer: str = CONSUMER,
                         batch: int = 256) -> RebuildReport:
    """Rebuild and swap in (the module docstring). `conn` resolves the api's tables (its schema on the search
    path); `consumer`: whose inbox says what was handled."""
    stream, subjects = _stream()
    report = RebuildReport(stream=stream, table=f"status_rebuild_{uuid6.uuid7().hex[-12:]}")
    info = await js.stream_info(stream)
    report.last_seq = info.state.last_seq
    per_video: dict[str, list[Any]] = defaultdict(list)
    unhandled: dict[str, set[str]] = defaultdict(set)  # video -> events the consumer had not handled at step 1
    first_time: datetime | None = None

    async def fold_in(chunk: list[Any]) -> None:
        done = await _handled(conn, consumer, [e.id for e in chunk])
        for e in chunk:
            if e.id in done:
                per_video[e.data.video_id].append(e)
            else:
                unhandled[e.data.video_id].add(e.id)
        report.handled += len(done)

    chunk: list[Any] = []
    async for _, when, event in _events(js, stream, subjects, after=0, until=report.last_seq, batch=batch):
        first_time = first_time or when
        report.read += 1
        if event is not None:
            chunk.append(event)
        if len(chunk) >= batch:
            await fold_in(chunk)
            chunk = []
    if chunk:
        await fold_in(chunk)

    bases = await store.video_bases(conn, list(per_video))
    rebuilt: dict[str, domain.Projection] = {}
    for vid, events in per_video.items():
        found = bases.get(vid)
        base = domain.rebuild_base(found[0]) if found else None
        if found is None or base is None:
            continue  # unknown to the api (or gone): nothing shown to rebuild
        if info.state.first_seq > 1 and first_time is not None and found[1] < first_time:
            report.left.append(vid)  # its first events may be past the stream's retention
            continue
        rebuilt[vid] = domain.rebuilt(base, events)
    await store.write_rebuilt(conn, report.table, rebuilt)
    try:
        await _swap_in(js, conn, report, stream, subjects, rebuilt, unhandled, consumer=consumer, batch=batch)
    except BaseException:
        await store.drop_rebuilt(conn, report.table)
        raise
    return report


async def _swap_in(js: JetStreamContext, conn: asyncpg.Connection, report: RebuildReport, stream: str,
                   subjects: list[str], rebuilt: dict[str, domain.Projection], unhandled: dict[str, set[str]], *,
                   consumer: str, batch: int) -> None:
    """Step 2 (the module docstring), in one transaction."""
    async with conn.transaction():
        await store.lock_rebuilt(conn, report.table)
        now_last = (await js.stream_info(stream)).state.last_seq
        later = [e async for _, _, e in _events(js, stream, subjects, after=report.last_seq, until=now_last,
                                                batch=batch) if e is not None and e.data.video_id in rebuilt]
        late = [vid for vid, ids in unhandled.items() if vid in rebuilt
                and await _handled(conn, consumer, list(ids))]
        changed: dict[str, domain.Projection] = {}
        for event in await _handled_in_order(conn, consumer, later):
            vid = event.data.video_id
            changed[vid] = domain.project(changed.get(vid, rebuilt[vid]), event)
        if changed:
            await store.write_rebuilt(conn, report.table, changed)
        if late:
            await store.forget_rebuilt(conn, report.table, late)
            report.left += late
        report.videos = await store.swap_rebuilt(conn, report.table)
        report.last_seq = now_last


async def _handled_in_order(conn: asyncpg.Connection, consumer: str, events: list[Any]) -> list[Any]:
    done = await _handled(conn, consumer, [e.id for e in events]) if events else set()
    return [e for e in events if e.id in done]
