"""The sweep racing the real api (auth and api as processes, over HTTP): it never retires a video under an upload
that is about to finish. Each race is driven through the sweep's read hook, not by timing.
"""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import AsyncIterator, Iterator, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import imageio_ffmpeg
import pytest

from services.api import store as api_store
from services.api.objects import Objects
from services.sweep.sweep import ReadStage
from shared import db
from shared.authcheck import AccountCreated, AppCreated, CreateAccount, CreateApp
from shared.authclient import manage
from shared.bus import connect
from shared.settings import CommonSettings
from shared.storage import s3_client
from tests.integration.apihelpers import Client, Services, create, run_services, upload
from tests.integration.authhelpers import fresh_address
from tests.integration.test_sweep_support import (
    open_uploads,
    quiet_table,
    sweep_pool,
    sweep_settings,
    sweeper,
    video_row,
    wait_until_blocked_on_a_row_lock,
)

pytestmark = pytest.mark.asyncio(loop_scope="session")


@pytest.fixture(scope="module")
def services(stack_env: dict[str, str], prepared: CommonSettings, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[Services]:
    with run_services(stack_env, tmp_path_factory.mktemp("logs"), limit_key_per_minute="100000",
                      limit_owner_per_minute="100000") as s:
        yield s


@pytest.fixture(scope="module")
def mp4(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """A short MP4 made now with ffmpeg (nothing committed)."""
    out = Path(tmp_path_factory.mktemp("media")) / "clip.mp4"
    subprocess.run([imageio_ffmpeg.get_ffmpeg_exe(), "-hide_banner", "-loglevel", "error", "-f", "lavfi", "-i",
                    "testsrc2=size=320x240:rate=10:duration=1", "-c:v", "libx264", "-preset", "ultrafast",
                    "-pix_fmt", "yuv420p", str(out)], check=True)
    return out.read_bytes()


@pytest.fixture
async def client(services: Services, prepared: CommonSettings) -> AsyncIterator[Client]:
    nc = await connect(prepared, name="test")
    account = await manage(nc, "account.create", CreateAccount(name="sweep"), AccountCreated)
    app = await manage(nc, "app.create", CreateApp(user_id=account.user_id, account_id=account.account_id,
                                                   name="sweep"), AppCreated)
    await nc.close()
    c = Client(services, app.secret_key, fresh_address())
    yield c
    await c.http.aclose()


@pytest.fixture
async def pool(prepared: CommonSettings) -> AsyncIterator[asyncpg.Pool]:
    async with sweep_pool(prepared) as p:
        await quiet_table(p)
        yield p


async def day_old_video(c: Client, pool: asyncpg.Pool, prepared: CommonSettings) -> dict[str, Any]:
    """A video created through the api, then made older than the sweep's minimum age."""
    video = await create(c)
    age = timedelta(seconds=sweep_settings(prepared).sweep_min_age_seconds, hours=1)
    await pool.execute("UPDATE videos.videos SET created_at = created_at - $2::interval WHERE id = $1",
                       video["id"], age)
    video["object_key"] = await pool.fetchval("SELECT object_key FROM videos.videos WHERE id = $1", video["id"])
    return video


async def send_part(c: Client, vid: str, data: bytes) -> str:
    r = await c.call("POST", f"/v1/videos/{vid}/upload/parts", json={"part_numbers": [1]})
    assert r.status_code == 200, r.text
    async with httpx.AsyncClient(timeout=30) as s3:
        put = await s3.put(r.json()["parts"][0]["url"], content=data)  # straight to storage
    assert put.status_code == 200, put.text
    etag: str = put.headers["etag"]
    return etag


async def test_an_upload_assembled_between_the_first_two_reads_is_not_retired(
    client: Client, pool: asyncpg.Pool, prepared: CommonSettings, mp4: bytes
) -> None:
    # a completion that runs longer than the claim's stale age (shrunk to 1 s, and the sweep's clock 2 s ahead):
    # its claim no longer protects the video, only the triple read does
    settings = sweep_settings(prepared, claim_stale_seconds=1)
    later = datetime.now(UTC) + timedelta(seconds=2)
    video = await day_old_video(client, pool, prepared)
    vid, key = video["id"], video["object_key"]
    upload: dict[str, str] = {}
    api_pool = await db.create_pool(prepared.database_url, schema=db.SCHEMAS["api"], max_size=2)

    async def race(stage: ReadStage, ids: Sequence[str]) -> None:
        if stage is ReadStage.SURVEYED:
            # the survey saw nothing; now the client opens an upload, sends its part, and completes: the api's
            # complete commits its claim first...
            r = await client.call("POST", f"/v1/videos/{vid}/upload", json={"content_type": "video/mp4"})
            assert r.status_code == 200, r.text
            upload.update(upload_id=r.json()["upload_id"], etag=await send_part(client, vid, mp4))
            async with api_pool.acquire() as conn:
                await api_store.claim_completion(conn, vid)
        elif stage is ReadStage.CONFIRM_FILE:
            # ...and assembles the still-open upload right after the sweep's first read under the lock saw no file
            async with s3_client(prepared) as s3:
                await Objects(s3, prepared.s3_bucket).complete(key, upload["upload_id"], [(1, upload["etag"])])

    outcomes: dict[str, str] = {}
    try:
        async with sweeper(settings, pool, hook=race) as s:
            report = await s.run(now=later, outcomes=outcomes)
    finally:
        await api_pool.close()
    # first read: no file; listing: no open upload (assembled); second read: the file. Not retired.
    assert outcomes == {vid: "left:storage_changed"}, report
    assert report.tally.would_retire == {"no_open_upload": 1} and report.tally.retired == {}
    assert (await video_row(pool, vid))["status"] == "uploading"
    # and the completion goes on to record its file
    done = await client.call("POST", f"/v1/videos/{vid}/upload/complete",
                             json={"parts": [{"part_number": 1, "etag": upload["etag"]}]})
    assert done.status_code == 200, done.text
    assert done.json()["status"] == "uploaded" and done.json()["file"]["size"] == len(mp4)


async def test_an_initiate_while_the_sweep_holds_the_lock_waits_then_finds_the_video_retired(
    client: Client, pool: asyncpg.Pool, prepared: CommonSettings
) -> None:
    settings = sweep_settings(prepared)
    video = await day_old_video(client, pool, prepared)
    vid, key = video["id"], video["object_key"]
    initiate: list[asyncio.Task[httpx.Response]] = []

    async def race(stage: ReadStage, ids: Sequence[str]) -> None:
        if stage is ReadStage.LOCKED:
            initiate.append(asyncio.create_task(
                client.call("POST", f"/v1/videos/{vid}/upload", json={"content_type": "video/mp4"})))
            await wait_until_blocked_on_a_row_lock(pool)  # the api's initiate now waits for the sweep's lock

    outcomes: dict[str, str] = {}
    async with sweeper(settings, pool, hook=race) as s:
        await s.run(outcomes=outcomes)
    assert outcomes == {vid: "retired:never_uploaded"}
    r = await initiate[0]
    assert r.status_code == 409 and r.json()["code"] == "conflict", r.text
    assert await open_uploads(prepared, key) == []  # no upload was opened for a retired video
    shown = await client.call("GET", f"/v1/videos/{vid}")
    assert shown.status_code == 200 and shown.json()["status"] == "retired"
    listed = await client.call("GET", "/v1/videos?limit=100")
    assert vid not in [v["id"] for v in listed.json()["videos"]]  # retired videos leave the listings


async def test_an_initiate_that_commits_first_keeps_the_video(
    client: Client, pool: asyncpg.Pool, prepared: CommonSettings
) -> None:
    settings = sweep_settings(prepared)
    video = await day_old_video(client, pool, prepared)
    vid, key = video["id"], video["object_key"]
    opened: list[str] = []

    async def race(stage: ReadStage, ids: Sequence[str]) -> None:
        if stage is ReadStage.SURVEYED:  # the survey saw nothing; the initiate commits before the lock
            r = await client.call("POST", f"/v1/videos/{vid}/upload", json={"content_type": "video/mp4"})
            assert r.status_code == 200, r.text
            opened.append(r.json()["upload_id"])

    outcomes: dict[str, str] = {}
    async with sweeper(settings, pool, hook=race) as s:
        await s.run(outcomes=outcomes)
    assert outcomes == {vid: "left:upload_open"}
    assert (await video_row(pool, vid))["status"] == "uploading"
    assert await open_uploads(prepared, key) == opened


async def test_a_completion_that_finishes_before_the_lock_keeps_the_video(
    client: Client, pool: asyncpg.Pool, prepared: CommonSettings, mp4: bytes
) -> None:
    settings = sweep_settings(prepared)
    video = await day_old_video(client, pool, prepared)
    vid = video["id"]

    async def race(stage: ReadStage, ids: Sequence[str]) -> None:
        if stage is ReadStage.SURVEYED:
            r = await upload(client, vid, mp4)  # initiate, part, complete: the file is recorded
            assert r.status_code == 200 and r.json()["status"] == "uploaded", r.text

    outcomes: dict[str, str] = {}
    async with sweeper(settings, pool, hook=race) as s:
        await s.run(outcomes=outcomes)
    assert outcomes == {vid: "left:no_longer_candidate"}
    assert (await video_row(pool, vid))["status"] == "uploaded"
