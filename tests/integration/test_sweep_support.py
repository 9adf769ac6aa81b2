"""What the sweep's integration tests share (no tests here): settings, candidate rows, storage state, events.

Candidates are rows inserted into `videos.videos` with `created_at` in the past; what storage holds for them is real
(objects and multipart uploads in the session's SeaweedFS).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from datetime import datetime, timedelta
from typing import Any

import asyncpg

from services.api.domain import object_key
from services.sweep.settings import SweepSettings
from services.sweep.storage import S3Storage
from services.sweep.sweep import Sweeper
from shared import db
from shared.settings import CommonSettings
from shared.storage import s3_client
from tests.stored import events_waited


def sweep_settings(base: CommonSettings, **overrides: Any) -> SweepSettings:
    """The session's addresses; no daily run unless a test asks for one."""
    values = {**base.model_dump(), "sweep_daily_enabled": False, **overrides}
    values["s3_secret_key"] = base.s3_secret_key.get_secret_value()
    return SweepSettings.model_validate(values)


@contextlib.asynccontextmanager
async def sweep_pool(settings: CommonSettings) -> AsyncIterator[asyncpg.Pool]:
    """A pool as the sweep service has one: search_path `sweep, public`."""
    pool = await db.create_pool(settings.database_url, schema=db.SCHEMAS["sweep"], max_size=8)
    try:
        yield pool
    finally:
        await pool.close()


@contextlib.asynccontextmanager
async def sweeper(settings: SweepSettings, pool: asyncpg.Pool, **kw: Any) -> AsyncIterator[Sweeper]:
    async with S3Storage.from_settings(settings) as storage:
        yield Sweeper(pool=pool, storage=storage, settings=settings, **kw)


async def quiet_table(pool: asyncpg.Pool) -> None:
    """The sweep looks at the whole table: each test starts with no candidate but its own.

    Rows earlier tests left without a file (open uploads left alone, videos of other modules) are marked deleted.
    """
    await pool.execute("UPDATE videos.videos SET status = 'deleted', deleted_at = now()"
                       " WHERE file_recorded_at IS NULL AND status IN ('created', 'uploading')")


async def insert_video(pool: asyncpg.Pool, *, age: timedelta, status: str = "created", upload_id: str | None = None,
                       claimed_age: timedelta | None = None, file_recorded: bool = False,
                       app_id: str | None = None, import_state: str | None = None) -> tuple[str, str]:
    """A video row created `age` ago (with an import from a URL in `import_state`, as the api's importer leaves
    it); returns (video id, object key)."""
    vid, app = str(uuid.uuid4()), app_id or str(uuid.uuid4())
    key = object_key(app, vid)
    await pool.execute(
        "INSERT INTO videos.videos (id, app_id, account_id, key_id, name, object_key, status, created_at, upload_id,"
        " completion_claimed_at, file_recorded_at, file_size, import_url, import_state, import_next_at)"
        " VALUES ($1, $2, $3, $4, 'sweep test', $5, $6, now() - $7::interval, $8,"
        " now() - $9::interval, CASE WHEN $10 THEN now() END, CASE WHEN $10 THEN 1 END,"
        " CASE WHEN $11::text IS NOT NULL THEN 'https://example.com/a.mp4' END, $11, now() + interval '1 minute')",
        vid, app, str(uuid.uuid4()), str(uuid.uuid4()), key, status, age, upload_id, claimed_age, file_recorded,
        import_state,
    )
    return vid, key


async def video_row(pool: asyncpg.Pool, vid: str) -> asyncpg.Record:
    row = await pool.fetchrow(
        "SELECT status, retired_at, retire_reason, upload_id, updated_at, account_id FROM videos.videos WHERE id = $1",
        vid)
    assert row is not None
    return row


# ------------------------------------------------------------------------------------------- storage


async def put_object(settings: CommonSettings, key: str, body: bytes = b"\x00" * 1024) -> None:
    async with s3_client(settings) as s3:
        await s3.put_object(Bucket=settings.s3_bucket, Key=key, Body=body)


async def open_upload(settings: CommonSettings, key: str) -> str:
    async with s3_client(settings) as s3:
        resp = await s3.create_multipart_upload(Bucket=settings.s3_bucket, Key=key)
        upload_id: str = resp["UploadId"]
        return upload_id


async def open_uploads(settings: CommonSettings, key: str) -> list[str]:
    async with s3_client(settings) as s3:
        resp = await s3.list_multipart_uploads(Bucket=settings.s3_bucket, Prefix=key)
        return [u["UploadId"] for u in resp.get("Uploads", []) if u["Key"] == key]


# -------------------------------------------------------------------------------------------- events


async def retired_events(settings: CommonSettings, video_id: str, *, expect: int = 1,
                         wait: float = 10.0) -> list[dict[str, Any]]:
    """Every `video.retired` for the video in the VIDEOS stream (waits up to `wait` s for `expect` of them)."""
    return await events_waited(settings, "VIDEOS", "video.retired.*", lambda e: e.subject == video_id, expect=expect,
                               wait=wait)


async def outbox_count(pool: asyncpg.Pool) -> int:
    n: int = await pool.fetchval("SELECT count(*) FROM sweep.outbox")
    return n


async def wait_until_blocked_on_a_row_lock(pool: asyncpg.Pool, application_name: str = "weir-videos",
                                           timeout: float = 15.0) -> None:
    """Until a backend of the api waits for a row lock (an initiate queued behind the sweep's lock)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        waiting = await pool.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND application_name = $1",
            application_name)
        if waiting:
            return
        await asyncio.sleep(0.02)
    raise AssertionError("no api backend came to wait for the row lock")


def ago(now: datetime, **kw: float) -> datetime:
    return now - timedelta(**kw)
