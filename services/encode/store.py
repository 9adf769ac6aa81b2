"""Encode's own tables: videos (deadline, busy_at, the round lease), outputs (attempts), workers (heartbeats).

The only module of the service that writes SQL. Every change of an output is conditional on its attempt and state,
so two instances (or a round and a late result) never apply the same step twice.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

import asyncpg

from services.encode import domain
from services.encode.domain import Deadline, LastRound, Output
from shared.media.playback import Artwork, HlsRendition
from shared.videos import JobClass, OutputState, ProcessingState

WAKE_CHANNEL = "encode_wake"  # NOTIFY at commit: a round is due now (payload "due") or a slot freed ("capacity")

_VIDEO_COLUMNS = (
    "video_id, job_class, object_key, source_height, state, processing_started_at, deadline_at, busy_at, last_round,"
    " next_round_at, failure_reason, failure_message"
)
_ACCOUNT = "(SELECT account_id FROM video_accounts a WHERE a.video_id = v.video_id)"
_OUTPUT_COLUMNS = (
    "height, state, attempt, offered_at, worker, worker_instance, started_at, failures, restarts, object_key"
)


@dataclass(frozen=True, slots=True)
class Video:
    video_id: str
    job_class: JobClass
    object_key: str
    source_height: int | None
    state: ProcessingState
    processing_started_at: datetime
    deadline: Deadline
    next_round_at: datetime
    failure_reason: str | None
    failure_message: str | None
    outputs: tuple[Output, ...]
    restarts: dict[int, int]
    account_id: str | None = None  # its account, when encode knows it (video_accounts): its encode.* subjects'

    def output(self, height: int) -> Output | None:
        return next((o for o in self.outputs if o.height == height), None)


def _output(row: asyncpg.Record) -> Output:
    return Output(
        height=row["height"], state=OutputState(row["state"]), attempt=row["attempt"], offered_at=row["offered_at"],
        worker=row["worker"], instance=row["worker_instance"], started_at=row["started_at"], failures=row["failures"],
        object_key=row["object_key"],
    )


async def notify(conn: asyncpg.Connection, payload: str) -> None:
    """Wake every instance's dispatcher when this transaction commits."""
    await conn.execute("SELECT pg_notify($1, $2)", WAKE_CHANNEL, payload)


async def open_video(
    conn: asyncpg.Connection, *, video_id: str, job_class: JobClass, object_key: str, source_height: int | None,
    now: datetime, deadline_seconds: float, traceparent: str | None = None,
) -> bool:
    """Processing starts: the video, its ladder when the height is known (else the first round probes), a round now.

    Not for a video already deleted: its video.deleted may be handled first (another durable consumer, a replay).
    `traceparent`: the trace its rounds continue (shared/tracing.py).
    """
    await lock_video_id(conn, video_id)
    created = await conn.fetchval(
        "INSERT INTO videos (video_id, job_class, object_key, source_height, processing_started_at, deadline_at,"
        " next_round_at, traceparent) SELECT $1, $2, $3, $4, $5, $6, $5, $7"
        " WHERE NOT EXISTS (SELECT 1 FROM deletions WHERE video_id = $1)"
        " ON CONFLICT (video_id) DO NOTHING RETURNING true",
        video_id, job_class.value, object_key, source_height, now, now + timedelta(seconds=deadline_seconds),
        traceparent,
    )
    if not created:
        return False
    if source_height is not None:
        await _insert_outputs(conn, video_id, domain.ladder(source_height))
    await notify(conn, "due")
    return True


async def lock_video_id(conn: asyncpg.Connection, video_id: str) -> None:
    """Until the transaction ends: the opening and the deletion of one video, which may have no row yet, take turns
    (a row lock cannot order them), so an upload.completed handled beside its video.deleted never opens it."""
    await conn.execute("SELECT pg_advisory_xact_lock(hashtext('weir-encode-video'), hashtext($1))", video_id)


async def set_ladder(conn: asyncpg.Connection, video_id: str, source_height: int) -> tuple[int, ...]:
    heights = domain.ladder(source_height)
    await conn.execute("UPDATE videos SET source_height = $2 WHERE video_id = $1", video_id, source_height)
    await _insert_outputs(conn, video_id, heights)
    return heights


async def _insert_outputs(conn: asyncpg.Connection, video_id: str, heights: tuple[int, ...]) -> None:
    await conn.execute(
        "INSERT INTO outputs (video_id, height) SELECT $1, h FROM unnest($2::int[]) AS h ON CONFLICT DO NOTHING",
        video_id, list(heights),
    )


async def traceparent(conn: asyncpg.Connection, video_id: str) -> str | None:
    """The trace the video's processing continues (None: not traced, or no such video)."""
    value: str | None = await conn.fetchval("SELECT traceparent FROM videos WHERE video_id = $1", video_id)
    return value


async def load(conn: asyncpg.Connection, video_id: str, *, lock: bool = False) -> Video | None:
    row = await conn.fetchrow(
        f"SELECT {_VIDEO_COLUMNS}, {_ACCOUNT} AS account_id FROM videos v WHERE video_id = $1"
        + (" FOR UPDATE OF v" if lock else ""), video_id
    )
    if row is None:
        return None
    outputs = await conn.fetch(f"SELECT {_OUTPUT_COLUMNS} FROM outputs WHERE video_id = $1 ORDER BY height", video_id)
    return _video(row, outputs)


async def load_many(conn: asyncpg.Connection, video_ids: Sequence[str]) -> dict[str, Video]:
    """The videos encode knows among `video_ids`, by id, read in two queries and without a lock (a page of status
    requests; whoever changes a video reads it again under its lock)."""
    rows = await conn.fetch(f"SELECT {_VIDEO_COLUMNS}, {_ACCOUNT} AS account_id FROM videos v"
                            " WHERE video_id = ANY($1::text[])", list(video_ids))
    outputs = await conn.fetch(f"SELECT video_id, {_OUTPUT_COLUMNS} FROM outputs WHERE video_id = ANY($1::text[])"
                               " ORDER BY video_id, height", [r["video_id"] for r in rows])
    by_video: dict[str, list[asyncpg.Record]] = {}
    for o in outputs:
        by_video.setdefault(o["video_id"], []).append(o)
    return {r["video_id"]: _video(r, by_video.get(r["video_id"], [])) for r in rows}


def _video(row: asyncpg.Record, outputs: Sequence[asyncpg.Record]) -> Video:
    return Video(
        video_id=row["video_id"], job_class=JobClass(row["job_class"]), object_key=row["object_key"],
        source_height=row["source_height"], state=ProcessingState(row["state"]),
        processing_started_at=row["processing_started_at"],
        deadline=Deadline(row["deadline_at"], row["busy_at"],
                          LastRound(row["last_round"]) if row["last_round"] else None),
        next_round_at=row["next_round_at"], failure_reason=row["failure_reason"],
        failure_message=row["failure_message"], outputs=tuple(_output(r) for r in outputs),
        restarts={r["height"]: r["restarts"] for r in outputs}, account_id=row["account_id"],
    )


async def claim(conn: asyncpg.Connection, *, now: datetime, hold_until: datetime, limit: int, waiting: bool
                ) -> list[str]:
    """Videos whose round this instance runs now: due ones, or (waiting) any with a pending output; oldest first,
    first-party before developer. The lease (`round_until`) keeps every other instance off them meanwhile.

    Committed without waiting for the disk: a lease lost in a database crash only lets a round start sooner, and
    every step that matters (the attempts, the answers) commits durably on its own.
    """
    async with conn.transaction():
        await conn.execute("SET LOCAL synchronous_commit = off")
        rows = await _claim(conn, now, hold_until, limit, waiting)
    ordered = sorted(rows, key=lambda r: (r["job_class"] != JobClass.FIRST_PARTY, r["processing_started_at"]))
    return [r["video_id"] for r in ordered]


async def _claim(conn: asyncpg.Connection, now: datetime, hold_until: datetime, limit: int, waiting: bool
                 ) -> list[asyncpg.Record]:
    rows: list[asyncpg.Record] = await conn.fetch(
        "WITH picked AS (SELECT video_id, job_class, processing_started_at FROM videos v"
        " WHERE state = 'processing' AND (round_until IS NULL OR round_until < $1)"
        " AND (next_round_at <= $1 OR ($4 AND EXISTS"
        "   (SELECT 1 FROM outputs o WHERE o.video_id = v.video_id AND o.state = 'pending')))"
        " ORDER BY (job_class = 'first_party') DESC, processing_started_at LIMIT $3 FOR UPDATE SKIP LOCKED)"
        " UPDATE videos SET round_until = $2 FROM picked WHERE videos.video_id = picked.video_id"
        " RETURNING picked.video_id, picked.job_class, picked.processing_started_at",
        now, hold_until, limit, waiting,
    )
    return rows


async def next_due(conn: asyncpg.Connection) -> datetime | None:
    due: datetime | None = await conn.fetchval(
        "SELECT min(greatest(next_round_at, coalesce(round_until, next_round_at))) FROM videos"
        " WHERE state = 'processing'"
    )
    return due


async def hold(conn: asyncpg.Connection, video_id: str, until: datetime) -> None:
    await conn.execute("UPDATE videos SET round_until = $2 WHERE video_id = $1", video_id, until)


async def release(conn: asyncpg.Connection, video_id: str, next_round_at: datetime) -> None:
    await conn.execute(
        "UPDATE videos SET round_until = NULL, next_round_at = $2 WHERE video_id = $1", video_id, next_round_at
    )


async def settle(conn: asyncpg.Connection, video_id: str, heights: Sequence[int]) -> None:
    """Offers whose answers never came and whose doubt is over: pending again."""
    if heights:
        await conn.execute(
            "UPDATE outputs SET state = 'pending'"
            " WHERE video_id = $1 AND height = ANY($2::int[]) AND state = 'offered'",
            video_id, list(heights),
        )


async def mark_offered(conn: asyncpg.Connection, video_id: str, heights: Sequence[int], now: datetime
                       ) -> dict[int, int]:
    """Pending outputs become offered under a new attempt number, committed before any offer goes out."""
    rows = await conn.fetch(
        "UPDATE outputs SET state = 'offered', attempt = attempt + 1, offered_at = $3"
        " WHERE video_id = $1 AND height = ANY($2::int[]) AND state = 'pending' RETURNING height, attempt",
        video_id, list(heights), now,
    )
    return {r["height"]: r["attempt"] for r in rows}


async def accept(conn: asyncpg.Connection, video_id: str, height: int, attempt: int, *, worker: str, instance: str,
                 now: datetime) -> bool:
    """The offer of `attempt` was accepted; True only for the one call that moved it (encode.started goes out once)."""
    moved = await conn.fetchval(
        "UPDATE outputs SET state = 'encoding', worker = $4, worker_instance = $5, started_at = $6"
        " WHERE video_id = $1 AND height = $2 AND attempt = $3 AND state = 'offered' RETURNING true",
        video_id, height, attempt, worker, instance, now,
    )
    return bool(moved)


async def unoffer(conn: asyncpg.Connection, video_id: str, height: int, attempt: int) -> None:
    """Nobody took the offer (busy, or definitely not received): pending for the next round."""
    await conn.execute(
        "UPDATE outputs SET state = 'pending'"
        " WHERE video_id = $1 AND height = $2 AND attempt = $3 AND state = 'offered'",
        video_id, height, attempt,
    )


async def finish_round(conn: asyncpg.Connection, video_id: str, deadline: Deadline, next_round_at: datetime) -> None:
    await conn.execute(
        "UPDATE videos SET deadline_at = $2, busy_at = $3, last_round = $4, next_round_at = $5, round_until = NULL"
        " WHERE video_id = $1",
        video_id, deadline.deadline_at, deadline.busy_at,
        deadline.last_round.value if deadline.last_round else None, next_round_at,
    )


async def fail_video(conn: asyncpg.Connection, video_id: str, reason: str, message: str, now: datetime
                     ) -> list[tuple[str, str, int, int]]:
    """The video failed; returns the encoding jobs to stop: (worker instance, video, height, attempt)."""
    await conn.execute(
        "UPDATE videos SET state = 'failed', failure_reason = $2, failure_message = $3, finished_at = $4,"
        " round_until = NULL WHERE video_id = $1",
        video_id, reason, message, now,
    )
    rows = await conn.fetch(
        "SELECT worker_instance, height, attempt FROM outputs WHERE video_id = $1 AND state IN ('encoding', 'offered')"
        " AND worker_instance IS NOT NULL", video_id,
    )
    return [(r["worker_instance"], video_id, r["height"], r["attempt"]) for r in rows]


async def complete_output(conn: asyncpg.Connection, video_id: str, height: int, *, worker: str, instance: str,
                          object_key: str, size: int) -> int:
    """The output is done; returns how many outputs of the video are not."""
    await conn.execute(
        "UPDATE outputs SET state = 'done', worker = $3, worker_instance = $4, object_key = $5, size = $6"
        " WHERE video_id = $1 AND height = $2",
        video_id, height, worker, instance, object_key, size,
    )
    remaining: int = await conn.fetchval(
        "SELECT count(*) FROM outputs WHERE video_id = $1 AND state <> 'done'", video_id
    )
    return remaining


async def keep_playback(conn: asyncpg.Connection, video_id: str, height: int, attempt: int, *,
                        hls: HlsRendition | None, artwork: Artwork | None) -> None:
    """What a completed output carries for playback: its HLS playlist, and the video's artwork if its job made it."""
    if hls is not None:
        await conn.execute(
            "INSERT INTO output_hls (video_id, height, attempt, hls) VALUES ($1, $2, $3, $4::jsonb)"
            " ON CONFLICT (video_id, height) DO UPDATE SET attempt = excluded.attempt, hls = excluded.hls",
            video_id, height, attempt, hls.model_dump_json(),
        )
    if artwork is not None:
        await conn.execute(
            "INSERT INTO video_artwork (video_id, height, attempt, artwork) VALUES ($1, $2, $3, $4::jsonb)"
            " ON CONFLICT (video_id) DO UPDATE SET height = excluded.height, attempt = excluded.attempt,"
            " artwork = excluded.artwork",
            video_id, height, attempt, artwork.model_dump_json(),
        )


async def mark_ready(conn: asyncpg.Connection, video_id: str, now: datetime) -> None:
    await conn.execute(
        "UPDATE videos SET state = 'ready', finished_at = $2, round_until = NULL WHERE video_id = $1", video_id, now
    )


async def return_output(conn: asyncpg.Connection, video_id: str, height: int, *, now: datetime,
                        failed: bool = False, restarted: bool = False) -> None:
    """Back to pending, offered again at once (a failure, a hand-back, a dead worker or a stuck restart)."""
    await conn.execute(
        "UPDATE outputs SET state = 'pending', worker = NULL, worker_instance = NULL, started_at = NULL,"
        " failures = failures + $3::int, restarts = restarts + $4::int, returns = returns + 1"
        " WHERE video_id = $1 AND height = $2",
        video_id, height, int(failed), int(restarted),
    )
    await conn.execute("UPDATE videos SET next_round_at = least(next_round_at, $2) WHERE video_id = $1", video_id, now)


# ------------------------------------------------------------------------------------------------- workers


async def outputs_waiting(conn: asyncpg.Connection) -> int:
    """Outputs of processing videos that no worker encodes yet (pending, or offered with the answer not in)."""
    n: int = await conn.fetchval(
        "SELECT count(*) FROM outputs o JOIN videos v USING (video_id)"
        " WHERE v.state = 'processing' AND o.state IN ('pending', 'offered')"
    )
    return n


async def record_heartbeat(conn: asyncpg.Connection, *, instance: str, name: str, slots: int, leaving: bool,
                           now: datetime) -> None:
    await conn.execute(
        "INSERT INTO workers (instance, name, slots, last_seen, leaving) VALUES ($1, $2, $3, $4, $5)"
        " ON CONFLICT (instance) DO UPDATE SET last_seen = greatest(workers.last_seen, excluded.last_seen),"
        " slots = excluded.slots, leaving = excluded.leaving, dead_at = NULL",
        instance, name, slots, now, leaving,
    )


async def live_workers(conn: asyncpg.Connection, seen_since: datetime) -> list[asyncpg.Record]:
    rows: list[asyncpg.Record] = await conn.fetch(
        "SELECT instance, name, slots, last_seen, leaving FROM workers"
        " WHERE dead_at IS NULL AND NOT leaving AND last_seen >= $1", seen_since,
    )
    return rows


async def declare_dead(conn: asyncpg.Connection, *, silent_since: datetime, now: datetime) -> list[str]:
    rows = await conn.fetch(
        "UPDATE workers SET dead_at = $2 WHERE dead_at IS NULL AND last_seen < $1 RETURNING instance",
        silent_since, now,
    )
    return [r["instance"] for r in rows]


async def forget_dead_workers(conn: asyncpg.Connection, dead_before: datetime) -> None:
    """A restarted worker is a new instance: the rows of old, dead ones go after a while."""
    await conn.execute("DELETE FROM workers WHERE dead_at < $1", dead_before)


async def encoding_on(conn: asyncpg.Connection, instances: Sequence[str]) -> list[tuple[str, int, int]]:
    """The outputs encoding on these worker instances: (video, height, attempt).

    Their videos are locked first, in one order, as every other step locks a video before its outputs.
    """
    await conn.execute(
        "SELECT 1 FROM videos WHERE state = 'processing' AND video_id IN (SELECT video_id FROM outputs"
        " WHERE state = 'encoding' AND worker_instance = ANY($1::text[])) ORDER BY video_id FOR UPDATE",
        list(instances),
    )
    rows = await conn.fetch(
        "SELECT o.video_id, o.height, o.attempt FROM outputs o JOIN videos v USING (video_id)"
        " WHERE o.state = 'encoding' AND o.worker_instance = ANY($1::text[]) AND v.state = 'processing'",
        list(instances),
    )
    return [(r["video_id"], r["height"], r["attempt"]) for r in rows]


async def known_outputs(
    conn: asyncpg.Connection, keys: Iterable[tuple[str, int]]
) -> dict[tuple[str, int], domain.Known]:
    pairs = list(keys)
    if not pairs:
        return {}
    rows = await conn.fetch(
        f"SELECT o.video_id, v.state AS video_state, {', '.join('o.' + c.strip() for c in _OUTPUT_COLUMNS.split(','))}"
        " FROM outputs o JOIN videos v USING (video_id)"
        " JOIN unnest($1::text[], $2::int[]) AS k(v, h) ON o.video_id = k.v AND o.height = k.h",
        [p[0] for p in pairs], [p[1] for p in pairs],
    )
    return {(r["video_id"], r["height"]): domain.Known(ProcessingState(r["video_state"]), _output(r)) for r in rows}


async def adopt(conn: asyncpg.Connection, video_id: str, height: int, attempt: int, *, worker: str, instance: str,
                now: datetime) -> bool:
    """A worker runs an offer whose answer was lost: the output is encoding there (same as an accepted answer)."""
    await conn.execute("SELECT 1 FROM videos WHERE video_id = $1 AND state = 'processing' FOR UPDATE", video_id)
    return await accept(conn, video_id, height, attempt, worker=worker, instance=instance, now=now)


# ------------------------------------------------------------------------------------------------ deletion


async def record_deletion(conn: asyncpg.Connection, video_id: str, *, known: bool, now: datetime) -> bool:
    """video.deleted, remembered for good (also for a video encode never had); True the first time.

    The caller holds `lock_video_id`."""
    first = await conn.fetchval(
        "INSERT INTO deletions (video_id, deleted_at, known) VALUES ($1, $2, $3)"
        " ON CONFLICT (video_id) DO NOTHING RETURNING true",
        video_id, now, known,
    )
    return bool(first)


async def mark_deleted(conn: asyncpg.Connection, video_id: str, cancel: Sequence[int], now: datetime) -> None:
    """The video's processing is deleted: no round claims it again, its deadline is over, its outputs cancelled.

    Each output keeps its attempt and worker, so that a late answer, heartbeat or result of that attempt is known
    as one of a deleted video's (and stopped or ignored)."""
    await conn.execute(
        "UPDATE videos SET state = 'deleted', finished_at = $2, round_until = NULL WHERE video_id = $1",
        video_id, now,
    )
    if cancel:
        await conn.execute(
            "UPDATE outputs SET state = 'cancelled' WHERE video_id = $1 AND height = ANY($2::int[])",
            video_id, list(cancel),
        )


# ------------------------------------------------------------------------------------------------ accounts


async def learn_account(conn: asyncpg.Connection, video_id: str, account_id: str, *, learned_from: str,
                        now: datetime) -> str:
    """Remember the video's account, unless one is known already; returns the account encode holds for it (a
    different one than `account_id` is the caller's to report: the first word stays)."""
    held: str | None = await conn.fetchval(
        "WITH ins AS (INSERT INTO video_accounts (video_id, account_id, learned_from, learned_at)"
        " VALUES ($1, $2, $3, $4) ON CONFLICT (video_id) DO NOTHING RETURNING account_id)"
        " SELECT account_id FROM ins UNION ALL SELECT account_id FROM video_accounts WHERE video_id = $1 LIMIT 1",
        video_id, account_id, learned_from, now,
    )
    if held is None:  # another transaction inserted it after this statement's snapshot: read it now
        held = await account_of(conn, video_id)
    return held or account_id


async def account_of(conn: asyncpg.Connection, video_id: str) -> str | None:
    account: str | None = await conn.fetchval("SELECT account_id FROM video_accounts WHERE video_id = $1", video_id)
    return account


async def video_facts(conn: asyncpg.Connection, video_id: str) -> domain.VideoFacts:
    """What a recording's decision needs of its video id: its account, whether encode has it, whether deleted.
    The caller holds `lock_video_id`, so no opening or deletion of it commits meanwhile."""
    row = await conn.fetchrow(
        "SELECT (SELECT account_id FROM video_accounts WHERE video_id = $1) AS owner,"
        " EXISTS (SELECT 1 FROM videos WHERE video_id = $1) AS has_source,"
        " EXISTS (SELECT 1 FROM deletions WHERE video_id = $1) AS deleted", video_id,
    )
    return domain.VideoFacts(owner=row["owner"], has_source=row["has_source"], deleted=row["deleted"])


async def in_outbox(conn: asyncpg.Connection, event_id: str) -> bool:
    """The event is in this schema's outbox already (sent or not)."""
    return bool(await conn.fetchval("SELECT EXISTS (SELECT 1 FROM outbox WHERE id = $1)", event_id))
