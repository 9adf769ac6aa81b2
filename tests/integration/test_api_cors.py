"""CORS on the SDK routes, and the listing of stored parts, over real HTTP with real auth, PostgreSQL, S3 and NATS.

SPEC 4 (browsers): every SDK route answers CORS for the app's allowed origins (preflights, real answers and
refusals) and exposes the rate-limit headers; a page on another origin can read no response.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest

from shared.authcheck import AccountCreated, AppCreated
from shared.authclient import create_account_with_app
from shared.bus import connect
from shared.settings import CommonSettings
from tests.integration.apihelpers import Client, Services, run_services
from tests.integration.authhelpers import fresh_address

pytestmark = pytest.mark.asyncio(loop_scope="session")

ADDRESS_LIMIT = 40  # above auth_failure's 30: preflights that counted as failed credentials would meet the block
TOKEN_LIMIT = 25
ALLOWED = "https://shop.example"
OTHER = "https://evil.example"
EXPOSED = {"ratelimit", "ratelimit-policy", "retry-after", "x-ratelimit-limit", "x-ratelimit-remaining",
           "x-ratelimit-reset", "etag", "location"}


@pytest.fixture(scope="module")
def services(stack_env: dict[str, str], prepared: CommonSettings, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[Services]:
    with run_services(stack_env, tmp_path_factory.mktemp("logs"), limit_address_per_minute=str(ADDRESS_LIMIT),
                      limit_upload_token_per_minute=str(TOKEN_LIMIT), limit_key_per_minute="100000",
                      limit_owner_per_minute="100000") as s:
        yield s


@pytest.fixture
async def app_keys(services: Services, prepared: CommonSettings) -> AsyncIterator[tuple[AccountCreated, AppCreated]]:
    nc = await connect(prepared, name="test")
    account, app = await create_account_with_app(nc, "cors", allowed_origins=(ALLOWED, "http://localhost:3000"))
    await nc.close()
    yield account, app


@pytest.fixture
async def client(services: Services, app_keys: tuple[AccountCreated, AppCreated]) -> AsyncIterator[Client]:
    c = Client(services, app_keys[1].secret_key, fresh_address())
    yield c
    await c.http.aclose()


def readable_by(r: httpx.Response, origin: str) -> bool:
    """Whether a page on `origin` can read the answer (and its rate-limit headers), as a browser decides."""
    if r.headers.get("access-control-allow-origin") != origin:
        return False
    assert "Origin" in r.headers.get("vary", ""), r.headers
    exposed = {h.strip().lower() for h in r.headers["access-control-expose-headers"].split(",")}
    assert EXPOSED <= exposed, exposed
    return True


def unreadable(r: httpx.Response) -> bool:
    return "access-control-allow-origin" not in r.headers and "Origin" in r.headers.get("vary", "")


async def sdk_video(c: Client, pk: str, origin: str = ALLOWED) -> dict[str, str]:
    r = await c.call("POST", "/sdk/v1/videos", pk, json={"name": "b"}, headers={"Origin": origin})
    assert r.status_code == 201, r.text
    assert readable_by(r, origin)
    return dict(r.json())


async def lookups(services: Services) -> float:
    """auth's credential lookups that went to the database so far."""
    async with httpx.AsyncClient() as h:
        text = (await h.get(f"{services.urls['auth']}/metrics")).text
    found = re.findall(r"^\S*credential_lookups_total(?:\{[^}]*\})? (\S+)$", text, re.M)
    return sum(float(v) for v in found)


# ----------------------------------------------------------------------------------------------- tests


async def test_preflights_are_answered_counted_on_the_address_and_cost_no_lookup(services: Services) -> None:
    c = Client(services, "", fresh_address())
    start = await lookups(services)
    r = await c.call("POST", "/sdk/v1/videos", "wpk_" + secrets.token_hex(16), json={"name": "n"})
    assert r.status_code == 401
    before = await lookups(services)
    assert before > start  # the metric is the one that counts lookups
    try:
        path = "/sdk/v1/videos/0b6f3c1e-0000-4000-8000-000000000000/upload/parts"
        answers = [await c.http.options(path, headers={
            "X-Forwarded-For": c.address, "Origin": ALLOWED, "Access-Control-Request-Method": "GET",
            "Access-Control-Request-Headers": "authorization", "Authorization": "Bearer wpk_" + secrets.token_hex(16),
        }) for _ in range(ADDRESS_LIMIT)]
    finally:
        await c.http.aclose()
    first = answers[0]
    assert first.status_code == 204, first.text
    assert first.headers["access-control-allow-origin"] == ALLOWED
    assert first.headers["access-control-allow-methods"] == "GET, POST"
    assert first.headers["access-control-allow-headers"] == "authorization, content-type, idempotency-key"
    assert int(first.headers["access-control-max-age"]) > 0 and first.headers["vary"] == "Origin"
    # counted on the address like any request (past auth_failure's 30: no preflight is a failed credential)
    assert [r.status_code for r in answers] == [204] * (ADDRESS_LIMIT - 1) + [429]  # the 401 above spent one
    assert answers[-1].json()["rule"] == "address" and "access-control-allow-origin" not in answers[-1].headers
    assert await lookups(services) == before  # the credential a preflight may carry is never looked up
    methods = {"/sdk/v1/videos": "POST", "/sdk/v1/videos/x/upload": "DELETE, POST",
               "/sdk/v1/videos/x/upload/complete": "POST"}
    async with httpx.AsyncClient(base_url=services.api_url) as h:
        for route, allowed in methods.items():
            r = await h.options(route, headers={"X-Forwarded-For": fresh_address(), "Origin": OTHER,
                                                "Access-Control-Request-Method": "POST"})
            assert r.status_code == 204 and r.headers["access-control-allow-methods"] == allowed, (route, r.text)


async def test_an_allowed_origin_reads_answers_and_refusals_and_another_reads_none(
    client: Client, app_keys: tuple[AccountCreated, AppCreated]
) -> None:
    pk = app_keys[1].publishable_key
    video = await sdk_video(client, pk)
    other_video = await sdk_video(client, pk)
    token, path = video["upload_token"], f"/sdk/v1/videos/{video['id']}/upload"

    async def both(method: str, route: str, credential: str | None, status: int, **kw: object) -> None:
        """The same request from a page on the allowed origin and from one on another: same answer, one readable."""
        for origin in (ALLOWED, OTHER):
            r = await client.call(method, route, credential, headers={"Origin": origin}, **kw)  # type: ignore[arg-type]
            assert r.status_code == status, (origin, r.text)
            if origin == ALLOWED:
                assert readable_by(r, ALLOWED), (status, r.headers)
            else:
                assert unreadable(r), (status, r.headers)

    await both("POST", f"{path}/parts", token, 409, json={"part_numbers": [1]})  # no upload open yet
    await both("GET", f"{path}/parts", token, 409)
    await both("POST", path, token, 200, json={"content_type": "video/mp4"})
    await both("POST", path, token, 400, json={"content_type": "no type"})
    await both("POST", f"{path}/parts", token, 200, json={"part_numbers": [1, 2]})
    await both("GET", f"{path}/parts", token, 200)
    for origin in (ALLOWED, OTHER):  # the guard's own refusal: the body is past the route's limit
        r = await client.call("POST", f"{path}/parts", token, content=b"x" * (300 * 1024),
                              headers={"Origin": origin, "content-type": "application/json"})
        assert r.status_code == 413, r.text
        assert readable_by(r, ALLOWED) if origin == ALLOWED else unreadable(r)
    await both("POST", f"/sdk/v1/videos/{other_video['id']}/upload", token, 403, json={"content_type": "video/mp4"})
    await both("POST", path, pk, 401, json={"content_type": "video/mp4"})  # a publishable key names its app
    # the video's status, for the page that uploaded it: its token's video only, never with the publishable key
    await both("GET", f"/sdk/v1/videos/{video['id']}", token, 200)
    await both("GET", f"/sdk/v1/videos/{other_video['id']}", token, 403)
    await both("GET", f"/sdk/v1/videos/{video['id']}", pk, 401)
    shown = await client.call("GET", f"/sdk/v1/videos/{video['id']}", token)
    assert shown.json()["id"] == video["id"] and shown.json()["status"] == "uploading", shown.text
    r = await client.call("POST", "/sdk/v1/videos", pk, json={"name": "c"}, headers={"Origin": OTHER})
    assert r.status_code == 403 and unreadable(r)  # and nothing was created
    await both("DELETE", path, token, 204)
    # a credential that names no app: nobody can read the refusal
    for credential in ("wpk_" + "y" * 32, token[:-4] + "AAAA"):
        r = await client.call("POST", path, credential, json={"content_type": "video/mp4"},
                              headers={"Origin": ALLOWED})
        assert r.status_code == 401 and unreadable(r), r.text
    # the upload token's budget spent: the 429 is readable by the page, with its Retry-After
    for _ in range(TOKEN_LIMIT + 1):  # windows of an hour (run_services): the budget and one more
        r = await client.call("GET", f"{path}/parts", token, headers={"Origin": ALLOWED})
        if r.status_code == 429:
            break
    assert r.status_code == 429 and readable_by(r, ALLOWED) and int(r.headers["retry-after"]) >= 1, r.text
    r = await client.call("GET", f"{path}/parts", token, headers={"Origin": OTHER})
    assert r.status_code == 429 and unreadable(r)


async def test_an_expired_or_orphaned_token_still_names_its_app(
    client: Client, app_keys: tuple[AccountCreated, AppCreated]
) -> None:
    """A token whose key was revoked is refused, and the page of an allowed origin can read why."""
    account, app = app_keys
    video = await sdk_video(client, app.publishable_key)
    revoke = await client.call("DELETE", f"/v1/account/keys/{app.publishable_key_id}", account.account_token)
    assert revoke.status_code == 204, revoke.text
    path = f"/sdk/v1/videos/{video['id']}/upload"
    for _ in range(100):
        r = await client.call("POST", path, video["upload_token"], json={"content_type": "video/mp4"},
                              headers={"Origin": ALLOWED})
        if r.status_code == 401:
            break
    assert r.status_code == 401 and readable_by(r, ALLOWED), r.text
    r = await client.call("POST", path, video["upload_token"], json={"content_type": "video/mp4"},
                          headers={"Origin": OTHER})
    assert r.status_code == 401 and unreadable(r)


async def test_stored_parts_are_listed_to_resume_an_upload(client: Client) -> None:
    r = await client.call("POST", "/v1/videos", json={"name": "resume"})
    assert r.status_code == 201, r.text
    video = r.json()
    token = video["upload_token"]
    for prefix, credential in (("/sdk/v1", token), ("/v1", "secret")):
        r = await client.call("GET", f"{prefix}/videos/{video['id']}/upload/parts", credential)
        assert r.status_code == 409 and r.json()["code"] == "conflict", r.text
    path = f"/sdk/v1/videos/{video['id']}/upload"
    r = await client.call("POST", path, token, json={"content_type": "video/mp4"})
    assert r.status_code == 200, r.text
    r = await client.call("GET", f"{path}/parts", token, headers={"Origin": ALLOWED})
    assert r.status_code == 200 and r.json() == {"parts": []} and readable_by(r, ALLOWED)
    r = await client.call("POST", f"{path}/parts", token, json={"part_numbers": [1, 2]})
    urls = {p["part_number"]: p["url"] for p in r.json()["parts"]}
    sizes = {1: 70_000, 2: 12_345}
    etags = {}
    async with httpx.AsyncClient(timeout=60) as s3:
        for n in (2, 1):
            put = await s3.put(urls[n], content=bytes([n]) * sizes[n])
            assert put.status_code == 200, put.text
            etags[n] = put.headers["etag"]
    want = [{"part_number": n, "etag": etags[n], "size": sizes[n]} for n in (1, 2)]
    for prefix, credential in (("/sdk/v1", token), ("/v1", "secret")):
        r = await client.call("GET", f"{prefix}/videos/{video['id']}/upload/parts", credential)
        assert r.status_code == 200, r.text
        assert r.json() == {"parts": want}
    r = await client.call("DELETE", path, token)
    assert r.status_code == 204, r.text
    r = await client.call("GET", f"{path}/parts", token)
    assert r.status_code == 409 and r.json()["code"] == "conflict", r.text
