"""Imports from a URL (`POST /v1/videos/{id}/import`) over real HTTP: auth and the api as processes, the session's
PostgreSQL, S3 and NATS, and a source server of the test's own on 127.0.0.1 (the api runs with
WEIR_IMPORT_ALLOW_PRIVATE=1, as in development; a second api without it shows the SSRF rules). The file stored must be
the source's bytes exactly, in parts; failures the network or the server cause are retried, those the URL causes
fail the video with `video.failed`."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import httpx
import pytest
from aiohttp import web

from services.api import domain
from services.api.domain import FetchFailure
from services.api.imports import AttemptFailed, Importer
from services.api.settings import ApiSettings
from services.api.videos import Videos
from shared.authcheck import AppCreated
from shared.metrics import Metrics
from shared.settings import CommonSettings
from shared.ssrf import guarded_client
from shared.storage import s3_client
from shared.videos import ImportState
from tests.integration.apihelpers import UNLIMITED, Client, Services, create, new_app, run_services
from tests.integration.authhelpers import fresh_address
from tests.integration.test_encode_helpers import make_source
from tests.stored import events_waited
from tests.waiting import wait_for

pytestmark = pytest.mark.asyncio(loop_scope="session")

# small numbers, so that retries, parts and limits are seen in seconds (what the tests expect is derived from them)
SETTINGS = ApiSettings(import_allow_private=True, import_max_attempts=3, import_retry_base_seconds=0.2,
                       import_poll_seconds=0.1, import_part_bytes=5 * 1024 * 1024, import_read_timeout_seconds=2,
                       import_lease_seconds=3, import_max_bytes=16 * 1024 * 1024, import_max_redirects=2)
IMPORT_ENV = {name: str(getattr(SETTINGS, name)) for name in (
    "import_allow_private", "import_max_attempts", "import_retry_base_seconds", "import_poll_seconds",
    "import_part_bytes", "import_read_timeout_seconds", "import_lease_seconds", "import_max_bytes",
    "import_max_redirects")} | {"import_concurrency": "2"}
SETTLE_S = 30.0
PADDING = 11 * 1024 * 1024  # past two parts' size: the file is stored in three parts


@dataclass
class Source:
    """The test's file server: what each path answers, and every request it was sent."""

    video: bytes
    runner: web.AppRunner | None = None
    port: int = 0
    seen: list[tuple[str, dict[str, str]]] = field(default_factory=list)
    failures_left: dict[str, int] = field(default_factory=dict)
    release: asyncio.Event = field(default_factory=asyncio.Event)

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"

    def hits(self, path: str) -> int:
        return sum(1 for p, _ in self.seen if p == path)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        self.seen.append((path, dict(request.headers)))
        if path.startswith("/flaky/"):  # 503 (Retry-After 0) a number of times, then the file
            left = self.failures_left.setdefault(path, int(path.rsplit("/", 1)[1]))
            if left > 0:
                self.failures_left[path] = left - 1
                return web.Response(status=503, headers={"Retry-After": "0"})
            return web.Response(body=self.video, content_type="video/mp4")
        if path == "/video.mp4":
            return web.Response(body=self.video, content_type="video/mp4")
        if path.startswith("/hop/"):  # /hop/N redirects to /hop/N-1 ... /hop/0 to the file (relative Location)
            n = int(path.rsplit("/", 1)[1])
            raise web.HTTPFound("/video.mp4" if n == 0 else f"/hop/{n - 1}")
        if path == "/to-metadata":  # a redirect to the cloud metadata address: refused whatever the setting
            raise web.HTTPFound("http://169.254.169.254/latest/meta-data/")
        if path == "/gone":
            return web.Response(status=404, text="no such file")
        if path == "/text":
            return web.Response(text="this is no video\n" * 100, content_type="text/plain")
        if path == "/empty":
            return web.Response(body=b"", content_type="video/mp4")
        if path == "/huge":  # says more than the import's limit (and would send it)
            response = web.StreamResponse(headers={"Content-Length": str(SETTINGS.import_max_bytes + 1)})
            await response.prepare(request)
            return response
        if path == "/cut":  # sends half of what it says, then closes: an answer cut off
            response = web.StreamResponse(headers={"Content-Length": str(len(self.video))})
            await response.prepare(request)
            await response.write(self.video[: len(self.video) // 2])
            assert request.transport is not None
            request.transport.close()
            return response
        if path == "/stall":  # sends a part's worth, then nothing until released (holds the import mid-body)
            response = web.StreamResponse(headers={"Content-Length": str(len(self.video)),
                                                   "Content-Type": "video/mp4"})
            await response.prepare(request)
            half = SETTINGS.import_part_bytes + 1024
            await response.write(self.video[:half])
            await self.release.wait()
            await response.write(self.video[half:])
            return response
        return web.Response(status=404)

    async def start(self) -> None:
        app = web.Application()
        app.router.add_route("GET", "/{tail:.*}", self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def stop(self) -> None:
        self.release.set()
        if self.runner is not None:
            await self.runner.cleanup()


@pytest.fixture(scope="module")
def video_bytes(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """A real MP4 with bytes after it (players and ffmpeg read past them), large enough for three parts."""
    source = make_source(tmp_path_factory.mktemp("import") / "clip.mp4", height=240, seconds=1)
    return source.read_bytes() + bytes(range(256)) * (PADDING // 256)


@pytest.fixture
async def source(video_bytes: bytes) -> AsyncIterator[Source]:
    s = Source(video_bytes)
    await s.start()
    yield s
    await s.stop()


@pytest.fixture(scope="module")
def services(stack_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Services]:
    with run_services(stack_env, tmp_path_factory.mktemp("logs"), **IMPORT_ENV, **UNLIMITED) as s:
        yield s


@pytest.fixture(scope="module")
def guarded_api(services: Services, stack_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory,
                ) -> Iterator[Services]:
    """An api as deployed: private addresses refused (it takes no imports: only its routes are asked)."""
    settings = {**IMPORT_ENV, "import_allow_private": "0", "import_concurrency": "0"}
    with run_services(stack_env, tmp_path_factory.mktemp("logs2"), names=("api",), **settings, **UNLIMITED) as s:
        yield s


@pytest.fixture
async def app(services: Services, prepared: CommonSettings) -> AppCreated:
    return await new_app(prepared, "imports")


@pytest.fixture
async def client(services: Services, app: AppCreated) -> AsyncIterator[Client]:
    c = Client(services, app.secret_key, fresh_address())
    yield c
    await c.http.aclose()


async def start_import(client: Client, video_id: str, url: str) -> httpx.Response:
    return await client.call("POST", f"/v1/videos/{video_id}/import", json={"url": url})


async def imported(client: Client, url: str) -> dict[str, Any]:
    """A new video, its import asked for: the 202's body."""
    video = await create(client)
    r = await start_import(client, video["id"], url)
    assert r.status_code == 202, r.text
    return dict(r.json())


async def settled(client: Client, video_id: str, *states: ImportState) -> dict[str, Any]:
    async def shown() -> dict[str, Any] | None:
        r = await client.call("GET", f"/v1/videos/{video_id}")
        assert r.status_code == 200, r.text
        body = dict(r.json())
        return body if body["import"] and body["import"]["state"] in states else None

    return await wait_for(shown, SETTLE_S, f"the import {' or '.join(states)}")


async def stored(settings: CommonSettings, key: str) -> bytes:
    async with s3_client(settings) as s3:
        got = await s3.get_object(Bucket=settings.s3_bucket, Key=key)
        data: bytes = await got["Body"].read()
        return data


async def failed_events(prepared: CommonSettings, app: AppCreated, video_id: str) -> list[dict[str, Any]]:
    return await events_waited(prepared, "VIDEOS", "video.failed.*",
                               lambda e: e.data["video_id"] == video_id, expect=1, wait=10)


async def upload_completed(prepared: CommonSettings, app: AppCreated, video_id: str) -> list[dict[str, Any]]:
    return await events_waited(prepared, "VIDEOS", "upload.completed.*",
                               lambda e: e.data["video_id"] == video_id, expect=2, wait=2)


# ------------------------------------------------------------------------------------------------------- the file


async def test_an_import_stores_the_urls_bytes_in_parts_and_completes_the_upload(
    client: Client, source: Source, prepared: CommonSettings, app: AppCreated, video_bytes: bytes
) -> None:
    queued = await imported(client, source.url("/video.mp4?X-Amz-Signature=secret"))
    assert queued["status"] == "created" and queued["import"]["state"] == "queued", queued
    assert queued["import"]["url"] == source.url("/video.mp4"), "a URL's query (a signature) is never shown"
    done = await settled(client, queued["id"], ImportState.COMPLETED)
    assert done["status"] == "uploaded", done
    assert done["file"] == {"size": len(video_bytes), "content_type": "video/mp4"}
    assert done["import"]["bytes"] == len(video_bytes) and done["import"]["attempts"] == 1
    assert done["import"]["error"] is None and done["import"]["finished_at"] is not None
    # the object is the source's bytes exactly (three parts, in order), and the upload announced once
    key = domain.object_key(app.id, queued["id"])
    assert await stored(prepared, key) == video_bytes
    parts = -(-len(video_bytes) // SETTINGS.import_part_bytes)
    assert parts == 3
    completed = await upload_completed(prepared, app, queued["id"])
    assert len(completed) == 1 and completed[0]["size"] == len(video_bytes), completed
    # the request the source saw: the import's own agent, no compression asked for (the limit counts real bytes)
    (headers,) = [h for p, h in source.seen if p == "/video.mp4"]
    assert headers["User-Agent"].startswith("Weir-Import/") and headers["Accept-Encoding"] == "identity"


async def test_redirects_are_followed_up_to_the_setting_each_url_judged(client: Client, source: Source) -> None:
    most = SETTINGS.import_max_redirects
    followed = await imported(client, source.url(f"/hop/{most - 1}"))  # `most` redirects in all
    assert (await settled(client, followed["id"], ImportState.COMPLETED))["status"] == "uploaded"
    too_many = await imported(client, source.url(f"/hop/{most}"))
    shown = await settled(client, too_many["id"], ImportState.FAILED)
    assert shown["import"]["error"]["code"] == FetchFailure.TOO_MANY_REDIRECTS
    assert shown["import"]["attempts"] == 1, "a redirect loop fails the same way again: no retry"
    metadata = await imported(client, source.url("/to-metadata"))
    shown = await settled(client, metadata["id"], ImportState.FAILED)
    assert shown["import"]["error"]["code"] == FetchFailure.BAD_REDIRECT, shown["import"]
    assert "link_local" in shown["import"]["error"]["message"]
    assert shown["status"] == "failed" and shown["failure"]["reason"] == "import_failed"


# ---------------------------------------------------------------------------------------------------- retries


async def test_a_server_error_is_retried_with_backoff_until_it_answers(
    client: Client, source: Source, prepared: CommonSettings, app: AppCreated
) -> None:
    failures = SETTINGS.import_max_attempts - 1  # the last attempt gets the file
    queued = await imported(client, source.url(f"/flaky/{failures}"))
    done = await settled(client, queued["id"], ImportState.COMPLETED)
    assert done["import"]["attempts"] == failures + 1 and done["status"] == "uploaded", done["import"]
    assert source.hits(f"/flaky/{failures}") == failures + 1
    # the last failure stays shown beside the success (what happened on the way)
    assert done["import"]["error"]["code"] == FetchFailure.HTTP_STATUS and done["import"]["error"]["status"] == 503
    assert len(await upload_completed(prepared, app, queued["id"])) == 1


async def test_an_import_that_keeps_failing_fails_the_video_after_the_last_attempt(
    client: Client, source: Source, prepared: CommonSettings, app: AppCreated
) -> None:
    queued = await imported(client, source.url(f"/flaky/{SETTINGS.import_max_attempts}"))
    shown = await settled(client, queued["id"], ImportState.FAILED)
    assert shown["import"]["attempts"] == SETTINGS.import_max_attempts
    assert source.hits(f"/flaky/{SETTINGS.import_max_attempts}") == SETTINGS.import_max_attempts
    assert shown["status"] == "failed" and shown["failure"]["reason"] == "import_failed"
    assert f"attempt {SETTINGS.import_max_attempts} of {SETTINGS.import_max_attempts}" in shown["failure"]["message"]
    (event,) = await failed_events(prepared, app, queued["id"])
    assert event["reason"] == "import_failed"


async def test_an_answer_cut_off_is_retried_and_its_upload_aborted(
    client: Client, source: Source, prepared: CommonSettings, app: AppCreated
) -> None:
    queued = await imported(client, source.url("/cut"))
    shown = await settled(client, queued["id"], ImportState.FAILED)
    assert shown["import"]["attempts"] == SETTINGS.import_max_attempts, "a cut answer is the network's: retried"
    assert shown["import"]["error"]["code"] == FetchFailure.PROTOCOL_ERROR
    async with s3_client(prepared) as s3:  # no attempt left an upload open behind it
        uploads = await s3.list_multipart_uploads(Bucket=prepared.s3_bucket,
                                                  Prefix=domain.object_key(app.id, shown["id"]))
        assert not uploads.get("Uploads")


@pytest.mark.parametrize(("path", "code", "status"), [
    ("/gone", FetchFailure.HTTP_STATUS, 404),
    ("/empty", FetchFailure.EMPTY, None),
    ("/huge", FetchFailure.TOO_LARGE, None),
])
async def test_what_the_url_itself_causes_fails_at_once(
    client: Client, source: Source, prepared: CommonSettings, app: AppCreated, path: str, code: FetchFailure,
    status: int | None
) -> None:
    queued = await imported(client, source.url(f"{path}?signature=s3cr3t"))
    shown = await settled(client, queued["id"], ImportState.FAILED)
    assert shown["import"]["attempts"] == 1 and source.hits(path) == 1, "the same URL would fail the same way"
    assert shown["import"]["error"]["code"] == code and shown["import"]["error"].get("status") == status
    assert shown["status"] == "failed" and shown["failure"]["reason"] == "import_failed"
    (event,) = await failed_events(prepared, app, queued["id"])
    assert event["reason"] == "import_failed" and source.url(path) in event["message"]
    assert "s3cr3t" not in json.dumps(event) + json.dumps(shown), "a URL's query (a signature) is never shown"


async def test_a_file_that_is_no_video_fails_as_an_upload_does(client: Client, source: Source) -> None:
    queued = await imported(client, source.url("/text"))
    shown = await settled(client, queued["id"], ImportState.FAILED)
    assert shown["failure"]["reason"] == "unsupported_file" and shown["import"]["error"]["code"] == "unsupported_file"


# ----------------------------------------------------------------------------------------------- the rules


async def test_one_way_in_at_a_time_and_the_same_url_again_is_answered_as_it_is(
    client: Client, source: Source
) -> None:
    queued = await imported(client, source.url("/stall"))
    await wait_for(lambda: source.hits("/stall"), SETTLE_S, "the import to start reading")
    again = await start_import(client, queued["id"], source.url("/stall"))
    assert again.status_code == 202 and again.json()["import"]["attempts"] == 1, again.text
    other = await start_import(client, queued["id"], source.url("/video.mp4"))
    assert other.status_code == 409 and other.json()["code"] == "conflict", other.text
    initiate = await client.call("POST", f"/v1/videos/{queued['id']}/upload", json={"content_type": "video/mp4"})
    assert initiate.status_code == 409 and "imported" in initiate.json()["detail"], initiate.text
    # mid-body: the bytes read so far are shown, the video is uploading
    fetching = await settled(client, queued["id"], ImportState.FETCHING)
    assert fetching["status"] == "uploading"
    source.release.set()
    done = await settled(client, queued["id"], ImportState.COMPLETED)
    assert done["file"]["size"] == len(source.video)
    # a video with its file takes no import; a video with an open upload neither
    assert (await start_import(client, queued["id"], source.url("/video.mp4"))).status_code == 409
    opened = await create(client)
    r = await client.call("POST", f"/v1/videos/{opened['id']}/upload", json={"content_type": "video/mp4"})
    assert r.status_code == 200, r.text
    refused = await start_import(client, opened["id"], source.url("/video.mp4"))
    assert refused.status_code == 409 and "open upload" in refused.json()["detail"]


async def test_a_video_deleted_mid_import_cancels_it(client: Client, source: Source, prepared: CommonSettings,
                                                      app: AppCreated) -> None:
    queued = await imported(client, source.url("/stall"))
    await wait_for(lambda: source.hits("/stall"), SETTLE_S, "the import to start reading")
    assert (await client.call("DELETE", f"/v1/videos/{queued['id']}")).status_code == 204
    source.release.set()
    await asyncio.sleep(SETTINGS.import_read_timeout_seconds)  # the attempt reads on, then stores its next part
    async with s3_client(prepared) as s3:
        key = domain.object_key(app.id, queued["id"])
        uploads = await s3.list_multipart_uploads(Bucket=prepared.s3_bucket, Prefix=key)
        assert not uploads.get("Uploads"), "the deletion aborted the upload; the attempt opened none again"
        objects = await s3.list_objects_v2(Bucket=prepared.s3_bucket, Prefix=key)
        assert not objects.get("Contents")
    assert not await upload_completed(prepared, app, queued["id"])


@pytest.mark.parametrize(("url", "reason"), [
    ("ftp://example.com/a.mp4", "scheme"),
    ("http://user:pw@example.com/a.mp4", "userinfo"),
    ("http://127.0.0.1/a.mp4", "address"),
    ("http://169.254.169.254/latest", "address"),
    ("http://[::ffff:10.0.0.1]/a.mp4", "address"),
    ("not a url", "scheme"),
])
async def test_an_api_as_deployed_refuses_urls_it_would_not_read(
    guarded_api: Services, app: AppCreated, url: str, reason: str
) -> None:
    c = Client(guarded_api, app.secret_key, fresh_address())
    try:
        video = await create(c)
        r = await start_import(c, video["id"], url)
        assert r.status_code == 400 and r.json()["code"] == "invalid_url", r.text
        assert f"({reason})" in r.json()["detail"]
        shown = (await c.call("GET", f"/v1/videos/{video['id']}")).json()
        assert shown["import"] is None and shown["status"] == "created", "a URL refused leaves the video as it was"
    finally:
        await c.http.aclose()


async def test_a_name_that_resolves_to_loopback_is_refused_when_the_import_connects(source: Source) -> None:
    """`localhost` is a name: accepted when asked (a name is judged when connected to, by what it resolves to then),
    refused by the attempt on an api as deployed, before any connection (the source sees none). The importer's
    reader itself, in this process: the apis of this module allow private addresses."""
    importer = Importer(cast(Videos, None), ApiSettings(import_allow_private=False), Metrics("test"))
    async with guarded_client() as client:
        with pytest.raises(AttemptFailed) as refused:
            await importer.open_url(client, source.url("/video.mp4", host="localhost"))
    assert refused.value.failure is FetchFailure.ADDRESS_REFUSED and "loopback" in refused.value.message
    assert not domain.import_retried(refused.value.failure)
    assert source.hits("/video.mp4") == 0
    # the same reader, private addresses allowed (development), reads it
    allowed = Importer(cast(Videos, None), ApiSettings(import_allow_private=True), Metrics("test"))
    async with guarded_client() as client:
        response = await allowed.open_url(client, source.url("/video.mp4", host="localhost"))
        assert response.status == 200 and await response.read() == source.video


# ------------------------------------------------------------------------------------------- an instance lost


async def test_an_import_whose_instance_dies_is_taken_over_when_its_lease_runs_out(
    services: Services, stack_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory, client: Client,
    source: Source, prepared: CommonSettings, app: AppCreated
) -> None:
    """kill -9 of the api reading a file (the module's only importing api; last in the module, as it kills it): a
    second api takes the import over once the lease runs out, aborts the dead attempt's upload and reads the file
    again; the file is stored whole, announced once."""
    queued = await imported(client, source.url("/stall"))
    await wait_for(lambda: source.hits("/stall"), SETTLE_S, "the import to start reading")
    fetching = await settled(client, queued["id"], ImportState.FETCHING)
    assert fetching["import"]["attempts"] == 1
    importing_api = next(p for p in services.procs if p.args[-1] == "services.api")
    importing_api.kill()
    importing_api.wait()
    source.release.set()
    with run_services(stack_env, tmp_path_factory.mktemp("logs3"), names=("api",), **IMPORT_ENV,
                      **UNLIMITED) as second:
        c = Client(second, app.secret_key, fresh_address())
        try:
            done = await settled(c, queued["id"], ImportState.COMPLETED)
        finally:
            await c.http.aclose()
    assert done["import"]["attempts"] == 2 and source.hits("/stall") == 2, done["import"]
    assert done["status"] == "uploaded" and done["file"]["size"] == len(source.video)
    assert await stored(prepared, domain.object_key(app.id, queued["id"])) == source.video
    assert len(await upload_completed(prepared, app, queued["id"])) == 1
    async with s3_client(prepared) as s3:  # the dead attempt's upload was aborted, not left behind
        uploads = await s3.list_multipart_uploads(Bucket=prepared.s3_bucket,
                                                  Prefix=domain.object_key(app.id, queued["id"]))
        assert not uploads.get("Uploads")
