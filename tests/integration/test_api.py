"""The public HTTP API over real HTTP, with real auth, PostgreSQL, S3 and NATS (SPEC sections 2-4 and 9)."""

from __future__ import annotations

import asyncio
import base64
import json
import random
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import imageio_ffmpeg
import pytest

from services.api import domain
from shared.authcheck import AccountCreated, AppCreated, CreateApp
from shared.authclient import AuthError, create_account_with_app, manage
from shared.bus import connect
from shared.routeclass import ROUTE_CLASSES
from shared.settings import CommonSettings
from tests.integration.apihelpers import Client, Services, completed_events, create, free_port, run_services, upload
from tests.integration.authhelpers import fresh_address
from tests.openapianswers import HttpAnswer, OpenApiAnswers
from tests.stored import events_waited, object_exists
from tests.waiting import wait_for

pytestmark = pytest.mark.asyncio(loop_scope="session")
ADDRESS_LIMIT = 40  # small, so the 429 test is quick; every test uses its own client address
RATE_HEADERS = {"ratelimit-policy", "ratelimit", "x-ratelimit-limit", "x-ratelimit-remaining", "x-ratelimit-reset"}


@pytest.fixture(scope="module")
def services(stack_env: dict[str, str], prepared: CommonSettings, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[Services]:
    with run_services(stack_env, tmp_path_factory.mktemp("logs"), limit_address_per_minute=str(ADDRESS_LIMIT),
                      limit_key_per_minute="100000", limit_owner_per_minute="100000") as s:
        yield s


@pytest.fixture(scope="module")
def media(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    """Test files made now with ffmpeg (nothing committed): a 720p MP4 over 5 MiB, an MP3."""
    out = tmp_path_factory.mktemp("media")
    ffmpeg = imageio_ffmpeg.get_ffmpeg_exe()
    mp4, mp3 = out / "big.mp4", out / "sound.mp3"
    subprocess.run([ffmpeg, "-hide_banner", "-loglevel", "error", "-f", "lavfi", "-i",
                    "testsrc2=size=1280x720:rate=25:duration=4", "-f", "lavfi", "-i", "sine=duration=4",
                    "-c:v", "libx264", "-preset", "ultrafast", "-b:v", "16M", "-maxrate", "16M", "-bufsize", "4M",
                    "-c:a", "aac", "-shortest", str(mp4)], check=True)
    subprocess.run([ffmpeg, "-hide_banner", "-loglevel", "error", "-f", "lavfi", "-i", "sine=duration=2",
                    "-c:a", "libmp3lame", str(mp3)], check=True)
    data = {"mp4": mp4.read_bytes(), "mp3": mp3.read_bytes()}
    assert len(data["mp4"]) > domain.PART_SIZE_MIN, "the test MP4 must need two parts"
    return data


async def shown_once(client: Client, video_id: str, until: Callable[[dict[str, Any]], bool], what: str
                     ) -> dict[str, Any]:
    """GET the video until what it shows satisfies `until` (5 s at most)."""
    async def shown() -> dict[str, Any]:
        return dict((await client.call("GET", f"/v1/videos/{video_id}")).json())
    return await wait_for(shown, 5, what, until=until)


def id3(body: int, *, footer: bool = False) -> bytes:
    size = bytes([(body >> s) & 0x7F for s in (21, 14, 7, 0)])
    return b"ID3\x04\x00" + (b"\x10" if footer else b"\x00") + size + b"\x00" * body + (
        b"3DI\x04\x00\x10" + size if footer else b"")


@pytest.fixture
async def app_keys(services: Services, prepared: CommonSettings) -> AsyncIterator[tuple[AccountCreated, AppCreated]]:
    nc = await connect(prepared, name="test")
    account, app = await create_account_with_app(nc, "t", allowed_origins=("https://app.example",))
    await nc.close()
    yield account, app


@pytest.fixture
async def client(services: Services, app_keys: tuple[AccountCreated, AppCreated]) -> AsyncIterator[Client]:
    c = Client(services, app_keys[1].secret_key, fresh_address())
    yield c
    await c.http.aclose()


# ----------------------------------------------------------------------------------------------- tests


async def test_full_upload_publishes_upload_completed_once(
    client: Client, media: dict[str, bytes], prepared: CommonSettings, app_keys: tuple[AccountCreated, AppCreated]
) -> None:
    video = await create(client, metadata={"team": "a"})
    assert video["status"] == "created" and video["upload_token"].startswith("wut_")
    r = await upload(client, video["id"], media["mp4"])
    assert r.status_code == 200, r.text
    done = r.json()
    assert done["status"] == "uploaded"
    assert done["file"] == {"size": len(media["mp4"]), "content_type": "video/mp4"}
    events = await completed_events(prepared, video["id"], 1)
    assert len(events) == 1
    assert events[0]["size"] == len(media["mp4"]) and events[0]["key_id"] == app_keys[1].secret_key_id
    assert (events[0]["source_width"], events[0]["source_height"]) == (1280, 720)  # as measured: the ladder's side
    again = await client.call("POST", f"/v1/videos/{video['id']}/upload/complete",
                              json={"parts": [{"part_number": 1, "etag": "x"}]})
    assert again.status_code == 200 and again.json()["file"] == done["file"]  # the first result, nothing new
    assert len(await completed_events(prepared, video["id"], 2, wait=1.0)) == 1
    listed = await client.call("GET", "/v1/videos?limit=100")
    assert video["id"] in [v["id"] for v in listed.json()["videos"]]


async def test_a_listing_filters_by_status_and_refuses_a_parameter_it_does_not_take(
    client: Client, media: dict[str, bytes]
) -> None:
    fresh = await create(client)
    uploaded = await create(client)
    assert (await upload(client, uploaded["id"], media["mp4"][:300_000])).status_code == 200

    async def ids(query: str) -> list[str]:
        r = await client.call("GET", f"/v1/videos?limit=100&{query}")
        assert r.status_code == 200, r.text
        assert all(v["status"] in query for v in r.json()["videos"]), query  # nothing else slips in
        return [v["id"] for v in r.json()["videos"]]

    assert fresh["id"] in await ids("status=created") and uploaded["id"] not in await ids("status=created")
    assert uploaded["id"] in await ids("status=uploaded") and fresh["id"] not in await ids("status=uploaded")
    both = await ids("status=created&status=uploaded")
    assert both.index(uploaded["id"]) < both.index(fresh["id"])  # newest first
    first = (await client.call("GET", "/v1/videos?limit=1&status=created&status=uploaded")).json()
    after = (await client.call("GET", f"/v1/videos?limit=1&status=created&status=uploaded"
                                      f"&cursor={first['next_cursor']}")).json()
    assert [v["id"] for v in first["videos"] + after["videos"]] == both[:2]  # the cursor keeps the filter's order
    for query, word in (("status=ready&order=asc", "order"), ("name=x", "name"), ("status=deleted", "status"),
                        ("status=bogus", "status")):
        r = await client.call("GET", f"/v1/videos?{query}")
        assert r.status_code == 400 and r.json()["code"] == "validation_error", (query, r.text)
        assert word in r.text, (query, r.text)


async def test_concurrent_initiates_share_one_upload_and_concurrent_completes_publish_once(
    client: Client, media: dict[str, bytes], prepared: CommonSettings
) -> None:
    video = await create(client)
    path = f"/v1/videos/{video['id']}/upload"
    initiated = await asyncio.gather(*(client.call("POST", path, json={"content_type": "video/mp4"})
                                       for _ in range(5)))
    assert {r.status_code for r in initiated} == {200}
    assert len({r.json()["upload_id"] for r in initiated}) == 1
    r = await client.call("POST", f"{path}/parts", json={"part_numbers": [1]})
    async with httpx.AsyncClient() as s3:
        put = await s3.put(r.json()["parts"][0]["url"], content=media["mp4"][:200_000])
    body = {"parts": [{"part_number": 1, "etag": put.headers["etag"]}]}
    completes = await asyncio.gather(*(client.call("POST", f"{path}/complete", json=body) for _ in range(4)))
    assert {r.status_code for r in completes} == {200}, [r.text for r in completes]
    assert len(await completed_events(prepared, video["id"], 2, wait=1.5)) == 1


async def test_parts_storage_refuses_are_the_clients_mistake_and_the_upload_stays_usable(
    client: Client, media: dict[str, bytes]
) -> None:
    video = await create(client)
    path = f"/v1/videos/{video['id']}/upload"
    await client.call("POST", path, json={"content_type": "video/mp4"})
    # no part stored yet, then a stored part named with a wrong ETag and a wrong number: 400, never "retry" (503)
    r = await client.call("POST", f"{path}/complete", json={"parts": [{"part_number": 1, "etag": "0"}]})
    assert r.status_code == 400 and r.json()["code"] == "validation_error", r.text
    r = await client.call("POST", f"{path}/parts", json={"part_numbers": [1]})
    async with httpx.AsyncClient() as s3:
        put = await s3.put(r.json()["parts"][0]["url"], content=media["mp4"][:200_000])
    for parts in ([{"part_number": 1, "etag": '"0"'}], [{"part_number": 2, "etag": put.headers["etag"]}]):
        r = await client.call("POST", f"{path}/complete", json={"parts": parts})
        assert r.status_code == 400 and r.json()["code"] == "validation_error", r.text
    r = await client.call("POST", f"{path}/complete", json={"parts": [{"part_number": 1, "etag": put.headers["etag"]}]})
    assert r.status_code == 200 and r.json()["status"] == "uploaded", r.text


async def test_a_completion_that_leaves_out_stored_parts_is_refused_and_the_upload_stays_open(
    client: Client, media: dict[str, bytes]
) -> None:
    """Storage would assemble the listed parts alone, and the file, cut, would fail its check for good: a 400 that
    names the parts left out, and the upload completes once every part is listed."""
    video = await create(client)
    path = f"/v1/videos/{video['id']}/upload"
    await client.call("POST", path, json={"content_type": "video/mp4"})
    data = media["mp4"] + bytes(max(0, domain.PART_SIZE_MIN + 1 - len(media["mp4"])))  # two parts' worth
    first, rest = data[:domain.PART_SIZE_MIN], data[domain.PART_SIZE_MIN:]  # a part before the last: 5 MiB
    r = await client.call("POST", f"{path}/parts", json={"part_numbers": [1, 2]})
    etags = {}
    async with httpx.AsyncClient() as s3:
        for part, chunk in zip(r.json()["parts"], (first, rest), strict=True):
            etags[part["part_number"]] = (await s3.put(part["url"], content=chunk)).headers["etag"]
    for listed, left_out in (([2], "1"), ([1], "2")):
        r = await client.call("POST", f"{path}/complete",
                              json={"parts": [{"part_number": n, "etag": etags[n]} for n in listed]})
        assert r.status_code == 400 and r.json()["code"] == "validation_error", r.text
        assert f"parts {left_out} are stored but not listed" in r.json()["detail"], r.text
    assert (await client.call("GET", f"/v1/videos/{video['id']}")).json()["status"] == "uploading"
    r = await client.call("POST", f"{path}/complete",
                          json={"parts": [{"part_number": n, "etag": etags[n]} for n in (1, 2)]})
    assert r.status_code == 200 and r.json()["status"] == "uploaded", r.text
    assert r.json()["file"]["size"] == len(data)


@pytest.mark.parametrize("numbers", [[0], [domain.PART_NUMBER_MAX + 1], [-1], ["abc"], [1.5], []])
async def test_part_numbers_out_of_range_are_400(client: Client, numbers: list[Any]) -> None:
    video = await create(client)
    await client.call("POST", f"/v1/videos/{video['id']}/upload", json={"content_type": "video/mp4"})
    r = await client.call("POST", f"/v1/videos/{video['id']}/upload/parts", json={"part_numbers": numbers})
    assert r.status_code == 400 and r.json()["code"] == "validation_error"
    assert r.headers["content-type"] == "application/problem+json"


async def test_an_upload_larger_than_storage_can_hold_is_refused_at_once(client: Client) -> None:
    video = await create(client)
    for size in (domain.OBJECT_SIZE_MAX + 1, 99999999999999999999999999):
        r = await client.call("POST", f"/v1/videos/{video['id']}/upload", json={"content_type": "video/mp4",
                                                                              "size": size})
        assert r.status_code == 400 and r.json()["code"] == "validation_error", r.text
    r = await client.call("POST", f"/v1/videos/{video['id']}/upload", json={"content_type": "video/mp4",
                                                                          "size": domain.OBJECT_SIZE_MAX})
    assert r.status_code == 200, r.text


async def test_bad_bodies(client: Client) -> None:
    big = {"blob": "x" * (domain.METADATA_MAX_BYTES + 1)}
    r = await client.call("POST", "/v1/videos", json={"name": "n", "metadata": big})
    assert r.status_code == 400 and r.json()["code"] == "validation_error"
    r = await client.call("POST", "/v1/videos", json={"name": "n", "unknown": 1})
    assert r.status_code == 400
    as_json = {"content-type": "application/json"}
    r = await client.call("POST", "/v1/videos", content=b"{not json", headers=as_json)
    assert r.status_code == 400
    r = await client.call("POST", "/v1/videos", content=b"x" * (1024 * 1024), headers=as_json)
    assert r.status_code == 413 and r.json()["code"] == "payload_too_large"
    video = await create(client)
    # Python's JSON parser takes these, PostgreSQL's jsonb does not: refused as input, never a 500
    for number in (b"NaN", b"-Infinity", b"1e999"):
        body = b'{"name": "n", "metadata": {"a": [%s]}}' % number
        for method, path in (("POST", "/v1/videos"), ("PATCH", f"/v1/videos/{video['id']}")):
            r = await client.call(method, path, content=body, headers=as_json)
            assert r.status_code == 400 and r.json()["code"] == "validation_error", (method, number, r.text)
            assert "finite" in r.text

    async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: refused once the limit is passed
        for _ in range(64):
            yield b"x" * 65536

    r = await client.call("POST", "/v1/videos", content=chunks(), headers=as_json)
    assert r.status_code == 413
    r = await client.call("GET", f"/v1/videos/{uuid.uuid4()}")
    assert r.status_code == 404 and r.json()["code"] == "not_found"
    r = await client.call("GET", "/v1/videos/not-a-uuid")
    assert r.status_code == 404
    r = await client.call("GET", "/v1/videos?cursor=garbage")
    assert r.status_code == 400
    # a cursor made by hand: well-formed, but its id is no video id (the database would refuse it: never a 500)
    forged = base64.urlsafe_b64encode(json.dumps(["2099-01-01T00:00:00+00:00", "zzz"]).encode()).decode().rstrip("=")
    r = await client.call("GET", f"/v1/videos?limit=2&cursor={forged}")
    assert r.status_code == 400 and r.json()["code"] == "validation_error", r.text


async def test_upload_tokens_are_bound_to_their_video_and_key(
    client: Client, services: Services, prepared: CommonSettings, app_keys: tuple[AccountCreated, AppCreated]
) -> None:
    a, b = await create(client), await create(client)
    token = a["upload_token"]
    ok = await client.call("POST", f"/sdk/v1/videos/{a['id']}/upload", token, json={"content_type": "video/mp4"})
    assert ok.status_code == 200, ok.text
    other = await client.call("POST", f"/sdk/v1/videos/{b['id']}/upload", token, json={"content_type": "video/mp4"})
    assert other.status_code == 403 and other.json()["code"] == "forbidden"
    account, app = app_keys
    revoke = await client.call("DELETE", f"/v1/account/keys/{app.secret_key_id}", account.account_token)
    assert revoke.status_code == 204, revoke.text
    for _ in range(50):
        after = await client.call("POST", f"/sdk/v1/videos/{a['id']}/upload", token, json={"content_type": "video/mp4"})
        if after.status_code == 401:
            break
        await asyncio.sleep(0.02)
    assert after.status_code == 401


async def test_publishable_key_is_refused_on_secret_routes_and_works_from_allowed_origins(
    client: Client, app_keys: tuple[AccountCreated, AppCreated]
) -> None:
    pk = app_keys[1].publishable_key
    r = await client.call("GET", "/v1/videos", pk)
    assert r.status_code == 401 and r.json()["code"] == "credential_not_allowed"
    assert r.json()["detail"] == "publishable keys cannot be used on this route"
    r = await client.call("POST", "/sdk/v1/videos", pk, json={"name": "b"}, headers={"Origin": "https://app.example"})
    assert r.status_code == 201 and r.headers["access-control-allow-origin"] == "https://app.example"
    r = await client.call("POST", "/sdk/v1/videos", pk, json={"name": "b"}, headers={"Origin": "https://evil.example"})
    assert r.status_code == 403
    r = await client.http.options("/sdk/v1/videos", headers={"Origin": "https://app.example",
                                                             "Access-Control-Request-Method": "POST"})
    assert r.status_code == 204


async def test_content_check_accepts_id3_prefixed_mp4_and_refuses_others(
    client: Client, media: dict[str, bytes], prepared: CommonSettings, app_keys: tuple[AccountCreated, AppCreated]
) -> None:
    tagged = id3(300) + id3(70_000, footer=True) + media["mp4"][:300_000]
    video = await create(client)
    r = await upload(client, video["id"], tagged)
    assert r.status_code == 200, r.text
    for name, data in (("mp3", id3(100) + media["mp3"]), ("text", b"hello, this is not a video\n" * 100),
                       ("random", random.Random(4).randbytes(100_000))):
        video = await create(client)
        r = await upload(client, video["id"], data)
        assert r.status_code == 422, (name, r.text)
        assert r.json()["code"] == "unsupported_file"
        shown = (await client.call("GET", f"/v1/videos/{video['id']}")).json()
        assert shown["status"] == "failed" and shown["failure"]["reason"] == "unsupported_file"
        failed = await events_waited(prepared, "VIDEOS", f"video.failed.{app_keys[0].account_id}",
                                     lambda e, vid=video["id"]: e.data["video_id"] == vid, expect=1, wait=5)
        assert [(f["reason"], f["message"]) for f in failed] == [("unsupported_file", shown["failure"]["message"])]
        assert not await object_exists(prepared, domain.object_key(app_keys[1].id, video["id"]))
        # completing again (a client that lost the answer) gets that first result again
        again = await client.call("POST", f"/v1/videos/{video['id']}/upload/complete",
                                  json={"parts": [{"part_number": 1, "etag": '"0"'}]})
        assert again.status_code == 422 and again.json()["code"] == "unsupported_file", (name, again.text)


async def test_every_response_carries_rate_limit_headers_and_429_names_the_rule(services: Services) -> None:
    c = Client(services, "", fresh_address())
    try:
        responses = [await c.call("GET", "/v1/videos", None) for _ in range(ADDRESS_LIMIT + 2)]
    finally:
        await c.http.aclose()
    assert [r.status_code for r in responses] == [401] * ADDRESS_LIMIT + [429] * 2
    for r in responses:
        assert RATE_HEADERS <= set(r.headers), r.headers
    last = responses[-1].json()
    assert last["rule"] == "address" and last["code"] == "rate_limited" and last["retry_after"] >= 1
    assert int(responses[-1].headers["retry-after"]) >= 1


async def test_account_routes_manage_apps_and_keys(client: Client, app_keys: tuple[AccountCreated, AppCreated]
                                                   ) -> None:
    token = app_keys[0].account_token
    r = await client.call("POST", "/v1/account/apps", token, json={"name": "second"})
    assert r.status_code == 201, r.text
    created = r.json()
    assert {"id", "name", "secret_key", "publishable_key", "secret_key_id", "publishable_key_id"} <= set(created)
    rot = await client.call("POST", f"/v1/account/apps/{created['id']}/keys/rotate", token)
    assert rot.status_code == 200 and rot.json()["secret_key"] != created["secret_key"]
    keys = (await client.call("GET", f"/v1/account/apps/{created['id']}/keys", token)).json()["keys"]
    revoked = {k["id"]: k["revoked_at"] is not None for k in keys}
    assert revoked[created["secret_key_id"]] and not revoked[rot.json()["secret_key_id"]]
    assert all(len(k["prefix"]) == 12 for k in keys)
    old = await client.call("GET", "/v1/videos", created["secret_key"])
    assert old.status_code == 401


@pytest.mark.parametrize("origin", ["http://\u0000n", "https://caf\u00e9.example", "https://a.example/path",
                                    "https://a.example:99999x", "ftp://a.example", "https://a b.example"])
async def test_an_allowed_origin_that_is_no_origin_is_400(client: Client, app_keys: tuple[AccountCreated, AppCreated],
                                                         origin: str) -> None:
    r = await client.call("POST", "/v1/account/apps", app_keys[0].account_token,
                          json={"name": "o", "allowed_origins": [origin]})
    assert r.status_code == 400, r.text


async def test_origins_as_browsers_send_them_are_kept(client: Client, app_keys: tuple[AccountCreated, AppCreated]
                                                      ) -> None:
    origins = ["https://app.example", "http://localhost:3000", "https://xn--caf-dma.example", "http://[::1]:8080"]
    r = await client.call("POST", "/v1/account/apps", app_keys[0].account_token,
                          json={"name": "o", "allowed_origins": origins})
    assert r.status_code == 201, r.text


async def test_a_value_postgresql_cannot_store_is_refused_by_auth_itself(prepared: CommonSettings,
                                                                      app_keys: tuple[AccountCreated, AppCreated]
                                                                      ) -> None:
    """An edge that does not check origins as the api does: auth answers 400 at once, not silence and a timeout."""
    account = app_keys[0]
    nc = await connect(prepared, name="test")
    try:
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(AuthError) as refused:
            await manage(nc, "app.create", CreateApp(user_id=account.user_id, account_id=account.account_id,
                                                     name="n", allowed_origins=("http://\u0000",)), AppCreated)
        assert refused.value.error.status == 400 and refused.value.error.code == "validation_error"
        assert asyncio.get_running_loop().time() - t0 < 2
    finally:
        await nc.close()


async def test_auth_unreachable_is_503_not_a_guess(stack_env: dict[str, str], tmp_path: Path) -> None:
    """An api whose bus has no auth on it answers 503 with Retry-After, for every credential."""
    port = free_port()
    nats_server = subprocess.Popen([str(Path(sys.executable).parent / "nats-server"), "-js", "-a", "127.0.0.1",
                                    "-p", str(port), "-sd", str(tmp_path / "js")],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        lonely = {**stack_env, "WEIR_NATS_URL": f"nats://127.0.0.1:{port}"}
        with run_services(lonely, tmp_path, names=("api",), auth_timeout_ms="300") as s:
            async with httpx.AsyncClient(base_url=s.api_url) as http:
                for headers in ({"Authorization": "Bearer wsk_" + "a" * 32}, {}):
                    r = await http.get("/v1/videos", headers=headers)
                    assert r.status_code == 503 and r.json()["code"] == "unavailable"
                    assert r.headers["retry-after"] == "1"
    finally:
        nats_server.terminate()
        nats_server.wait(10)


def _checks_answered(services: Services) -> float:
    text = httpx.get(f"{services.urls['auth']}/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("weir_checks_total"))


async def test_each_request_makes_exactly_one_auth_check(client: Client, services: Services) -> None:
    video = await create(client)
    before = _checks_answered(services)
    calls = [("GET", f"/v1/videos/{video['id']}"), ("GET", "/v1/videos"), ("GET", "/v1/videos/x"),
             ("POST", f"/v1/videos/{video['id']}/upload-token"), ("GET", "/nowhere")]
    for method, path in calls:
        await client.call(method, path)
    assert _checks_answered(services) - before == len(calls)
    # operations routes are not the public API: no check, no limit
    await client.http.get("/healthz")
    assert _checks_answered(services) - before == len(calls)


async def test_a_path_no_route_serves_is_404_and_spends_the_address_budget(services: Services) -> None:
    """The guard checks it as "public" (so probing for paths is not free) and answers it itself: nothing outside the
    table the routes declare reaches the app."""
    c = Client(services, "", fresh_address())
    try:
        responses = [await c.call("GET", f"/v1/nowhere/{i}", None) for i in range(ADDRESS_LIMIT + 1)]
    finally:
        await c.http.aclose()
    assert [r.status_code for r in responses] == [404] * ADDRESS_LIMIT + [429]
    for r in responses:
        assert r.headers["content-type"] == "application/problem+json" and RATE_HEADERS <= set(r.headers)
    assert {r.json()["code"] for r in responses[:-1]} == {"not_found"}
    assert responses[-1].json()["rule"] == "address"


async def test_a_routes_path_with_another_method_is_405_naming_its_methods(client: Client) -> None:
    r = await client.call("PATCH", "/v1/videos")
    assert r.status_code == 405 and r.json()["code"] == "method_not_allowed"
    assert r.headers["allow"] == "GET, POST" and RATE_HEADERS <= set(r.headers)


async def test_openapi_shows_the_route_class_of_every_operation(services: Services) -> None:
    async with httpx.AsyncClient(base_url=services.api_url, timeout=30) as http:
        document = (await http.get("/openapi.json")).json()
    shown = {f"{method.upper()} {path}": operation
             for path, item in document["paths"].items() for method, operation in item.items()}
    assert {op.get("x-weir-route-class") for op in shown.values()} <= ROUTE_CLASSES
    assert shown["GET /v1/videos/{video_id}"]["x-weir-route-class"] == "secret"
    assert shown["POST /sdk/v1/videos"]["x-weir-route-class"] == "sdk"
    assert shown["GET /internal/v1/videos/{video_id}"]["x-weir-route-class"] == "internal"
    assert shown["GET /healthz"]["x-weir-route-class"] == "operations"
    rotate = shown["POST /v1/account/apps/{app_id}/keys/rotate"]
    assert (rotate["x-weir-route-class"], rotate["x-weir-operation"]) == ("management", "key_rotate")
    assert shown["POST /v1/videos/{video_id}/upload/complete"]["x-weir-body-limit"] > 0


async def test_abort_and_delete_remove_what_storage_holds(
    client: Client, media: dict[str, bytes], prepared: CommonSettings, app_keys: tuple[AccountCreated, AppCreated]
) -> None:
    from shared.storage import s3_client

    video = await create(client)
    r = await client.call("POST", f"/v1/videos/{video['id']}/upload", json={"content_type": "video/mp4"})
    upload_id = r.json()["upload_id"]
    key = domain.object_key(app_keys[1].id, video["id"])
    async with s3_client(prepared) as s3:
        listed = await s3.list_multipart_uploads(Bucket=prepared.s3_bucket, Prefix=key)
        assert upload_id in [u["UploadId"] for u in listed.get("Uploads", [])]
        assert (await client.call("DELETE", f"/v1/videos/{video['id']}/upload")).status_code == 204
        listed = await s3.list_multipart_uploads(Bucket=prepared.s3_bucket, Prefix=key)
        assert upload_id not in [u["UploadId"] for u in listed.get("Uploads", [])]
    shown = (await client.call("GET", f"/v1/videos/{video['id']}")).json()
    assert shown["status"] == "created"

    done = await create(client)
    assert (await upload(client, done["id"], media["mp4"][:300_000])).status_code == 200
    done_key = domain.object_key(app_keys[1].id, done["id"])
    assert await object_exists(prepared, done_key)
    assert (await client.call("DELETE", f"/v1/videos/{done['id']}")).status_code == 204
    assert not await object_exists(prepared, done_key)
    assert (await client.call("GET", f"/v1/videos/{done['id']}")).status_code == 404
    listed = (await client.call("GET", "/v1/videos?limit=100")).json()["videos"]
    assert done["id"] not in [v["id"] for v in listed]
    # a deleted video's upload routes answer 409 (SPEC 4), with either credential; its other routes 404
    token = (await client.call("POST", f"/v1/videos/{video['id']}/upload-token")).json()["upload_token"]
    assert (await client.call("DELETE", f"/v1/videos/{video['id']}")).status_code == 204
    for prefix, credential, gone_ids in (("/v1", "secret", (done["id"], video["id"])),
                                         ("/sdk/v1", token, (video["id"],))):
        for method, path, body in (("POST", "/upload", {"content_type": "video/mp4"}),
                                   ("POST", "/upload/parts", {"part_numbers": [1]}),
                                   ("POST", "/upload/complete", {"parts": [{"part_number": 1, "etag": "x"}]}),
                                   ("DELETE", "/upload", None)):
            for gone in gone_ids:
                r = await client.call(method, f"{prefix}/videos/{gone}{path}", credential, json=body)
                assert r.status_code == 409 and r.json()["code"] == "conflict", (prefix, path, r.text)


async def test_status_follows_encode_events(client: Client, media: dict[str, bytes], prepared: CommonSettings,
                                            app_keys: tuple[AccountCreated, AppCreated]) -> None:
    from shared.events import EncodeCompleted, EncodeStarted, new_event

    video = await create(client)
    assert (await upload(client, video["id"], media["mp4"][:300_000])).status_code == 200
    nc = await connect(prepared, name="test")
    js = nc.jetstream()
    vid = video["id"]
    events = [
        new_event(EncodeStarted(video_id=vid, output=360, worker="w1"), source="encode", subject=vid),
        new_event(EncodeCompleted(video_id=vid, output=360, worker="w1", object_key=f"renditions/{vid}/360p.mp4",
                                  size=123, outputs_remaining=0), source="encode", subject=vid),
    ]
    for ev in events:
        await js.publish(ev.type, ev.to_bytes(), headers={"Nats-Msg-Id": ev.id})
    await js.publish(events[1].type, events[1].to_bytes(), headers={"Nats-Msg-Id": f"{events[1].id}-again"})
    await nc.close()
    shown = await shown_once(client, vid, lambda v: v["status"] == "ready", "the video ready")
    assert [r["height"] for r in shown["renditions"]] == [360]  # the redelivered completion changed nothing twice
    assert shown["renditions"][0]["url"].startswith("http")
    # and the api announces it once, on its account's subject (webhooks and teams read it there)
    account = app_keys[0].account_id
    ready = await events_waited(prepared, "VIDEOS", f"video.ready.{account}", lambda e: e.data["video_id"] == vid,
                                expect=2, wait=1.5)
    assert ready == [{"video_id": vid, "app_id": app_keys[1].id, "account_id": account, "outputs": [360],
                      "duration_seconds": None, "max_width": None, "max_height": None}], ready



class RecordingClient(Client):
    """A client that keeps every JSON answer it gets, to hold them to the api's OpenAPI document."""

    def __init__(self, services: Services, secret_key: str, address: str) -> None:
        super().__init__(services, secret_key, address)
        self.answers: list[HttpAnswer] = []

    async def call(self, method: str, path: str, credential: str | None = "secret", **kw: Any) -> httpx.Response:
        r = await super().call(method, path, credential, **kw)
        if (answer := HttpAnswer.of(r)) is not None:
            self.answers.append(answer)
        return r


async def test_every_answer_about_a_video_is_as_the_openapi_document_says(
    services: Services, app_keys: tuple[AccountCreated, AppCreated], media: dict[str, bytes],
    prepared: CommonSettings,
) -> None:
    """A video's whole life and its refusals, each JSON answer validated against the api's own /openapi.json (its
    route, status and media type's schema): a drift between the document and the bytes served fails here."""
    from shared.events import EncodeCompleted, EncodeStarted, new_event

    async with httpx.AsyncClient(base_url=services.api_url, timeout=30) as http:
        document = (await http.get("/openapi.json")).json()
    get_one = document["paths"]["/v1/videos/{video_id}"]["get"]["responses"]["200"]["content"]["application/json"]
    assert get_one["schema"] == {"$ref": "#/components/schemas/VideoShown"}  # typed, not "any object"
    app = app_keys[1]
    c = RecordingClient(services, app.secret_key, fresh_address())
    try:
        video = await create(c, metadata={"team": "a"})
        vid = video["id"]
        page = await c.call("POST", "/sdk/v1/videos", app.publishable_key, json={"name": "from a page"},
                            headers={"Origin": "https://app.example"})
        assert page.status_code == 201, page.text
        changed = await c.call("PATCH", f"/v1/videos/{vid}", json={"name": "renamed", "playback_policy": "signed"})
        assert changed.status_code == 200 and changed.json()["playback"]["policy"] == "signed", changed.text
        assert (await upload(c, vid, media["mp4"][:300_000])).status_code == 200  # initiate, parts, complete
        again = await c.call("POST", f"/v1/videos/{vid}/upload/complete",
                             json={"parts": [{"part_number": 1, "etag": "x"}]})
        assert again.status_code == 200, again.text
        assert (await c.call("GET", f"/sdk/v1/videos/{vid}", video["upload_token"])).status_code == 200

        # encode's events: processing (the api's projection: no encode runs beside this module's api), then ready
        nc = await connect(prepared, name="test")
        js = nc.jetstream()
        for ev in (new_event(EncodeStarted(video_id=vid, output=360, worker="w1"), source="encode", subject=vid),
                   new_event(EncodeCompleted(video_id=vid, output=360, worker="w1", size=123, outputs_remaining=0,
                                             object_key=f"renditions/{vid}/360p.mp4"), source="encode", subject=vid)):
            await js.publish(ev.type, ev.to_bytes(), headers={"Nats-Msg-Id": ev.id})
        await nc.close()
        shown = await shown_once(c, vid, lambda v: v["status"] == "ready", "the video ready")
        assert shown["renditions"] and shown["processing"]["outputs"], shown

        # a file that is no video: refused, and the video failed with its reason
        other = await create(c)
        assert (await upload(c, other["id"], media["mp3"])).status_code == 422
        assert (await c.call("GET", f"/v1/videos/{other['id']}")).json()["failure"] is not None

        first = (await c.call("GET", "/v1/videos?limit=1")).json()
        assert first["next_cursor"], first
        assert (await c.call("GET", f"/v1/videos?limit=1&cursor={first['next_cursor']}")).status_code == 200

        refusals = [
            await c.call("GET", f"/v1/videos/{uuid.uuid4()}"),  # 404
            await c.call("PATCH", f"/v1/videos/{vid}", json={}),  # 400
            await c.call("GET", "/v1/videos?cursor=not-a-cursor"),  # 400
            await c.call("POST", f"/v1/videos/{vid}/upload", json={"content_type": "video/mp4"}),  # 409: has its file
            await c.call("GET", "/v1/videos", None),  # 401
        ]
        assert [r.status_code for r in refusals] == [404, 400, 400, 409, 401]
    finally:
        await c.http.aclose()
    answers = OpenApiAnswers(document)
    drift = answers.unexplained(c.answers)
    assert not drift, "answers the OpenAPI document does not describe as served:\n" + "\n".join(drift)
    validated = {(a.method, answers.template(a.method, a.path), a.status) for a in c.answers}
    for route in ("POST /v1/videos 201", "POST /sdk/v1/videos 201", "PATCH /v1/videos/{video_id} 200",
                  "GET /v1/videos/{video_id} 200", "GET /sdk/v1/videos/{video_id} 200", "GET /v1/videos 200",
                  "POST /v1/videos/{video_id}/upload/complete 200", "GET /v1/videos/{video_id} 404"):
        method, template, status = route.split(" ")
        assert (method, template, int(status)) in validated, route

async def test_a_status_reply_from_a_newer_encode_is_read_with_its_fallbacks(
    client: Client, media: dict[str, bytes], prepared: CommonSettings
) -> None:
    """encode.status answered as a newer encode might (fields added, a processing state and an output state this
    release does not know): the video shows its own status and the unknown output state as pending."""
    import json

    from nats.aio.msg import Msg

    from shared.media.protocol import STATUS_SUBJECT, StatusRequest

    video = await create(client)
    assert (await upload(client, video["id"], media["mp4"][:300_000])).status_code == 200
    said = {"status": "paused_by_operator"}

    async def newer_encode(msg: Msg) -> None:
        asked = StatusRequest.model_validate_json(msg.data)
        await msg.respond(json.dumps({
            "video_id": asked.video_id, "found": True, "status": said["status"], "priority": 3,
            "outputs": [{"height": 360, "state": "throttled", "worker": "w9", "eta_seconds": 4},
                        {"height": 720, "state": "encoding", "worker": "w8", "started_at": None}],
        }).encode())

    nc = await connect(prepared, name="test")
    sub = await nc.subscribe(STATUS_SUBJECT, cb=newer_encode)  # no encode runs beside this module's api
    await nc.flush()

    async def shown_from_the_reply() -> dict[str, Any]:
        # the api waits a quarter second for encode, then shows its projection instead
        return await shown_once(client, video["id"], lambda v: v["processing"] is not None, "encode's reply shown")

    try:
        shown = await shown_from_the_reply()
        assert shown["status"] == "uploaded"  # a processing state it does not know: its own status
        assert [(o["height"], o["state"], o["worker"]) for o in shown["processing"]["outputs"]] == [
            (360, "pending", "w9"), (720, "encoding", "w8")]  # an output state it does not know: pending
        said["status"] = "processing"  # the control: a state it knows is read
        assert (await shown_from_the_reply())["status"] == "processing"
    finally:
        await sub.unsubscribe()
        await nc.close()
