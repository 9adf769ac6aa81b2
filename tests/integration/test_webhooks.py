"""Webhooks end to end (SPEC 13): the api's routes with a secret key, the webhooks service delivering real events to
real HTTP receivers on 127.0.0.1, signed (verified with the `standardwebhooks` package), retried, in order per video,
isolated per endpoint, disabled on 410 and on long failure, rotated, logged and replayed."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import pytest
from standardwebhooks import Webhook

from services.webhooks.manage import duration
from services.webhooks.settings import WebhookSettings
from shared.authcheck import AccountCreated, AppCreated
from shared.authclient import create_account_with_app
from shared.bus import HDR_MSG_ID, connect
from shared.events import EncodeStarted, UploadCompleted, new_event
from shared.settings import CommonSettings
from tests.integration.apihelpers import Client, Services, create, run_services, upload
from tests.integration.authhelpers import fresh_address
from tests.waiting import wait_for
from tests.webhookreceiver import Received, WebhookReceiver, fail_then_ok, gone, hang, ok, redirect, status

pytestmark = pytest.mark.asyncio(loop_scope="session")

# shrunk SPEC 13 numbers: retries every few hundredths of a second, a window of seconds, a short timeout
INTERVALS = [0.05, 0.1]
SETTINGS = WebhookSettings(webhook_retry_intervals_seconds=INTERVALS, webhook_retry_window_seconds=2.0,
                           webhook_disable_after_seconds=3.0, webhook_delivery_timeout_seconds=1.0,
                           webhook_claim_grace_seconds=0.5, webhook_scan_seconds=0.2, webhook_allow_private=True,
                           webhook_order_gate=True)  # two instances (see `services`): the gate keeps the order
WAIT = 20.0  # a busy machine starts and delivers slowly; every wait ends as soon as what it waits for is there


def _env(s: WebhookSettings) -> dict[str, str]:
    names = ("webhook_retry_intervals_seconds", "webhook_retry_window_seconds", "webhook_disable_after_seconds",
             "webhook_delivery_timeout_seconds", "webhook_claim_grace_seconds", "webhook_scan_seconds",
             "webhook_allow_private", "webhook_order_gate")
    return {n: json.dumps(getattr(s, n)) if isinstance(getattr(s, n), list) else str(getattr(s, n)).lower()
            if isinstance(getattr(s, n), bool) else str(getattr(s, n)) for n in names}


@pytest.fixture(scope="module")
def services(stack_env: dict[str, str], prepared: CommonSettings, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[Services]:
    # two webhooks instances: they share the durables and the deliveries (claims), as replicas do
    with run_services(stack_env, tmp_path_factory.mktemp("logs"), names=("auth", "api", "webhooks", "webhooks"),
                      limit_address_per_minute="100000", limit_key_per_minute="100000",
                      limit_owner_per_minute="100000", **_env(SETTINGS)) as s:
        yield s


@pytest.fixture(scope="module")
def receiver() -> Iterator[WebhookReceiver]:
    with WebhookReceiver(default=ok()) as r:  # a path a test does not route answers 204
        yield r


@pytest.fixture
async def app(services: Services, prepared: CommonSettings) -> tuple[AccountCreated, AppCreated]:
    nc = await connect(prepared, name="test")
    try:
        return await create_account_with_app(nc, "webhooks")
    finally:
        await nc.close()


@pytest.fixture
async def client(services: Services, app: tuple[AccountCreated, AppCreated]) -> AsyncIterator[Client]:
    c = Client(services, app[1].secret_key, fresh_address())
    yield c
    await c.http.aclose()


_paths = iter(range(1_000_000))


def path(name: str) -> str:
    return f"/{name}-{next(_paths)}"


async def endpoint(client: Client, receiver: WebhookReceiver, at: str, events: list[str] | None = None
                   ) -> dict[str, Any]:
    r = await client.call("POST", "/v1/webhooks", json={"url": receiver.url(at), "events": events or ["*"]})
    assert r.status_code == 201, r.text
    return dict(r.json())


def verified(request: Received, secret: str) -> dict[str, Any]:
    """The delivery's body, verified with the Standard Webhooks package (raises if it does not verify)."""
    payload = Webhook(secret).verify(request.body, request.headers)
    assert isinstance(payload, dict)
    assert payload["id"] == request.headers["webhook-id"]
    return payload


def types(requests: list[Received]) -> list[str]:
    return [json.loads(r.body)["type"] for r in requests]


async def log_of(client: Client, webhook_id: str, **query: str) -> list[dict[str, Any]]:
    r = await client.call("GET", f"/v1/webhooks/{webhook_id}/deliveries", params=query)
    assert r.status_code == 200, r.text
    return list(r.json()["deliveries"])


# ------------------------------------------------------------------------------------------------ the routes


async def test_an_endpoint_is_made_with_a_secret_shown_once_and_listed_without_it(
        client: Client, receiver: WebhookReceiver) -> None:
    made = await endpoint(client, receiver, path("made"), ["video.*", "encode.completed"])
    assert made["secret"].startswith("whsec_") and made["enabled"] is True
    assert made["events"] == ["encode.completed", "video.*"]
    listed = (await client.call("GET", "/v1/webhooks")).json()["webhooks"]
    assert [e["id"] for e in listed] == [made["id"]] and "secret" not in listed[0]
    one = await client.call("GET", f"/v1/webhooks/{made['id']}")
    assert one.status_code == 200 and "secret" not in one.json()
    changed = await client.call("PATCH", f"/v1/webhooks/{made['id']}", json={"events": ["*"], "description": "all"})
    assert changed.status_code == 200 and changed.json()["events"] == ["*"]
    for loose in ({"enabled": "yes"}, {"enabled": "off"}, {"enabled": 1}, {"enabled": None}, {"url": None}):
        r = await client.call("PATCH", f"/v1/webhooks/{made['id']}", json=loose)
        assert r.status_code == 400 and r.json()["code"] == "validation_error", (loose, r.text)
    assert (await client.call("GET", f"/v1/webhooks/{made['id']}")).json()["enabled"] is True
    assert (await client.call("DELETE", f"/v1/webhooks/{made['id']}")).status_code == 204
    assert (await client.call("GET", f"/v1/webhooks/{made['id']}")).status_code == 404


@pytest.mark.parametrize(("body", "status_code", "code"), [
    ({"url": "ftp://example.com/x", "events": ["*"]}, 400, "invalid_url"),
    ({"url": "https://user:pw@example.com/x", "events": ["*"]}, 400, "invalid_url"),
    ({"url": "https://169.254.169.254/latest", "events": ["*"]}, 400, "invalid_url"),  # never, even in development
    ({"url": "https://example.com/x", "events": ["video.creatd"]}, 400, "invalid_events"),
    ({"url": "https://example.com/x", "events": ["credential.rejected"]}, 400, "invalid_events"),  # not public
    ({"url": "https://example.com/x", "events": []}, 400, "validation_error"),
    ({"url": "https://example.com/x", "events": ["*"], "secret": "mine"}, 400, "validation_error"),
])
async def test_bad_endpoints_are_refused_with_a_problem(client: Client, body: dict[str, Any], status_code: int,
                                                        code: str) -> None:
    r = await client.call("POST", "/v1/webhooks", json=body)
    assert r.status_code == status_code, r.text
    assert r.headers["content-type"].startswith("application/problem+json") and r.json()["code"] == code


async def test_another_apps_endpoint_is_not_found_and_a_publishable_key_is_refused(
        client: Client, receiver: WebhookReceiver, services: Services, prepared: CommonSettings) -> None:
    mine = await endpoint(client, receiver, path("mine"))
    nc = await connect(prepared, name="test")
    try:
        _, other_app = await create_account_with_app(nc, "other")
    finally:
        await nc.close()
    other = Client(services, other_app.secret_key, fresh_address())
    try:
        for method, suffix in (("GET", ""), ("DELETE", ""), ("GET", "/deliveries"), ("POST", "/secret/rotate")):
            r = await other.call(method, f"/v1/webhooks/{mine['id']}{suffix}")
            assert r.status_code == 404 and r.json()["code"] == "not_found", (method, suffix, r.text)
        assert (await other.call("GET", "/v1/webhooks/not-a-uuid")).status_code == 404
        refused = await other.call("GET", "/v1/webhooks", credential=other_app.publishable_key)
        assert refused.status_code in (401, 403), refused.text
    finally:
        await other.http.aclose()


# ------------------------------------------------------------------------------------------------ deliveries


async def test_an_event_is_delivered_signed_with_the_event_id_as_webhook_id(
        client: Client, receiver: WebhookReceiver) -> None:
    at = path("signed")
    made = await endpoint(client, receiver, at, ["video.created"])
    video = await create(client)
    got = await receiver.wait_requests_async(1, WAIT, path=at)
    payload = verified(got[0], made["secret"])
    assert payload["type"] == "video.created" and payload["data"]["video_id"] == video["id"]
    assert got[0].headers["content-type"] == "application/json"
    logged = await wait_for(lambda: log_of(client, made["id"], status="delivered"), WAIT, "the delivery logged")
    assert logged[0]["event_id"] == payload["id"] and len(logged[0]["attempts"]) == 1
    assert logged[0]["attempts"][0]["status_code"] == 204 and logged[0]["attempts"][0]["latency_ms"] > 0


async def test_a_file_that_is_no_video_is_announced_as_video_failed(client: Client, receiver: WebhookReceiver
                                                                     ) -> None:
    """A browser upload of something else is refused at its completion (422): the app's server learns it from a
    `video.failed` webhook, as it learns of a failed encoding, without polling."""
    at = path("failed")
    made = await endpoint(client, receiver, at, ["video.failed"])
    video = await create(client)
    r = await upload(client, video["id"], b"hello, this is not a video\n" * 100)
    assert r.status_code == 422 and r.json()["code"] == "unsupported_file", r.text
    got = await receiver.wait_requests_async(1, WAIT, path=at)
    payload = verified(got[0], made["secret"])
    assert payload["type"] == "video.failed", payload
    assert payload["data"]["video_id"] == video["id"] and payload["data"]["reason"] == "unsupported_file"


async def test_caption_tracks_added_replaced_and_removed_are_announced(client: Client, receiver: WebhookReceiver
                                                                        ) -> None:
    """A track added, its file replaced, and removed: one `video.captions_changed` webhook each, naming the change
    and the tracks after it, delivered in the order of the changes although they come a few ms apart and this
    module's two webhooks instances share the durable (the order gate; a stalled instance:
    tests/integration/test_webhooks_order.py)."""
    at = path("captions")
    made = await endpoint(client, receiver, at, ["video.captions_changed"])
    video = await create(client)
    vtt = "WEBVTT\n\n00:00:00.000 --> 00:00:01.000\nHello\n"
    for language, text in (("en", vtt), ("pt-br", vtt), ("en", vtt.replace("Hello", "Hi"))):
        r = await client.call("PUT", f"/v1/videos/{video['id']}/captions/{language}", content=text.encode(),
                              headers={"Content-Type": "text/vtt"})
        assert r.status_code in (200, 201), r.text
    assert (await client.call("DELETE", f"/v1/videos/{video['id']}/captions/en")).status_code == 204
    got = await receiver.wait_requests_async(4, WAIT, path=at)
    shown = [verified(g, made["secret"]) for g in got]  # in the order they arrived
    assert {p["type"] for p in shown} == {"video.captions_changed"} and len({p["id"] for p in shown}) == 4
    assert [(p["data"]["language"], p["data"]["change"], p["data"]["languages"]) for p in shown] == [
        ("en", "added", ["en"]), ("pt-BR", "added", ["en", "pt-BR"]), ("en", "replaced", ["en", "pt-BR"]),
        ("en", "deleted", ["pt-BR"])]
    assert all(p["data"]["video_id"] == video["id"] and p["subject"] == video["id"] for p in shown)


async def test_a_receiver_failing_three_times_gets_the_delivery_on_the_fourth_attempt(
        client: Client, receiver: WebhookReceiver) -> None:
    at = path("flaky")
    failures = 3
    receiver.route(at, fail_then_ok(failures))
    made = await endpoint(client, receiver, at, ["video.created"])
    await create(client)
    got = await receiver.wait_requests_async(failures + 1, WAIT, path=at)
    assert len({r.headers["webhook-id"] for r in got}) == 1  # the same webhook-id on every retry
    for r in got:
        verified(r, made["secret"])
    logged = await wait_for(lambda: log_of(client, made["id"], status="delivered"), WAIT, "delivered")
    codes = [a["status_code"] for a in logged[0]["attempts"]]
    assert codes == [500] * failures + [200]
    gaps = [b.monotonic - a.monotonic for a, b in itertools.pairwise(got)]
    floor = min(INTERVALS) * (1 - SETTINGS.webhook_retry_jitter_share)
    assert all(g >= floor * 0.9 for g in gaps), gaps  # backoff: never sooner than the shortest wait, jitter and all


async def test_a_later_event_of_a_video_waits_for_the_earlier_one(client: Client, receiver: WebhookReceiver) -> None:
    at = path("ordered")
    failures = 2
    receiver.route(at, fail_then_ok(failures))
    await endpoint(client, receiver, at, ["video.created", "video.deleted"])
    video = await create(client)
    assert (await client.call("DELETE", f"/v1/videos/{video['id']}")).status_code == 204
    got = await receiver.wait_requests_async(failures + 2, WAIT, path=at)
    assert types(got) == ["video.created"] * (failures + 1) + ["video.deleted"]


async def test_a_hanging_endpoint_holds_up_no_other(client: Client, receiver: WebhookReceiver) -> None:
    stuck, fine = path("hangs"), path("fine")
    receiver.route(stuck, hang())
    await endpoint(client, receiver, stuck, ["video.created"])
    await endpoint(client, receiver, fine, ["video.created"])
    for _ in range(3):
        await create(client)
    await receiver.wait_requests_async(1, WAIT, path=stuck)
    got = await receiver.wait_requests_async(3, WAIT, path=fine)
    first_stuck = receiver.requests(stuck)[0].monotonic
    # all three reached the healthy endpoint while the first attempt at the hanging one was still waiting
    assert got[-1].monotonic - first_stuck < SETTINGS.webhook_delivery_timeout_seconds
    assert receiver.count(stuck) == 1  # one at a time to an endpoint: the next waits for the hanging attempt


async def test_a_redirect_is_not_followed_and_is_retried(client: Client, receiver: WebhookReceiver) -> None:
    at, target = path("moved"), path("target")
    receiver.route(at, redirect(target))
    made = await endpoint(client, receiver, at, ["video.created"])
    await create(client)
    await receiver.wait_requests_async(2, WAIT, path=at)
    assert receiver.count(target) == 0
    logged = await wait_for(lambda: log_of(client, made["id"]), WAIT, "logged",
                            until=lambda d: bool(d) and len(d[0]["attempts"]) >= 2)
    assert {a["status_code"] for a in logged[0]["attempts"]} == {302}


async def test_410_disables_the_endpoint_at_once_and_says_so(client: Client, receiver: WebhookReceiver) -> None:
    gone_at, watcher = path("gone"), path("watcher")
    receiver.route(gone_at, gone())
    made = await endpoint(client, receiver, gone_at, ["video.*"])
    watching = await endpoint(client, receiver, watcher, ["webhook.disabled"])
    await create(client)
    await receiver.wait_requests_async(1, WAIT, path=gone_at)
    told = await receiver.wait_requests_async(1, WAIT, path=watcher)
    event = verified(told[0], watching["secret"])
    assert event["type"] == "webhook.disabled" and event["data"]["endpoint_id"] == made["id"]
    assert event["data"]["reason"] == "gone"
    shown = (await client.call("GET", f"/v1/webhooks/{made['id']}")).json()
    assert shown["enabled"] is False and shown["disabled_reason"] == "gone"
    await create(client)  # nothing more goes to a disabled endpoint
    await receiver.wait_requests_async(1, WAIT, path=watcher)
    assert receiver.count(gone_at) == 1
    back = await client.call("PATCH", f"/v1/webhooks/{made['id']}", json={"enabled": True})
    assert back.json()["enabled"] is True and back.json()["disabled_reason"] is None


async def test_an_endpoint_failing_for_the_disable_period_is_disabled(client: Client,
                                                                     receiver: WebhookReceiver) -> None:
    at = path("down")
    receiver.route(at, status(503))
    made = await endpoint(client, receiver, at, ["video.*"])
    video = await create(client)
    failing = await wait_for(lambda: client.call("GET", f"/v1/webhooks/{made['id']}"), WAIT, "failing",
                             until=lambda r: r.json()["failing_since"] is not None)
    since = datetime.fromisoformat(failing.json()["failing_since"])
    # a delivery is given up after its window; the endpoint is disabled at a failure past the disable period
    assert SETTINGS.webhook_retry_window_seconds < SETTINGS.webhook_disable_after_seconds
    end = since + timedelta(seconds=SETTINGS.webhook_disable_after_seconds)
    await wait_for(lambda: datetime.now(UTC) > end, WAIT, "the disable period to pass")
    assert (await client.call("DELETE", f"/v1/videos/{video['id']}")).status_code == 204
    shown = await wait_for(lambda: client.call("GET", f"/v1/webhooks/{made['id']}"), WAIT, "disabled",
                           until=lambda r: r.json()["enabled"] is False)
    assert shown.json()["disabled_reason"] == "failing"
    given_up = await log_of(client, made["id"], status="failed")
    assert {d["event_type"] for d in given_up} == {"video.created", "video.deleted"}


async def test_a_rotated_secret_signs_beside_the_old_one(client: Client, receiver: WebhookReceiver) -> None:
    at = path("rotated")
    made = await endpoint(client, receiver, at, ["video.created"])
    r = await client.call("POST", f"/v1/webhooks/{made['id']}/secret/rotate")
    assert r.status_code == 200, r.text
    rotated = r.json()
    until = datetime.fromisoformat(rotated["previous_signs_until"])
    assert until - datetime.now(UTC) > timedelta(seconds=SETTINGS.webhook_secret_overlap_seconds) * 0.9
    await create(client)
    got = await receiver.wait_requests_async(1, WAIT, path=at)
    assert len(got[0].headers["webhook-signature"].split()) == 2
    verified(got[0], rotated["secret"])
    verified(got[0], made["secret"])  # a receiver not yet switched still verifies


async def test_a_replay_sends_the_slice_again_with_the_original_webhook_ids(
        client: Client, receiver: WebhookReceiver) -> None:
    at = path("replayed")
    made = await endpoint(client, receiver, at, ["video.*"])
    since = datetime.now(UTC)
    videos = [await create(client) for _ in range(3)]
    first = await receiver.wait_requests_async(len(videos), WAIT, path=at)
    # settled first: a live delivery still in flight goes before its video's replayed copy (the video's order)
    await wait_for(lambda: log_of(client, made["id"], status="delivered"), WAIT, "the live deliveries settled",
                   until=lambda d: len(d) == len(videos))
    r = await client.call("POST", f"/v1/webhooks/{made['id']}/replay", json={"since": since.isoformat()})
    assert r.status_code == 202, r.text
    assert r.json()["count"] == len(videos)
    again = await receiver.wait_requests_async(2 * len(videos), WAIT, path=at)
    # the same ids, in the events' order (time, then id); live, different videos' events may go in any order
    ids = [e["id"] for e in sorted((json.loads(x.body) for x in first), key=lambda e: (e["time"], e["id"]))]
    assert [x.headers["webhook-id"] for x in again[len(videos):]] == ids
    logged = await log_of(client, made["id"])
    assert sum(1 for d in logged if d["replay_id"] == r.json()["replay_id"]) == len(videos)
    typed = await client.call("POST", f"/v1/webhooks/{made['id']}/replay",
                              json={"since": since.isoformat(), "types": ["video.deleted"]})
    assert typed.json()["count"] == 0


async def test_a_replay_needs_a_zoned_time_and_an_order(client: Client, receiver: WebhookReceiver) -> None:
    made = await endpoint(client, receiver, path("bad-replay"), ["*"])
    now = datetime.now(UTC)
    for body in ({"since": "2026-01-01T00:00:00"}, {"since": now.isoformat(),
                                                    "until": (now - timedelta(hours=1)).isoformat()}):
        r = await client.call("POST", f"/v1/webhooks/{made['id']}/replay", json=body)
        assert r.status_code == 400 and r.json()["code"] == "validation_error", r.text
    future = await client.call("POST", f"/v1/webhooks/{made['id']}/replay",
                               json={"since": (now + timedelta(days=1)).isoformat()})
    assert future.status_code == 400 and "since is in the future" in future.json()["detail"], future.text
    keep = WebhookSettings().webhook_deliveries_keep_seconds  # the services run with the default
    old = await client.call("POST", f"/v1/webhooks/{made['id']}/replay",
                            json={"since": (now - timedelta(seconds=2 * keep)).isoformat()})
    assert old.status_code == 400 and f"events are kept {duration(keep)}:" in old.json()["detail"], old.text


async def test_an_event_the_service_lost_is_filled_in_by_weir_replay(
        client: Client, receiver: WebhookReceiver, prepared: CommonSettings, stack_env: dict[str, str]) -> None:
    """The operator's way (SPEC 7's replay, to the service's durable): an event whose record the service lost (here
    removed by hand, as a restore from an older backup would) is received again and delivered with its id."""
    at = path("refilled")
    await endpoint(client, receiver, at, ["video.created"])
    since = datetime.now(UTC) - timedelta(seconds=1)
    await create(client)
    [first] = await receiver.wait_requests_async(1, WAIT, path=at)
    event_id = first.headers["webhook-id"]
    conn = await asyncpg.connect(prepared.database_url)
    try:
        await conn.execute("DELETE FROM webhooks.events WHERE id = $1", uuid.UUID(event_id))  # its deliveries too
        await conn.execute("DELETE FROM webhooks.inbox WHERE event_id = $1", uuid.UUID(event_id))
    finally:
        await conn.close()
    result = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "weir.cli", "replay", "--stream", "VIDEOS", "--subject",
                         "video.created", "--since", since.isoformat(), "--to", "webhooks_videos"],
        capture_output=True, text=True, timeout=120, env={**os.environ, **stack_env})
    assert result.returncode == 0, result.stdout + result.stderr
    again = await receiver.wait_requests_async(2, WAIT, path=at)
    assert [r.headers["webhook-id"] for r in again] == [event_id, event_id]


async def test_an_encoding_event_read_before_its_upload_completed_is_delivered_after_it(
        client: Client, receiver: WebhookReceiver, app: tuple[AccountCreated, AppCreated],
        prepared: CommonSettings) -> None:
    """upload.completed (VIDEOS) causes encode.started (ENCODE); read by two consumers, the effect may come first:
    it waits for its cause, which makes it due at once (not at the end of the hold)."""
    at = path("causes")
    made = await endpoint(client, receiver, at, ["upload.completed", "encode.*"])
    video = await create(client)
    account, keys = app
    cause = new_event(UploadCompleted(video_id=video["id"], app_id=keys.id, account_id=account.account_id,
                                      key_id=keys.secret_key_id, object_key=f"videos/{video['id']}", size=1,
                                      content_type="video/mp4", source_height=None), source="api", subject=video["id"])
    effect = new_event(EncodeStarted(video_id=video["id"], output=360, worker="w1", account_id=account.account_id),
                       source="encode", subject=video["id"])
    assert cause.time < effect.time
    nc = await connect(prepared, name="test")
    try:
        js = nc.jetstream()
        await js.publish(effect.type, effect.to_bytes(), headers={HDR_MSG_ID: effect.id})
        await wait_for(lambda: log_of(client, made["id"]), WAIT, "encode.started received",
                       until=lambda d: any(x["event_id"] == effect.id for x in d))
        published = time.monotonic()
        await js.publish(cause.type, cause.to_bytes(), headers={HDR_MSG_ID: cause.id})
    finally:
        await nc.close()
    got = await receiver.wait_requests_async(2, WAIT, path=at)
    assert [r.headers["webhook-id"] for r in got] == [cause.id, effect.id]
    assert got[1].monotonic - published < WebhookSettings().webhook_order_hold_seconds  # released by its cause
