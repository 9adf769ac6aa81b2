"""Idempotency keys on creating a video, over real HTTP (auth and the api as processes, the session's PostgreSQL, S3
and NATS): a create sent again with its `Idempotency-Key` (a retry after a lost answer) answers the video the first
one made, never a second video; the same key with another body is refused; keys are the app's own and expire."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest

from shared.authcheck import AppCreated
from shared.settings import CommonSettings
from tests.integration.apihelpers import UNLIMITED, Client, Services, new_app, run_services
from tests.integration.authhelpers import fresh_address

pytestmark = pytest.mark.asyncio(loop_scope="session")

KEY_TTL_S = 3  # short, so that a key's expiry is seen
AT_ONCE = 6  # the same create sent this many times at once


@pytest.fixture(scope="module")
def services(stack_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Services]:
    with run_services(stack_env, tmp_path_factory.mktemp("logs"), idempotency_key_ttl_seconds=str(KEY_TTL_S),
                      **UNLIMITED) as s:
        yield s


@pytest.fixture
async def app(services: Services, prepared: CommonSettings) -> AppCreated:
    return await new_app(prepared, "idempotent")


@pytest.fixture
async def client(services: Services, app: AppCreated) -> AsyncIterator[Client]:
    c = Client(services, app.secret_key, fresh_address())
    yield c
    await c.http.aclose()


async def create(client: Client, key: str | None, *, credential: str | None = "secret", prefix: str = "/v1",
                 policy: str = "public", **body: Any) -> httpx.Response:
    headers = {"Idempotency-Key": key} if key is not None else {}
    return await client.call("POST", f"{prefix}/videos", credential, params={"playback_policy": policy},
                             json={"name": "clip", **body}, headers=headers)


async def listed(client: Client) -> list[str]:
    r = await client.call("GET", "/v1/videos", params={"limit": 100})
    assert r.status_code == 200, r.text
    return [v["id"] for v in r.json()["videos"]]


def problem_code(r: httpx.Response) -> str:
    assert r.headers["content-type"].startswith("application/problem+json"), r.text
    return str(r.json()["code"])


async def test_a_create_sent_again_with_its_key_answers_the_first_video_with_a_fresh_upload_token(
    client: Client
) -> None:
    first = await create(client, "order-1234", metadata={"a": 1})
    assert first.status_code == 201 and "idempotent-replayed" not in first.headers, first.text
    again = await create(client, "order-1234", metadata={"a": 1})
    assert again.status_code == 201 and again.headers["idempotent-replayed"] == "true", again.text
    assert again.json()["id"] == first.json()["id"]
    assert {k: v for k, v in again.json().items() if not k.startswith("upload_token")} == {
        k: v for k, v in first.json().items() if not k.startswith("upload_token")}
    # the token minted again works for the video (tokens expire: a replay does not hand back an old one)
    token = again.json()["upload_token"]
    r = await client.call("GET", f"/sdk/v1/videos/{first.json()['id']}", token)
    assert r.status_code == 200, r.text
    assert await listed(client) == [first.json()["id"]]
    # without a key, or with another one, each create makes its own video
    assert (await create(client, None)).json()["id"] != first.json()["id"]
    assert (await create(client, "order-1235")).json()["id"] != first.json()["id"]
    assert len(await listed(client)) == 3


async def test_the_same_create_sent_at_once_makes_one_video(client: Client) -> None:
    answers = await asyncio.gather(*(create(client, "burst") for _ in range(AT_ONCE)))
    assert all(r.status_code == 201 for r in answers), [r.text for r in answers]
    assert len({r.json()["id"] for r in answers}) == 1
    assert sum(r.headers.get("idempotent-replayed") == "true" for r in answers) == AT_ONCE - 1
    assert len(await listed(client)) == 1


async def test_a_key_used_for_another_request_is_refused_and_a_bad_key_is_a_400(client: Client) -> None:
    assert (await create(client, "k")).status_code == 201
    for changed in ({"name": "another"}, {"metadata": {"b": 2}}):
        r = await create(client, "k", **changed)
        assert r.status_code == 422 and problem_code(r) == "idempotency_key_reused", r.text
    r = await create(client, "k", policy="signed")
    assert r.status_code == 422 and problem_code(r) == "idempotency_key_reused", r.text
    for bad in ("", "x" * 256, "caf\u00e9", "a\tb"):
        r = await client.call("POST", "/v1/videos", json={"name": "clip"},
                              headers={"Idempotency-Key": bad.encode()})
        assert r.status_code == 400 and problem_code(r) == "validation_error", (bad, r.text)
    assert len(await listed(client)) == 1


async def test_keys_are_the_apps_own_shared_by_its_keys_and_expire(client: Client, services: Services,
                                                                   prepared: CommonSettings, app: AppCreated) -> None:
    mine = (await create(client, "shared")).json()["id"]
    other = Client(services, (await new_app(prepared, "another")).secret_key, fresh_address())
    try:
        theirs = await create(other, "shared")
        assert theirs.status_code == 201 and theirs.json()["id"] != mine
        assert "idempotent-replayed" not in theirs.headers
    finally:
        await other.http.aclose()
    # the app's browser route (its publishable key) sees the same keys: a page and its server agree on one
    r = await create(client, "page-1", credential=app.publishable_key, prefix="/sdk/v1")
    assert r.status_code == 201, r.text
    again = await create(client, "page-1", credential=app.publishable_key, prefix="/sdk/v1")
    assert again.json()["id"] == r.json()["id"] and again.headers["idempotent-replayed"] == "true"
    # past its lifetime a key makes a new video
    time.sleep(KEY_TTL_S + 0.5)
    later = await create(client, "shared")
    assert later.status_code == 201 and later.json()["id"] != mine and "idempotent-replayed" not in later.headers


async def test_a_replay_of_a_deleted_videos_create_says_so(client: Client) -> None:
    vid = (await create(client, "gone")).json()["id"]
    assert (await client.call("DELETE", f"/v1/videos/{vid}")).status_code == 204
    r = await create(client, "gone")
    assert r.status_code == 409 and problem_code(r) == "conflict" and vid in r.json()["detail"], r.text


async def test_a_browser_may_send_the_key_across_origins(client: Client) -> None:
    """The preflight of a page's create lets the header through (the JS SDK sends one with every create)."""
    r = await client.call("OPTIONS", "/sdk/v1/videos", None, headers={
        "Origin": "https://pages.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type, idempotency-key"})
    assert r.status_code == 204, r.text
    allowed = {h.strip() for h in r.headers["access-control-allow-headers"].split(",")}
    assert "idempotency-key" in allowed, r.headers
