"""The videos table (shared with the sweep, which reads it under the same row locks) and the api's events."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import asyncpg
import uuid6

from services.api.domain import Cursor, Projection, object_key
from services.api.playback import PlaybackKey, PlaybackPolicy, PublicKeyRead
from shared.db import quote_ident
from shared.events import (
    EventData,
    UploadCompleted,
    VideoCaptionsChanged,
    VideoCreated,
    VideoDeleted,
    VideoFailed,
    new_event,
)
from shared.outbox import change_with_events, enqueue
from shared.videos import GONE, ImportState, VideoStatus, sql_list

SOURCE = "api"
COLUMNS = (
    "id::text, app_id::text, account_id::text, key_id::text, name, metadata, status, created_at, object_key,"
    " upload_id, completion_claimed_at, file_size, file_content_type, file_recorded_at, source_height,"
    " failure_reason, failure_message, processing, renditions, playback_policy, artwork, captions,"
    " import_url, import_state, import_attempts, import_next_at, import_bytes, import_error, import_started_at,"
    " import_finished_at"
)


@dataclass(frozen=True)
class ImportJob:
    """The video's import from a URL (`POST /v1/videos/{id}/import`), as its row keeps it."""

    url: str
    state: ImportState
    attempts: int
    next_at: datetime | None  # queued: not before then; fetching: the lease's end
    bytes: int | None
    error: dict[str, Any] | None  # the last failed attempt's {code, message, status?}
    started_at: datetime | None
    finished_at: datetime | None


@dataclass(frozen=True)
class Video:
    id: str
    app_id: str
    account_id: str
    key_id: str
    name: str
    metadata: Any
    status: VideoStatus
    created_at: datetime
    object_key: str
    upload_id: str | None
    completion_claimed_at: datetime | None
    file_size: int | None
    file_content_type: str | None
    file_recorded_at: datetime | None
    source_height: int | None
    failure_reason: str | None
    failure_message: str | None
    processing: dict[str, Any] | None
    renditions: list[dict[str, Any]]
    playback_policy: PlaybackPolicy
    artwork: dict[str, Any] | None
    captions: list[Any]  # caption tracks as stored (services/api/captions.py reads them)
    import_job: ImportJob | None

    @property
    def projection(self) -> Projection:
        failure = (self.failure_reason, self.failure_message or "") if self.failure_reason else None
        return Projection(self.status, self.processing, tuple(self.renditions), failure, self.artwork)


def _video(row: asyncpg.Record | None) -> Video | None:
    if row is None:
        return None
    values = list(row.values())
    values[5] = json.loads(values[5]) if values[5] is not None else None
    values[6] = VideoStatus(values[6])
    values[17] = json.loads(values[17]) if values[17] is not None else None
    values[18] = json.loads(values[18]) if values[18] is not None else []
    values[19] = PlaybackPolicy(values[19])
    values[20] = json.loads(values[20]) if values[20] is not None else None
    values[21] = json.loads(values[21]) if values[21] is not None else []
    url, state, attempts, next_at, size, error, started, finished = values[22:]
    job = None
    if url is not None and state is not None:
        job = ImportJob(url, ImportState(state), attempts, next_at, size, json.loads(error) if error else None,
                        started, finished)
    fields: list[Any] = [*values[:22], job]
    return Video(*fields)


async def create(
    conn: asyncpg.Connection, *, app_id: str, account_id: str, key_id: str, name: str, metadata: Any,
    playback_policy: PlaybackPolicy = PlaybackPolicy.PUBLIC,
) -> Video:
    video_id = str(uuid6.uuid7())
    (row,) = await change_with_events(
        conn,
        f"INSERT INTO videos (id, app_id, account_id, key_id, name, metadata, object_key, playback_policy)"
        f" VALUES ($1, $2, $3, $4, $5, $6, $7, $8) RETURNING {COLUMNS}",
        video_id, app_id, account_id, key_id, name,
        json.dumps(metadata) if metadata is not None else None, object_key(app_id, video_id), str(playback_policy),
        events=(new_event(VideoCreated(video_id=video_id, app_id=app_id, account_id=account_id), source=SOURCE,
                          subject=video_id),),
    )
    video = _video(row)
    assert video is not None
    return video


async def get(conn: asyncpg.Connection, video_id: str, *, lock: bool = False) -> Video | None:
    if not _is_uuid(video_id):
        return None
    row = await conn.fetchrow(f"SELECT {COLUMNS} FROM videos WHERE id = $1" + (" FOR UPDATE" if lock else ""),
                              video_id)
    return _video(row)


async def listing(conn: asyncpg.Connection, app_id: str, limit: int, after: Cursor | None,
                  statuses: tuple[str, ...] | None = None) -> list[Video]:
    """A page of the app's live videos, newest first, after the cursor; only `statuses` when given."""
    args: list[Any] = [app_id, limit]
    where = "app_id = $1 AND status NOT IN ('retired', 'deleted')"
    if after is not None:
        args += [after.created_at, after.id]
        where += f" AND (created_at, id) < (${len(args) - 1}, ${len(args)}::uuid)"
    if statuses:
        args.append(list(statuses))
        where += f" AND status = ANY(${len(args)}::text[])"
    rows = await conn.fetch(f"SELECT {COLUMNS} FROM videos WHERE {where} ORDER BY created_at DESC, id DESC LIMIT $2",
                            *args)
    return [v for v in (_video(r) for r in rows) if v is not None]


async def record_upload(conn: asyncpg.Connection, video_id: str, upload_id: str) -> None:
    await conn.execute(
        "UPDATE videos SET upload_id = $2, status = 'uploading', updated_at = now() WHERE id = $1", video_id, upload_id
    )


async def clear_upload(conn: asyncpg.Connection, video_id: str) -> None:
    await conn.execute(
        "UPDATE videos SET upload_id = NULL, completion_claimed_at = NULL,"
        " status = CASE WHEN status = 'uploading' THEN 'created' ELSE status END, updated_at = now() WHERE id = $1",
        video_id,
    )


async def claim_completion(conn: asyncpg.Connection, video_id: str) -> None:
    await conn.execute("UPDATE videos SET completion_claimed_at = now(), updated_at = now() WHERE id = $1", video_id)


async def release_claim(conn: asyncpg.Connection, video_id: str) -> None:
    await conn.execute("UPDATE videos SET completion_claimed_at = NULL, updated_at = now() WHERE id = $1", video_id)


async def record_file(
    conn: asyncpg.Connection, video: Video, *, size: int, content_type: str, source_height: int | None, key_id: str,
    source_width: int | None = None,
) -> Video:
    """The file, the cleared claim and `upload.completed` in one transaction (the caller holds it); `key_id` is the
    key whose request completed the upload (an upload token's minting key), not the video's creator."""
    (row,) = await change_with_events(
        conn,
        f"UPDATE videos SET file_size = $2, file_content_type = $3, file_recorded_at = now(), source_height = $4,"
        f" upload_id = NULL, completion_claimed_at = NULL, status = 'uploaded', updated_at = now()"
        f" WHERE id = $1 RETURNING {COLUMNS}",
        video.id, size, content_type, source_height,
        events=(new_event(
            UploadCompleted(video_id=video.id, app_id=video.app_id, account_id=video.account_id, key_id=key_id,
                            object_key=video.object_key, size=size, content_type=content_type,
                            source_height=source_height, source_width=source_width),
            source=SOURCE, subject=video.id,
        ),),
    )
    recorded = _video(row)
    assert recorded is not None
    return recorded


async def mark_failed(conn: asyncpg.Connection, video: Video, reason: str, message: str) -> None:
    """The video failed for good (its file refused), and `video.failed` says so, in one statement."""
    await change_with_events(
        conn,
        "UPDATE videos SET status = 'failed', failure_reason = $2, failure_message = $3, upload_id = NULL,"
        " completion_claimed_at = NULL, updated_at = now() WHERE id = $1",
        video.id, reason, message,
        events=(new_event(VideoFailed(video_id=video.id, app_id=video.app_id, account_id=video.account_id,
                                      reason=reason, message=message), source=SOURCE, subject=video.id),),
    )


async def announce(conn: asyncpg.Connection, video: Video, data: EventData) -> None:
    """An event about the video from the api (its outcome: `domain.outcome`), in the caller's transaction."""
    await enqueue(conn, new_event(data, source=SOURCE, subject=video.id))


async def mark_deleted(conn: asyncpg.Connection, video: Video) -> None:
    await change_with_events(
        conn,
        "UPDATE videos SET status = 'deleted', deleted_at = now(), upload_id = NULL, updated_at = now() WHERE id = $1",
        video.id,
        events=(new_event(VideoDeleted(video_id=video.id, app_id=video.app_id, account_id=video.account_id),
                          source=SOURCE, subject=video.id),),
    )


async def save_projection(conn: asyncpg.Connection, video_id: str, p: Projection) -> None:
    await conn.execute(
        "UPDATE videos SET status = $2, processing = $3, renditions = $4,"
        " failure_reason = COALESCE($5, failure_reason), failure_message = COALESCE($6, failure_message),"
        " artwork = COALESCE($7, artwork), updated_at = now() WHERE id = $1",
        video_id, str(p.status), json.dumps(p.processing) if p.processing is not None else None,
        json.dumps(list(p.renditions)), p.failure[0] if p.failure else None, p.failure[1] if p.failure else None,
        json.dumps(p.artwork) if p.artwork is not None else None,
    )


# ------------------------------------------------------------------ rebuilding the status projection (SPEC 7)

_REBUILT_COLUMNS = ("video_id uuid PRIMARY KEY, status text NOT NULL, processing jsonb, renditions jsonb NOT NULL,"
                    " failure_reason text, failure_message text, artwork jsonb")


async def video_bases(conn: asyncpg.Connection, video_ids: list[str]) -> dict[str, tuple[VideoStatus, datetime]]:
    """Each known video's status and creation time (a rebuild's starting point)."""
    rows = await conn.fetch("SELECT id::text, status, created_at FROM videos WHERE id = ANY($1::uuid[])", video_ids)
    return {r[0]: (VideoStatus(r[1]), r[2]) for r in rows}


async def write_rebuilt(conn: asyncpg.Connection, table: str, rebuilt: dict[str, Projection]) -> None:
    """The rebuilt projections into `table`, a fresh table made here (replacing rows already there)."""
    await conn.execute(f"CREATE TABLE IF NOT EXISTS {quote_ident(table)} ({_REBUILT_COLUMNS})")
    await conn.executemany(
        f"INSERT INTO {quote_ident(table)} VALUES ($1, $2, $3, $4, $5, $6, $7) ON CONFLICT (video_id) DO UPDATE SET"
        " status = EXCLUDED.status, processing = EXCLUDED.processing, renditions = EXCLUDED.renditions,"
        " failure_reason = EXCLUDED.failure_reason, failure_message = EXCLUDED.failure_message,"
        " artwork = EXCLUDED.artwork",
        [(vid, str(p.status), json.dumps(p.processing) if p.processing is not None else None,
          json.dumps(list(p.renditions)), p.failure[0] if p.failure else None, p.failure[1] if p.failure else None,
          json.dumps(p.artwork) if p.artwork is not None else None) for vid, p in rebuilt.items()])


async def lock_rebuilt(conn: asyncpg.Connection, table: str) -> None:
    """The rows of the videos in `table` locked (in id order), in the caller's transaction: the consumer and the
    sweep change a video under this same lock, so none of them changes while the projection is swapped in."""
    await conn.execute(f"SELECT 1 FROM videos WHERE id IN (SELECT video_id FROM {quote_ident(table)})"
                       " ORDER BY id FOR UPDATE")


async def forget_rebuilt(conn: asyncpg.Connection, table: str, video_ids: list[str]) -> None:
    await conn.execute(f"DELETE FROM {quote_ident(table)} WHERE video_id = ANY($1::uuid[])", video_ids)


async def swap_rebuilt(conn: asyncpg.Connection, table: str) -> int:
    """The projection columns of the videos in `table` set from it (as `save_projection` sets them: a failure or
    artwork recorded stays when the rebuild has none), gone videos left alone; then `table` dropped."""
    done = await conn.execute(
        f"UPDATE videos v SET status = r.status, processing = r.processing, renditions = r.renditions,"
        f" failure_reason = COALESCE(r.failure_reason, v.failure_reason),"
        f" failure_message = COALESCE(r.failure_message, v.failure_message),"
        f" artwork = COALESCE(r.artwork, v.artwork), updated_at = now()"
        f" FROM {quote_ident(table)} r WHERE v.id = r.video_id AND v.status NOT IN {sql_list(GONE)}")
    await conn.execute(f"DROP TABLE {quote_ident(table)}")
    return int(done.split()[-1])


async def drop_rebuilt(conn: asyncpg.Connection, table: str) -> None:
    await conn.execute(f"DROP TABLE IF EXISTS {quote_ident(table)}")


async def update_video(conn: asyncpg.Connection, video_id: str, *, name: str | None, metadata: Any,
                       set_metadata: bool, playback_policy: PlaybackPolicy | None) -> Video | None:
    """PATCH: the fields given, under the caller's transaction; a gone video is not changed (None)."""
    row = await conn.fetchrow(
        f"UPDATE videos SET name = COALESCE($2, name), metadata = CASE WHEN $3 THEN $4::jsonb ELSE metadata END,"
        f" playback_policy = COALESCE($5, playback_policy), updated_at = now()"
        f" WHERE id = $1 AND status NOT IN ('retired', 'deleted') RETURNING {COLUMNS}",
        video_id, name, set_metadata, json.dumps(metadata) if metadata is not None else None,
        str(playback_policy) if playback_policy is not None else None,
    )
    return _video(row)


# --------------------------------------------------------------------------------------------- playback keys

async def set_captions(conn: asyncpg.Connection, video: Video, tracks: list[Any], *, language: str, change: str,
                       languages: list[str]) -> None:
    """The video's caption tracks and `video.captions_changed` saying what changed, in the caller's transaction
    (it holds the row lock)."""
    await change_with_events(
        conn, "UPDATE videos SET captions = $2, updated_at = now() WHERE id = $1", video.id, json.dumps(tracks),
        events=(new_event(VideoCaptionsChanged(video_id=video.id, app_id=video.app_id, account_id=video.account_id,
                                               language=language, change=change, languages=languages),
                          source=SOURCE, subject=video.id),),
    )


async def claim_idempotency_key(conn: asyncpg.Connection, app_id: str, key: str, fingerprint: str,
                                ttl_seconds: float) -> asyncpg.Record | None:
    """The row a live key already has (`fingerprint`, `video_id`), or None when the key is the caller's to use: a
    row for it is then locked until the caller's transaction ends (the same key sent at once waits here for it).
    A few expired rows are removed on the way, so the table keeps to the keys of the last `ttl_seconds`."""
    await conn.execute("DELETE FROM idempotency_keys WHERE ctid = ANY(ARRAY(SELECT ctid FROM idempotency_keys"
                       " WHERE created_at < now() - make_interval(secs => $1) LIMIT 20))", float(ttl_seconds))
    while True:  # a row seen in conflict and gone before it was read (expired, removed): the key is free again
        claimed = await conn.fetchval(
            "INSERT INTO idempotency_keys (app_id, key, fingerprint, video_id) VALUES ($1, $2, $3, $4)"
            " ON CONFLICT (app_id, key) DO UPDATE SET fingerprint = EXCLUDED.fingerprint,"
            " video_id = EXCLUDED.video_id, created_at = now()"
            " WHERE idempotency_keys.created_at < now() - make_interval(secs => $5) RETURNING true",
            app_id, key, fingerprint, str(uuid.UUID(int=0)), float(ttl_seconds))
        if claimed:
            return None
        row: asyncpg.Record | None = await conn.fetchrow(
            "SELECT fingerprint, video_id::text FROM idempotency_keys WHERE app_id = $1 AND key = $2", app_id, key)
        if row is not None:
            return row


async def record_idempotent_video(conn: asyncpg.Connection, app_id: str, key: str, video_id: str) -> None:
    await conn.execute("UPDATE idempotency_keys SET video_id = $3 WHERE app_id = $1 AND key = $2", app_id, key,
                       video_id)


KEY_COLUMNS = "id::text, app_id::text, algorithm, public_key_pem, fingerprint, created_at, revoked_at"


def _key(row: asyncpg.Record | None) -> PlaybackKey | None:
    return PlaybackKey(*row.values()) if row is not None else None


async def create_playback_key(conn: asyncpg.Connection, app_id: str, key: PublicKeyRead) -> PlaybackKey:
    row = await conn.fetchrow(
        f"INSERT INTO playback_keys (id, app_id, algorithm, public_key_pem, fingerprint) VALUES ($1, $2, $3, $4, $5)"
        f" RETURNING {KEY_COLUMNS}",
        str(uuid6.uuid7()), app_id, key.algorithm, key.pem, key.fingerprint,
    )
    created = _key(row)
    assert created is not None
    return created


async def playback_keys(conn: asyncpg.Connection, app_id: str) -> list[PlaybackKey]:
    rows = await conn.fetch(f"SELECT {KEY_COLUMNS} FROM playback_keys WHERE app_id = $1"
                            " ORDER BY created_at DESC, id DESC", app_id)
    return [k for k in (_key(r) for r in rows) if k is not None]


async def playback_key(conn: asyncpg.Connection, key_id: str) -> PlaybackKey | None:
    if not _is_uuid(key_id):
        return None
    return _key(await conn.fetchrow(f"SELECT {KEY_COLUMNS} FROM playback_keys WHERE id = $1", key_id))


async def revoke_playback_key(conn: asyncpg.Connection, app_id: str, key_id: str) -> bool:
    """Revoke (once: a second revocation keeps the first time); False when the app has no such key."""
    if not _is_uuid(key_id):
        return False
    found = await conn.fetchval(
        "UPDATE playback_keys SET revoked_at = COALESCE(revoked_at, now()) WHERE id = $1 AND app_id = $2 RETURNING id",
        key_id, app_id,
    )
    return found is not None


def _is_uuid(value: str) -> bool:
    try:
        uuid.UUID(value)
    except ValueError:
        return False
    return True


# --------------------------------------------------------------------------------------------- imports from a URL


async def start_import(conn: asyncpg.Connection, video_id: str, url: str) -> Video:
    """The import queued, due at once (the caller holds the row lock and checked `domain.import_refusal`)."""
    row = await conn.fetchrow(
        f"UPDATE videos SET import_url = $2, import_state = 'queued', import_attempts = 0, import_next_at = now(),"
        f" import_bytes = NULL, import_error = NULL, import_started_at = now(), import_finished_at = NULL,"
        f" updated_at = now() WHERE id = $1 RETURNING {COLUMNS}", video_id, url)
    video = _video(row)
    assert video is not None
    return video


async def claim_imports(conn: asyncpg.Connection, most: int, lease_seconds: float) -> list[Video]:
    """Up to `most` imports that are due (queued ones whose time came, fetching ones whose lease ran out: their
    instance died), taken under a lease of `lease_seconds`, each an attempt more. Rows another instance is claiming
    are skipped, so any number of api instances share the work."""
    rows = await conn.fetch(
        f"UPDATE videos SET import_state = 'fetching', import_attempts = import_attempts + 1,"
        f" import_next_at = now() + make_interval(secs => $2), import_bytes = 0, updated_at = now()"
        f" WHERE id IN (SELECT id FROM videos WHERE import_state IN ('queued', 'fetching') AND import_next_at <= now()"
        f" ORDER BY import_next_at LIMIT $1 FOR UPDATE SKIP LOCKED) RETURNING {COLUMNS}", most, lease_seconds)
    return [v for v in map(_video, rows) if v is not None]


async def renew_import(conn: asyncpg.Connection, video_id: str, attempts: int, read: int,
                       lease_seconds: float) -> VideoStatus | None:
    """The lease extended and the bytes read so far recorded; the video's status, or None when the attempt no longer
    holds the import (taken over after a lapsed lease, or ended): the attempt stops."""
    status = await conn.fetchval(
        "UPDATE videos SET import_next_at = now() + make_interval(secs => $4), import_bytes = $3"
        " WHERE id = $1 AND import_state = 'fetching' AND import_attempts = $2 RETURNING status",
        video_id, attempts, read, lease_seconds)
    return VideoStatus(status) if status is not None else None


async def retry_import(conn: asyncpg.Connection, video_id: str, attempts: int, error: dict[str, Any],
                       delay_seconds: float) -> None:
    await conn.execute(
        "UPDATE videos SET import_state = 'queued', import_next_at = now() + make_interval(secs => $4),"
        " import_error = $3, updated_at = now() WHERE id = $1 AND import_state = 'fetching' AND import_attempts = $2",
        video_id, attempts, json.dumps(error), delay_seconds)


async def end_import(conn: asyncpg.Connection, video_id: str, attempts: int, state: ImportState, *,
                     read: int | None = None, error: dict[str, Any] | None = None) -> bool:
    """The import ended (completed, failed or cancelled) by the attempt that holds it; False when it no longer
    did (a lapsed lease another instance took over)."""
    ended = await conn.fetchval(
        "UPDATE videos SET import_state = $3, import_next_at = NULL, import_bytes = COALESCE($4, import_bytes),"
        " import_error = COALESCE($5::jsonb, import_error), import_finished_at = now(), updated_at = now()"
        " WHERE id = $1 AND import_state = 'fetching' AND import_attempts = $2 RETURNING true",
        video_id, attempts, str(state), read, json.dumps(error) if error is not None else None)
    return bool(ended)


async def cancel_import(conn: asyncpg.Connection, video_id: str) -> None:
    """A deleted or retired video's import ends (the caller holds the row lock)."""
    await conn.execute(
        "UPDATE videos SET import_state = 'cancelled', import_next_at = NULL, import_finished_at = now()"
        " WHERE id = $1 AND import_state IN ('queued', 'fetching')", video_id)
