"""The sweep against real PostgreSQL and SeaweedFS (SPEC section 5): the table, the claim, the valve, the ledger,
storage that cannot answer, and the index the candidates come through.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest
from aiohttp import web

from services.sweep import store
from services.sweep.app import SERVICE
from services.sweep.domain import FileRead, Outcome, UploadsRead
from services.sweep.settings import SweepSettings
from services.sweep.storage import S3Storage, StorageError
from services.sweep.sweep import ReadStage, SweepBusy, Sweeper
from shared.devstack.ports import free_port
from shared.runtime import Runtime, started
from shared.settings import CommonSettings
from shared.videos import IMPORT_ACTIVE, ImportState
from tests.integration.test_sweep_support import (
    insert_video,
    open_upload,
    open_uploads,
    outbox_count,
    put_object,
    quiet_table,
    retired_events,
    sweep_settings,
    sweeper,
    video_row,
)
from tests.stored import object_exists

pytestmark = pytest.mark.asyncio(loop_scope="session")
HOUR = timedelta(hours=1)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@pytest.fixture(scope="module")
async def service(prepared: CommonSettings) -> AsyncIterator[Runtime]:
    """The sweep service in this process (its relay publishes what runs write to the outbox); no daily run."""
    async with started(SERVICE, sweep_settings(prepared)) as rt:
        yield rt


@pytest.fixture
async def pool(service: Runtime) -> AsyncIterator[asyncpg.Pool]:
    _, _, p = service.require()
    await quiet_table(p)
    yield p


@pytest.fixture
def sweep(prepared: CommonSettings) -> SweepSettings:
    return sweep_settings(prepared)


def day_old(settings: SweepSettings) -> timedelta:
    return timedelta(seconds=settings.sweep_min_age_seconds) + HOUR


async def test_a_day_old_file_never_recorded_is_retired_and_removed_once(
    service: Runtime, pool: asyncpg.Pool, sweep: SweepSettings
) -> None:
    vid, key = await insert_video(pool, age=day_old(sweep), status="uploading", upload_id="assembled-already")
    body = b"\x00" * 4096
    await put_object(sweep, key, body)
    later = datetime.now(UTC) + day_old(sweep)  # the object was written just now: a day on, it is a day old
    outcomes: dict[str, str] = {}
    async with sweeper(sweep, pool) as s:
        report = await s.run(now=later, outcomes=outcomes)
    assert outcomes[vid] == "retired:stale_file"
    row = await video_row(pool, vid)
    assert (row["status"], row["retire_reason"], row["upload_id"]) == ("retired", "stale_file", None)
    assert row["retired_at"] is not None
    assert not await object_exists(sweep, key)
    assert report.tally.retired["stale_file"] == 1 and report.tally.bytes_removed == len(body)
    events = await retired_events(sweep, vid)
    assert events == [{"video_id": vid, "reason": "stale_file", "bytes_removed": len(body),
                       "account_id": str(row["account_id"])}]  # on its account's subject (SPEC 12)
    async with sweeper(sweep, pool) as s:  # a second run: no longer a candidate, nothing new published
        again = await s.run(now=later, outcomes=outcomes)
    assert again.tally.examined == 0
    assert service.relay is not None
    deadline = asyncio.get_running_loop().time() + 10
    while await service.relay.pending() and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.02)  # published; marked sent just after the PubAck
    assert await service.relay.pending() == 0
    assert len(await retired_events(sweep, vid, expect=2, wait=0.5)) == 1


async def test_a_day_old_video_with_nothing_in_storage_is_retired_never_uploaded(
    pool: asyncpg.Pool, sweep: SweepSettings
) -> None:
    vid, _key = await insert_video(pool, age=day_old(sweep))
    fresh, _ = await insert_video(pool, age=HOUR)  # not a day old: not a candidate
    outcomes: dict[str, str] = {}
    async with sweeper(sweep, pool) as s:
        report = await s.run(outcomes=outcomes)
    assert outcomes == {vid: "retired:never_uploaded"}
    assert (await video_row(pool, vid))["retire_reason"] == "never_uploaded"
    assert (await video_row(pool, fresh))["status"] == "created"
    assert report.tally.examined == 1 and report.tally.bytes_removed == 0
    row = await video_row(pool, vid)
    assert await retired_events(sweep, vid) == [{"video_id": vid, "reason": "never_uploaded", "bytes_removed": 0,
                                                 "account_id": str(row["account_id"])}]


async def test_an_open_multipart_upload_is_left_alone(pool: asyncpg.Pool, sweep: SweepSettings) -> None:
    vid, key = await insert_video(pool, age=day_old(sweep), status="uploading")
    upload_id = await open_upload(sweep, key)
    outcomes: dict[str, str] = {}
    async with sweeper(sweep, pool) as s:
        report = await s.run(outcomes=outcomes)
    assert outcomes == {vid: "left:upload_open"}
    assert (await video_row(pool, vid))["status"] == "uploading"
    assert await open_uploads(sweep, key) == [upload_id]
    assert report.tally.left_alone == {"upload_open": 1}


async def test_an_old_file_with_an_open_upload_is_retired_and_the_upload_aborted(
    pool: asyncpg.Pool, sweep: SweepSettings
) -> None:
    vid, key = await insert_video(pool, age=day_old(sweep), status="uploading")
    await put_object(sweep, key)
    await open_upload(sweep, key)
    outcomes: dict[str, str] = {}
    async with sweeper(sweep, pool) as s:
        await s.run(now=datetime.now(UTC) + day_old(sweep), outcomes=outcomes)
    assert outcomes == {vid: "retired:stale_file"}
    assert not await object_exists(sweep, key) and await open_uploads(sweep, key) == []


async def test_a_recent_file_is_left_alone(pool: asyncpg.Pool, sweep: SweepSettings) -> None:
    vid, key = await insert_video(pool, age=day_old(sweep), status="uploading")
    await put_object(sweep, key)  # written just now: a completion may be recording it
    outcomes: dict[str, str] = {}
    async with sweeper(sweep, pool) as s:
        await s.run(outcomes=outcomes)
    assert outcomes == {vid: "left:file_recent"} and await object_exists(sweep, key)


async def test_a_completion_claim_keeps_the_video_until_it_is_stale(pool: asyncpg.Pool,
                                                                    sweep: SweepSettings) -> None:
    stale_after = timedelta(seconds=sweep.claim_stale_seconds)
    claim_age = stale_after - timedelta(minutes=10)  # 5 minutes with the default 15
    vid, _ = await insert_video(pool, age=day_old(sweep), status="uploading", claimed_age=claim_age)
    outcomes: dict[str, str] = {}
    async with sweeper(sweep, pool) as s:
        first = await s.run(outcomes=outcomes)
    assert outcomes == {vid: "left:claim_fresh"} and first.tally.left_alone == {"claim_fresh": 1}
    assert (await video_row(pool, vid))["status"] == "uploading"
    # the same claim, 11 minutes on: 16 minutes old, past the stale age; the completion died before assembling
    async with sweeper(sweep, pool) as s:
        second = await s.run(now=datetime.now(UTC) + timedelta(minutes=11), outcomes=outcomes)
    assert outcomes == {vid: "retired:never_uploaded"} and second.tally.retired == {"never_uploaded": 1}


async def test_the_claim_age_is_a_setting(pool: asyncpg.Pool, prepared: CommonSettings) -> None:
    shrunk = sweep_settings(prepared, claim_stale_seconds=60)
    vid, _ = await insert_video(pool, age=day_old(shrunk), status="uploading", claimed_age=timedelta(minutes=5))
    outcomes: dict[str, str] = {}
    async with sweeper(shrunk, pool) as s:
        await s.run(outcomes=outcomes)
    assert outcomes == {vid: "retired:never_uploaded"}


async def test_a_claim_made_after_the_survey_is_seen_under_the_lock(pool: asyncpg.Pool,
                                                                    sweep: SweepSettings) -> None:
    vid, _ = await insert_video(pool, age=day_old(sweep), status="uploading", upload_id="u")

    async def claim_after_survey(stage: ReadStage, ids: Sequence[str]) -> None:
        if stage is ReadStage.SURVEYED:  # as the api's complete does: committed before it assembles
            await pool.execute("UPDATE videos.videos SET completion_claimed_at = now() WHERE id = $1", vid)

    outcomes: dict[str, str] = {}
    async with sweeper(sweep, pool, hook=claim_after_survey) as s:
        await s.run(outcomes=outcomes)
    assert outcomes == {vid: "left:claim_fresh"}


async def test_a_row_another_transaction_holds_is_skipped(pool: asyncpg.Pool, sweep: SweepSettings) -> None:
    held, _ = await insert_video(pool, age=day_old(sweep))
    free, _ = await insert_video(pool, age=day_old(sweep))
    outcomes: dict[str, str] = {}
    async with pool.acquire() as other, other.transaction():
        await other.execute("SELECT 1 FROM videos.videos WHERE id = $1 FOR UPDATE", held)
        async with sweeper(sweep, pool) as s:
            await asyncio.wait_for(s.run(outcomes=outcomes), 30)  # skips it, never waits for it
    assert outcomes == {held: "left:row_locked", free: "retired:never_uploaded"}
    async with sweeper(sweep, pool) as s:
        await s.run(outcomes=outcomes)
    assert outcomes[held] == "retired:never_uploaded"


async def test_only_created_and_uploading_videos_are_candidates(pool: asyncpg.Pool, sweep: SweepSettings) -> None:
    failed, _ = await insert_video(pool, age=day_old(sweep), status="failed")  # unsupported file: object removed
    recorded, _ = await insert_video(pool, age=day_old(sweep), status="uploaded", file_recorded=True)
    deleted, _ = await insert_video(pool, age=day_old(sweep), status="deleted")
    outcomes: dict[str, str] = {}
    async with sweeper(sweep, pool) as s:
        report = await s.run(outcomes=outcomes)
    assert report.tally.examined == 0 and outcomes == {}
    assert [(await video_row(pool, v))["status"] for v in (failed, recorded, deleted)] == \
        ["failed", "uploaded", "deleted"]


async def test_a_video_whose_import_is_on_its_way_is_left_alone(pool: asyncpg.Pool, sweep: SweepSettings) -> None:
    """An import from a URL queued (between two attempts no upload is open) or under way (before its first part no
    upload is open either) keeps a day-old video; one that ended does not, and a video without one is retired."""
    waiting = {state: (await insert_video(pool, age=day_old(sweep), import_state=state))[0]
               for state in sorted(IMPORT_ACTIVE)}
    ended, _ = await insert_video(pool, age=day_old(sweep), import_state=ImportState.CANCELLED)
    plain, _ = await insert_video(pool, age=day_old(sweep))
    outcomes: dict[str, str] = {}
    async with sweeper(sweep, pool) as s:
        await s.run(outcomes=outcomes)
    assert outcomes == {ended: "retired:never_uploaded", plain: "retired:never_uploaded"}
    assert [(await video_row(pool, v))["status"] for v in waiting.values()] == ["created"] * len(IMPORT_ACTIVE)


# ------------------------------------------------------------------------------- storage that cannot say




@contextlib.asynccontextmanager
async def fake_s3(handler: Handler) -> AsyncIterator[str]:
    """An S3 endpoint that answers every request with `handler` (throttling, hanging, cut-short listings)."""
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=0.1)
    await runner.setup()
    port = free_port()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def slow_down(request: web.Request) -> web.Response:
    return web.Response(status=503, content_type="application/xml",
                        body=b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>")


async def hang(request: web.Request) -> web.Response:
    await asyncio.Event().wait()  # never answers: the sweep's own timeout decides
    raise AssertionError("unreachable")


async def cut_short(request: web.Request) -> web.Response:
    if request.method == "HEAD":
        return web.Response(status=404)
    # SeaweedFS's truncated page: no NextKeyMarker to continue from
    return web.Response(status=200, content_type="application/xml", body=(
        b'<ListMultipartUploadsResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/"><IsTruncated>true</IsTruncated>'
        b"<NextUploadIdMarker>x</NextUploadIdMarker></ListMultipartUploadsResult>"))


async def garbage(request: web.Request) -> web.Response:
    if request.method == "HEAD":
        return web.Response(status=404)
    return web.Response(status=200, body=b"<html>a captive portal</html>")


@pytest.mark.parametrize("handler", [slow_down, hang, cut_short, garbage, None],
                         ids=["throttled", "timeout", "cut_short", "garbage", "refused"])
async def test_storage_that_cannot_say_leaves_every_candidate(
    pool: asyncpg.Pool, prepared: CommonSettings, handler: Handler | None
) -> None:
    settings = sweep_settings(prepared, sweep_storage_timeout_seconds=0.3)
    never = [(await insert_video(pool, age=day_old(settings)))[0] for _ in range(3)]
    vid, key = await insert_video(pool, age=day_old(settings), status="uploading")
    await put_object(settings, key)  # a stale file, in real storage: still not removed on a guess
    async with contextlib.AsyncExitStack() as stack:
        endpoint = await stack.enter_async_context(fake_s3(handler)) if handler else f"http://127.0.0.1:{free_port()}"
        storage = await stack.enter_async_context(S3Storage.from_settings(settings, endpoint=endpoint))
        outcomes: dict[str, str] = {}
        report = await Sweeper(pool=pool, storage=storage, settings=settings).run(
            now=datetime.now(UTC) + day_old(settings), outcomes=outcomes)
    assert outcomes == {v: "left:storage_uncertain" for v in [*never, vid]}
    assert report.outcome is Outcome.COMPLETED and report.tally.retired == {}
    assert report.tally.left_alone == {"storage_uncertain": 4} and "storage could not say" in report.note
    assert await object_exists(settings, key)
    assert {(await video_row(pool, v))["status"] for v in never} == {"created"}


def listing_server(uploads: list[tuple[str, str]], *, page: int, markers: bool,
                   calls: list[str]) -> Handler:
    """ListMultipartUploads over `uploads`, `page` at a time; AWS's markers, or none (as SeaweedFS sends)."""
    ordered = sorted(uploads)

    async def handle(request: web.Request) -> web.Response:
        q = request.query
        calls.append(q.get("prefix", ""))
        key_marker, id_marker = q.get("key-marker", ""), q.get("upload-id-marker", "")
        listed = [(k, u) for k, u in ordered if k.startswith(q.get("prefix", ""))
                  and (not key_marker or k > key_marker or (k == key_marker and id_marker and u > id_marker))]
        shown, truncated = listed[:page], len(listed) > page
        body = "".join(f"<Upload><Key>{k}</Key><UploadId>{u}</UploadId></Upload>" for k, u in shown)
        if truncated and markers:
            last_key, last_id = shown[-1]
            body += f"<NextKeyMarker>{last_key}</NextKeyMarker><NextUploadIdMarker>{last_id}</NextUploadIdMarker>"
        return web.Response(content_type="application/xml", body=(
            '<ListMultipartUploadsResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
            f"<IsTruncated>{'true' if truncated else 'false'}</IsTruncated>{body}</ListMultipartUploadsResult>"
        ).encode())

    return handle


@pytest.mark.parametrize(("markers", "batch", "listings"), [
    (True, 40, 3),  # AWS: the batch's one listing goes on over three pages (fewer calls than 40 keys)
    (True, 8, 2 + 8),  # AWS: a small batch allows two pages (8 / 4), then goes key by key
    (False, 40, 1 + 40),  # SeaweedFS: cut short with no marker after one page, then key by key
])
async def test_a_listing_past_one_page(prepared: CommonSettings, markers: bool, batch: int, listings: int) -> None:
    keys = [f"sources/app/{i:04d}" for i in range(batch)]
    # uploads of other keys under the batch's prefix (keys that extend the batch's: the listing shows them too)
    others = [(f"{keys[i % batch]}x{i}", f"u{i}") for i in range(25)]
    open_ = {keys[1]: ["a", "b"], keys[-1]: ["c"]}
    uploads = others + [(k, u) for k, ids in open_.items() for u in ids]
    calls: list[str] = []
    async with fake_s3(listing_server(uploads, page=10, markers=markers, calls=calls)) as endpoint, \
            S3Storage.from_settings(sweep_settings(prepared), endpoint=endpoint) as storage:
        read = await storage.read_uploads(keys)
    assert {k: r.upload_ids for k, r in read.items() if r.upload_ids} == {k: tuple(v) for k, v in open_.items()}
    assert all(r.state.value in ("open", "none") for r in read.values())
    assert len(calls) == listings


async def test_one_keys_listing_that_cannot_be_completed_is_uncertain(prepared: CommonSettings) -> None:
    key = "sources/app/many"
    calls: list[str] = []
    uploads = [(key, f"u{i:03d}") for i in range(30)]
    async with fake_s3(listing_server(uploads, page=10, markers=False, calls=calls)) as endpoint, \
            S3Storage.from_settings(sweep_settings(prepared), endpoint=endpoint) as storage:
        read = await storage.read_uploads([key])
    assert read[key].state.value == "uncertain" and "cut short" in read[key].detail


async def test_storage_going_down_after_the_survey_retires_nothing(pool: asyncpg.Pool,
                                                                    prepared: CommonSettings) -> None:
    settings = sweep_settings(prepared, sweep_storage_timeout_seconds=0.5)
    vids = [(await insert_video(pool, age=day_old(settings)))[0] for _ in range(3)]
    outcomes: dict[str, str] = {}
    async with sweeper(settings, pool) as s:
        assert isinstance(s.storage, S3Storage)
        storage = s.storage

        async def outage(stage: ReadStage, ids: Sequence[str]) -> None:
            if stage is ReadStage.LOCKED:  # the survey said "retire"; now storage stops answering
                storage.endpoint = f"http://127.0.0.1:{free_port()}"

        s.hook = outage
        report = await s.run(outcomes=outcomes)
    assert report.tally.would_retire == {"no_open_upload": 3}
    assert outcomes == {v: "left:storage_uncertain" for v in vids}


async def test_a_removal_storage_does_not_confirm_retires_nothing_of_that_video(
    pool: asyncpg.Pool, sweep: SweepSettings
) -> None:
    failing, failing_key = await insert_video(pool, age=day_old(sweep), status="uploading")
    fine, fine_key = await insert_video(pool, age=day_old(sweep), status="uploading")
    for key in (failing_key, fine_key):
        await put_object(sweep, key)

    class RefusingRemoval:
        def __init__(self, real: S3Storage) -> None:
            self.real = real

        async def read_file(self, key: str) -> FileRead:
            return await self.real.read_file(key)

        async def read_uploads(self, keys: Sequence[str]) -> dict[str, UploadsRead]:
            return await self.real.read_uploads(keys)

        async def remove_file(self, key: str) -> None:
            if key == failing_key:
                raise StorageError(f"DELETE {key}: HTTP 503 SlowDown")
            await self.real.remove_file(key)

        async def abort_upload(self, key: str, upload_id: str) -> None:
            await self.real.abort_upload(key, upload_id)

    outcomes: dict[str, str] = {}
    async with S3Storage.from_settings(sweep) as real:
        report = await Sweeper(pool=pool, storage=RefusingRemoval(real), settings=sweep).run(
            now=datetime.now(UTC) + day_old(sweep), outcomes=outcomes)
    assert outcomes == {failing: "error", fine: "retired:stale_file"}
    assert report.tally.errors == 1 and "SlowDown" in report.note
    assert (await video_row(pool, failing))["status"] == "uploading" and await object_exists(sweep, failing_key)
    assert not await object_exists(sweep, fine_key)


# ---------------------------------------------------------------------------- the valve and dry runs


async def test_the_valve_stops_a_run_force_proceeds_dry_run_changes_nothing(
    service: Runtime, pool: asyncpg.Pool, prepared: CommonSettings
) -> None:
    settings = sweep_settings(prepared, sweep_valve_min_candidates=4)
    never = [(await insert_video(pool, age=day_old(settings)))[0] for _ in range(3)]
    stale, stale_key = await insert_video(pool, age=day_old(settings), status="uploading")
    await put_object(settings, stale_key)
    kept, kept_key = await insert_video(pool, age=day_old(settings), status="uploading")
    upload_id = await open_upload(settings, kept_key)
    later = datetime.now(UTC) + day_old(settings)
    everyone = [*never, stale, kept]
    before = {v: tuple(await video_row(pool, v)) for v in everyone}
    outbox_before = await outbox_count(pool)

    async with sweeper(settings, pool) as s:
        stopped = await s.run(now=later)  # 4 of 5 (80 %) is more than the 50 % allowed
    assert stopped.outcome is Outcome.STOPPED and "--force" in stopped.note
    assert stopped.tally.would_retire == {"no_open_upload": 4}
    assert stopped.tally.left_alone == {"safety_valve": 4, "upload_open": 1} and stopped.tally.retired == {}

    async with sweeper(settings, pool) as s:
        dry = await s.run(now=later, dry_run=True, force=True)
    assert dry.outcome is Outcome.COMPLETED and dry.tally.retired == {}
    assert dry.tally.left_alone == {"dry_run": 4, "upload_open": 1}
    assert dry.tally.dry_run_retire == {"never_uploaded": 3, "stale_file": 1}

    # neither changed anything: rows, storage, the outbox
    assert {v: tuple(await video_row(pool, v)) for v in everyone} == before
    assert await object_exists(settings, stale_key) and await open_uploads(settings, kept_key) == [upload_id]
    assert await outbox_count(pool) == outbox_before

    async with sweeper(settings, pool) as s:
        forced = await s.run(now=later, force=True)
    assert forced.outcome is Outcome.COMPLETED
    assert forced.tally.retired == {"never_uploaded": 3, "stale_file": 1}
    assert forced.tally.left_alone == {"upload_open": 1}
    assert not await object_exists(settings, stale_key)
    assert {(await video_row(pool, v))["status"] for v in [*never, stale]} == {"retired"}


async def test_the_valve_does_not_hold_a_small_deployment(pool: asyncpg.Pool, sweep: SweepSettings) -> None:
    n = sweep.sweep_valve_min_candidates - 1
    for _ in range(n):
        await insert_video(pool, age=day_old(sweep))
    async with sweeper(sweep, pool) as s:
        report = await s.run()
    assert report.outcome is Outcome.COMPLETED and report.tally.retired == {"never_uploaded": n}


# ------------------------------------------------------------------------------------------ the ledger


async def test_each_run_writes_its_ledger_row(pool: asyncpg.Pool, sweep: SweepSettings) -> None:
    _retired, _ = await insert_video(pool, age=day_old(sweep))
    _kept, key = await insert_video(pool, age=day_old(sweep), status="uploading")
    await open_upload(sweep, key)
    async with sweeper(sweep, pool) as s:
        report = await s.run()
    async with pool.acquire() as conn:
        row = await store.get_run(conn, report.id)
        recent = await store.recent_runs(conn, 1)
    assert row is not None and recent[0].id == report.id
    assert (row.trigger.value, row.outcome, row.dry_run, row.force) == ("on_demand", Outcome.COMPLETED, False, False)
    assert row.tally.examined == 2 == row.tally.accounted
    assert row.tally.retired == {"never_uploaded": 1} and row.tally.left_alone == {"upload_open": 1}
    assert row.tally.errors == 0 and row.duration_seconds is not None and row.duration_seconds > 0
    assert row.finished_at is not None and row.finished_at >= row.started_at


async def test_one_run_at_a_time(pool: asyncpg.Pool, sweep: SweepSettings) -> None:
    await insert_video(pool, age=day_old(sweep))
    release = asyncio.Event()

    async def hold(stage: ReadStage, ids: Sequence[str]) -> None:
        if stage is ReadStage.SURVEY_UPLOADS:
            await release.wait()

    async with sweeper(sweep, pool, hook=hold) as first, sweeper(sweep, pool) as second:
        running = asyncio.create_task(first.run())
        while not await pool.fetchval("SELECT count(*) FROM sweep.runs WHERE outcome = 'running'"):
            await asyncio.sleep(0.01)
        with pytest.raises(SweepBusy):
            await second.run()
        release.set()
        assert (await running).outcome is Outcome.COMPLETED


async def test_a_run_stops_between_batches_when_its_process_stops(pool: asyncpg.Pool,
                                                                   prepared: CommonSettings) -> None:
    settings = sweep_settings(prepared, sweep_batch_size=2, sweep_batch_concurrency=1)
    vids = [(await insert_video(pool, age=day_old(settings)))[0] for _ in range(4)]
    stopping = asyncio.Event()

    async def shutdown_during_the_first_batch(stage: ReadStage, ids: Sequence[str]) -> None:
        if stage is ReadStage.LOCKED:
            stopping.set()

    outcomes: dict[str, str] = {}
    async with sweeper(settings, pool, hook=shutdown_during_the_first_batch, stopping=stopping) as s:
        report = await s.run(outcomes=outcomes)
    assert report.outcome is Outcome.INTERRUPTED and report.tally.retired == {"never_uploaded": 2}
    assert sorted(outcomes.values()) == ["retired:never_uploaded"] * 2  # the batch in flight finished
    assert sorted([(await video_row(pool, v))["status"] for v in vids]) == ["created", "created", "retired", "retired"]
    async with pool.acquire() as conn:
        row = await store.get_run(conn, report.id)
    assert row is not None and row.outcome is Outcome.INTERRUPTED


async def test_a_run_whose_process_died_is_marked_interrupted(pool: asyncpg.Pool, sweep: SweepSettings) -> None:
    await pool.execute("INSERT INTO sweep.runs (id, trigger, dry_run, force, outcome, started_at)"
                       " VALUES (gen_random_uuid(), 'on_demand', false, false, 'running', now() - interval '1 hour')")
    async with sweeper(sweep, pool) as s:
        await s.run()
    assert await pool.fetchval("SELECT count(*) FROM sweep.runs WHERE outcome = 'running'") == 0
    assert await pool.fetchval("SELECT count(*) FROM sweep.runs WHERE outcome = 'interrupted'") >= 1


# ------------------------------------------------------------------------------------------- the index


async def test_candidates_come_through_the_partial_index(pool: asyncpg.Pool) -> None:
    async with pool.acquire() as conn:
        tr = conn.transaction()
        await tr.start()
        try:
            await conn.execute("SET LOCAL enable_seqscan = off")  # the test table is small; the bench shows 1M rows
            # on a few rows the api's listing index costs the planner about the same: out of the way (rolled back),
            # the plan shows whether the candidates' predicate lets the partial index serve the query
            await conn.execute("DROP INDEX videos.videos_listing")  # the table CANDIDATES reads
            plan = await conn.fetch("EXPLAIN " + store.CANDIDATES, datetime.now(UTC))
        finally:
            await tr.rollback()
    text = "\n".join(r[0] for r in plan)
    assert "videos_sweep_candidates" in text, text


async def test_candidates_are_read_page_by_page_once_each(pool: asyncpg.Pool, sweep: SweepSettings) -> None:
    vids = {(await insert_video(pool, age=day_old(sweep)))[0] for _ in range(7)}
    async with pool.acquire() as conn:
        pages = [p async for p in store.candidates(conn, cutoff=datetime.now(UTC) - day_old(sweep) + HOUR, page=3)]
    assert [len(p) for p in pages] == [3, 3, 1]
    assert {c.id for p in pages for c in p} == vids
