"""The sweep's SQL: candidates and row locks in the videos domain's table, and its own ledger (schema `sweep`).

The video table belongs to the videos domain (`videos.videos`); the sweep shares it and its row locks with the api.
Its pool's search_path is `sweep, public`, so the outbox an `enqueue` writes to is the sweep's own.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from datetime import date, datetime
from typing import Any

import asyncpg

from services.sweep.domain import Outcome, RetireReason, RunReport, Tally, Trigger
from shared.events import VideoRetired, new_event
from shared.outbox import enqueue
from shared.videos import SWEEP_CANDIDATE_SQL

SOURCE = "sweep"
CANDIDATE = SWEEP_CANDIDATE_SQL  # $1: the cutoff
CANDIDATE_COLUMNS = "id::text, object_key, created_at, completion_claimed_at"
# one sweep run at a time across every instance (two-key form: a space apart from the api's one-key locks)
RUN_LOCK = "hashtext('weir-sweep-run'), 0"


@dataclass(frozen=True)
class Candidate:
    id: str
    object_key: str
    created_at: datetime
    completion_claimed_at: datetime | None


def _candidate(row: asyncpg.Record) -> Candidate:
    return Candidate(row["id"], row["object_key"], row["created_at"], row["completion_claimed_at"])


CANDIDATES = f"SELECT {CANDIDATE_COLUMNS} FROM videos.videos WHERE {CANDIDATE}"


async def candidates(conn: asyncpg.Connection, *, cutoff: datetime, page: int) -> AsyncIterator[list[Candidate]]:
    """Every candidate, a page at a time, in one pass through the partial index: the cost follows candidates, not the
    table (and not candidates squared, as re-sorting them for each keyset page would). One read-only snapshot."""
    async with conn.transaction(readonly=True):
        cursor = await conn.cursor(CANDIDATES, cutoff)
        while rows := await cursor.fetch(page):
            yield [_candidate(r) for r in rows]


async def lock_candidates(conn: asyncpg.Connection, ids: Sequence[str], *, cutoff: datetime) -> list[Candidate]:
    """Lock those rows that are still candidates, skipping rows another transaction holds (call in a transaction)."""
    rows = await conn.fetch(
        f"SELECT {CANDIDATE_COLUMNS} FROM videos.videos WHERE {CANDIDATE} AND id = ANY($2::uuid[])"
        " ORDER BY id FOR UPDATE SKIP LOCKED",
        cutoff, list(ids),
    )
    return [_candidate(r) for r in rows]


async def still_candidates(conn: asyncpg.Connection, ids: Sequence[str], *, cutoff: datetime) -> set[str]:
    rows = await conn.fetch(
        f"SELECT id::text FROM videos.videos WHERE {CANDIDATE} AND id = ANY($2::uuid[])", cutoff, list(ids)
    )
    return {r["id"] for r in rows}


async def retire(conn: asyncpg.Connection, retirements: Sequence[tuple[str, RetireReason, int]]) -> None:
    """Retire the locked rows and write each `video.retired` to the outbox, in the caller's transaction."""
    if not retirements:
        return
    rows = await conn.fetch(
        "UPDATE videos.videos AS v SET status = 'retired', retired_at = now(), retire_reason = r.reason,"
        " upload_id = NULL, updated_at = now()"
        " FROM unnest($1::uuid[], $2::text[]) AS r(id, reason) WHERE v.id = r.id RETURNING v.id::text, v.account_id",
        [vid for vid, _, _ in retirements], [reason.value for _, reason, _ in retirements],
    )
    accounts = {r["id"]: str(r["account_id"]) for r in rows}  # on the account's subject (SPEC 12)
    await enqueue(conn, *(
        new_event(VideoRetired(video_id=vid, reason=reason.value, bytes_removed=size, account_id=accounts.get(vid)),
                  source=SOURCE, subject=vid)
        for vid, reason, size in retirements
    ))


# ------------------------------------------------------------------------------------------ the ledger


async def try_run_lock(conn: asyncpg.Connection) -> bool:
    """Session-level: held until released or the connection ends (a dead runner frees it)."""
    locked: bool = await conn.fetchval(f"SELECT pg_try_advisory_lock({RUN_LOCK})")
    return locked


async def release_run_lock(conn: asyncpg.Connection) -> None:
    await conn.execute(f"SELECT pg_advisory_unlock({RUN_LOCK})")


async def mark_interrupted(conn: asyncpg.Connection) -> int:
    """Runs still marked running when the run lock is free again were cut off by their process dying."""
    status: str = await conn.execute(
        "UPDATE runs SET outcome = 'interrupted', finished_at = now(),"
        " note = coalesce(note, 'its process stopped before the run ended') WHERE outcome = 'running'"
    )
    return int(status.split()[-1])


async def daily_done(conn: asyncpg.Connection, day: date) -> bool:
    done: bool = await conn.fetchval(
        "SELECT EXISTS (SELECT 1 FROM runs WHERE trigger = 'daily' AND daily_for = $1"
        " AND outcome IN ('completed', 'stopped'))",
        day,
    )
    return done


async def start_run(conn: asyncpg.Connection, report: RunReport) -> None:
    await conn.execute(
        "INSERT INTO runs (id, trigger, daily_for, dry_run, force, outcome, started_at)"
        " VALUES ($1, $2, $3, $4, $5, $6, $7)",
        report.id, report.trigger.value, report.daily_for, report.dry_run, report.force, report.outcome.value,
        report.started_at,
    )


async def finish_run(conn: asyncpg.Connection, report: RunReport) -> None:
    t = report.tally
    await conn.execute(
        "UPDATE runs SET outcome = $2, finished_at = $3, duration_seconds = $4, examined = $5, retired = $6,"
        " left_alone = $7, would_retire = $8, errors = $9, bytes_removed = $10, note = $11, dry_run_retire = $12"
        " WHERE id = $1",
        report.id, report.outcome.value, report.finished_at, report.duration_seconds, t.examined,
        json.dumps(dict(t.retired)), json.dumps(dict(t.left_alone)), json.dumps(dict(t.would_retire)), t.errors,
        t.bytes_removed, report.note or None, json.dumps(dict(t.dry_run_retire)),
    )


RUN_COLUMNS = (
    "id::text, trigger, daily_for, dry_run, force, outcome, started_at, finished_at, duration_seconds, examined,"
    " retired, left_alone, would_retire, errors, bytes_removed, note, dry_run_retire"
)


def _counter(value: Any) -> Counter[str]:
    return Counter({str(k): int(v) for k, v in json.loads(value or "{}").items()})


def _report(row: asyncpg.Record) -> RunReport:
    tally = Tally(examined=row["examined"], retired=_counter(row["retired"]), left_alone=_counter(row["left_alone"]),
                  would_retire=_counter(row["would_retire"]), errors=row["errors"], bytes_removed=row["bytes_removed"],
                  dry_run_retire=_counter(row["dry_run_retire"]))
    return RunReport(
        id=row["id"], trigger=Trigger(row["trigger"]), dry_run=row["dry_run"], force=row["force"],
        started_at=row["started_at"], daily_for=row["daily_for"], outcome=Outcome(row["outcome"]),
        finished_at=row["finished_at"], duration_seconds=row["duration_seconds"], tally=tally, note=row["note"] or "",
    )


async def recent_runs(conn: asyncpg.Connection, limit: int) -> list[RunReport]:
    rows = await conn.fetch(f"SELECT {RUN_COLUMNS} FROM runs ORDER BY started_at DESC LIMIT $1", limit)
    return [_report(r) for r in rows]


async def get_run(conn: asyncpg.Connection, run_id: str) -> RunReport | None:
    row = await conn.fetchrow(f"SELECT {RUN_COLUMNS} FROM runs WHERE id = $1", run_id)
    return _report(row) if row is not None else None
