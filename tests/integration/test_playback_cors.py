"""The guard's own answers on the player routes, readable from any page, over real HTTP (SPEC 14).

The player routes (class `public`: playlists, files, thumbnails, storyboards) answer any origin with
`Access-Control-Allow-Origin: *`. The guard in front answers some of their requests itself: 429 past the address's
budget, 413, 503 when auth does not answer or sheds the check, 401/403 when auth refuses. Those carry the same ACAO
and expose Retry-After and the rate-limit headers, so that a player (hls.js) on another origin reads the status and
waits as told instead of meeting a network error. Routes of other classes are unchanged: no ACAO on their refusals.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import nats
import pytest
from nats.aio.msg import Msg

from services.auth.batched import OVERLOADED_REPLY
from shared.authcheck import CHECK_SUBJECT, QUEUE_GROUP
from shared.authclient import create_account_with_app
from shared.bus import VERSION_HEADER
from tests.integration.apihelpers import Services, private_bus, readable_from_any_page, run_services
from tests.integration.authhelpers import fresh_address

pytestmark = pytest.mark.asyncio(loop_scope="session")

# one request on each player route template, with a video id and (for the files) a height and a file name
PLAYER_PATHS = ("/v1/playback/{id}/master.m3u8", "/v1/playback/{id}/90/index.m3u8",
                "/v1/playback/{id}/90/seg-00001.m4s", "/v1/videos/{id}/thumbnail.jpg",
                "/v1/videos/{id}/storyboard.vtt", "/v1/videos/{id}/storyboard.jpg")
ADDRESS_LIMIT = len(PLAYER_PATHS)  # a player's address may ask each route once
LIMITS = {"limit_address_per_minute": str(ADDRESS_LIMIT), "limit_key_per_minute": "100000",
          "limit_owner_per_minute": "100000", "limit_upload_token_per_minute": "100000"}
PAGE = "https://player.example"  # the player's page: another origin than the api's
@pytest.fixture(scope="module")
def services(bus_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Services]:
    with run_services(bus_env, tmp_path_factory.mktemp("logs"), **LIMITS) as s:
        yield s


@pytest.fixture(scope="module")
async def video_id(services: Services, bus_env: dict[str, str]) -> str:
    """A public video, not encoded (this stack has no encode): the player routes answer it 403/404/409 themselves."""
    nc = await nats.connect(bus_env["WEIR_NATS_URL"])  # the module's own server: no identities
    try:
        _, app = await create_account_with_app(nc, "playback-cors")
    finally:
        await nc.close()
    async with httpx.AsyncClient(base_url=services.api_url, timeout=30) as http:
        r = await http.post("/v1/videos", json={"name": "cors"},
                            headers={"Authorization": f"Bearer {app.secret_key}", "X-Forwarded-For": fresh_address()})
        assert r.status_code == 201, r.text
        return str(r.json()["id"])


@pytest.fixture
async def player(services: Services) -> AsyncIterator[httpx.AsyncClient]:
    """A browser's player on another origin: no credential, an address of its own."""
    async with httpx.AsyncClient(base_url=services.api_url, timeout=30,
                                 headers={"X-Forwarded-For": fresh_address(), "Origin": PAGE}) as http:
        yield http


async def test_a_player_past_its_address_limit_reads_the_429_and_its_retry_after(
        player: httpx.AsyncClient, video_id: str) -> None:
    paths = [p.format(id=video_id) for p in PLAYER_PATHS]
    for path in paths:  # within the budget: the routes' own answers, their ACAO once, the limit headers exposed
        r = await player.get(path)
        assert r.status_code in (403, 404, 409), (path, r.status_code, r.text)
        assert r.json()["code"] != "rate_limited"
        assert readable_from_any_page(r), (path, r.headers)
        assert "ratelimit" in r.headers
    for path in paths:  # past it: the guard's 429, as readable
        r = await player.get(path)
        assert r.status_code == 429, (path, r.text)
        assert r.json()["code"] == "rate_limited" and r.json()["rule"] == "address"
        assert readable_from_any_page(r), (path, r.headers)
        assert int(r.headers["retry-after"]) > 0 and "ratelimit" in r.headers
    # other routes by their class, whatever their path: a secret route, and a path under /v1/playback/ no route serves
    for path in ("/v1/videos", f"/v1/playback/{video_id}"):
        r = await player.get(path)
        assert r.status_code == 429, (path, r.text)
        assert "access-control-allow-origin" not in r.headers, (path, r.headers)


async def test_a_body_too_large_on_a_player_route_is_readable(player: httpx.AsyncClient, video_id: str) -> None:
    r = await player.request("GET", f"/v1/videos/{video_id}/storyboard.vtt", content=b"x" * (64 * 1024 + 1))
    assert r.status_code == 413, r.text
    assert readable_from_any_page(r), r.headers


async def test_a_player_reads_the_503s_and_refusals_when_auth_does_not_allow(
        stack_env: dict[str, str], tmp_path: Path) -> None:
    """Only the api, on a NATS server of the test's own: no auth answers (503 `unavailable`), then a responder in
    auth's place sheds every check with auth's own reply (503 `overloaded`), then refuses it 403."""
    (tmp_path / "nats").mkdir()
    with private_bus(stack_env, tmp_path / "nats") as env, \
            run_services(env, tmp_path, names=("api",), auth_timeout_ms="300") as api:
        async with httpx.AsyncClient(base_url=api.api_url, timeout=10,
                                     headers={"X-Forwarded-For": fresh_address(), "Origin": PAGE}) as http:
            master = "/v1/playback/vid_1/master.m3u8"
            r = await http.get(master)
            assert r.status_code == 503 and r.json()["code"] == "unavailable", r.text
            assert readable_from_any_page(r), r.headers
            assert r.headers["retry-after"] == "1"
            for other in (http.get("/v1/videos"), http.post("/sdk/v1/videos", json={"name": "x"})):
                r = await other  # a secret route's; an SDK route's with no app known: unreadable as before
                assert r.status_code == 503 and "access-control-allow-origin" not in r.headers, r.headers

            nc = await nats.connect(env["WEIR_NATS_URL"])  # the test's own server admits anyone
            answer = {"body": OVERLOADED_REPLY}

            async def respond(msg: Msg) -> None:
                await nc.publish(msg.reply, answer["body"], headers=dict(VERSION_HEADER))

            try:
                await nc.subscribe(CHECK_SUBJECT, queue=QUEUE_GROUP, cb=respond)
                await nc.flush()
                r = await http.get("/v1/videos/vid_1/thumbnail.jpg")
                assert r.status_code == 503 and r.json()["code"] == "overloaded", r.text
                assert readable_from_any_page(r), r.headers

                problem = {"type": "about:blank", "title": "Forbidden", "status": 403, "code": "forbidden",
                           "detail": "refused"}
                answer["body"] = json.dumps({
                    "allowed": False, "status": 403, "problem": problem, "identity": None,
                    "client_address": "10.9.8.7", "headers": {"RateLimit": '"address";r=5;t=60'}}).encode()
                r = await http.get("/v1/videos/vid_1/storyboard.vtt")
                assert r.status_code == 403 and r.json()["code"] == "forbidden", r.text
                assert readable_from_any_page(r) and r.headers["ratelimit"] == '"address";r=5;t=60', r.headers
            finally:
                await nc.close()
