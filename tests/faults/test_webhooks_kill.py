"""kill -9 of the webhooks service mid-delivery, under a steady stream of events (SPEC 13: no event is lost when the
delivering service dies mid-delivery; an event may be delivered twice, with the same `webhook-id`).

A `weir up` stack; the demo app's secret key makes three endpoints on one real receiver: two that answer at once (one
takes every event, one only `video.created`) and a slow one, so that attempts are in flight when the service is
killed. A client creates and deletes videos at a steady pace before, during and after the kill; the service is
killed while the slow endpoint holds an attempt, and `weir up` starts it again.

Afterwards, at every endpoint: every event of the demo app in the VIDEOS stream that the endpoint takes arrived at
least once (0 lost), verified with the endpoint's secret, with its event id as `webhook-id`; nothing else arrived; a
repeat carries the same `webhook-id` as the first arrival; each video's events arrived in order (no `video.created`
after its `video.deleted`). The repeats are counted and bounded by the claims the dead instance left (at most one per
endpoint and unit of endpoint concurrency).
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import signal
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from standardwebhooks import Webhook

from services.webhooks.settings import WebhookSettings
from shared.devstack.processes import pid_alive
from tests.faults.clusterhelpers import record_figure
from tests.faults.stackhelpers import (
    START_ALLOWANCE_S,
    WeirUp,
    data_root,
    database,
    env_of,
    ready,
    stack_env,
    stream_events,
    weir_up,
)
from tests.waiting import wait_for
from tests.webhookreceiver import Received, WebhookReceiver, ok, slow

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

TEST = "webhooks_kill"
BACKOFF_MS = 100  # WEIR_SUPERVISE_BACKOFF_MS: the killed service is started again after this long
# SPEC 13's numbers shrunk: an attempt's claim runs out (timeout + grace) within seconds; retries soon after
SETTINGS = WebhookSettings(webhook_delivery_timeout_seconds=2.0, webhook_claim_grace_seconds=1.0,
                           webhook_scan_seconds=0.2, webhook_retry_intervals_seconds=[0.2, 0.5],
                           webhook_allow_private=True)
CONSUMER_ACK_WAIT_S = 3.0  # an event the killed service was handling comes back to the new one this soon
SLOW_ANSWER_S = 0.2  # the slow endpoint's answer: well within the delivery timeout, so never a failed attempt
PACE_S = 0.5  # between two videos (each makes video.created and video.deleted): the slow endpoint keeps up
VIDEOS_BEFORE = 6  # videos made before the kill, and after the service is back
VIDEOS_AFTER = 6
PATHS = {"all": ["*"], "created": ["video.created"], "slow": ["*"]}


def webhook_env(s: WebhookSettings) -> dict[str, str]:
    names = ("webhook_delivery_timeout_seconds", "webhook_claim_grace_seconds", "webhook_scan_seconds",
             "webhook_allow_private")
    return {**env_of({n: getattr(s, n) for n in names}),
            "WEIR_WEBHOOK_RETRY_INTERVALS_SECONDS": json.dumps(s.webhook_retry_intervals_seconds)}


@pytest.fixture
def receiver() -> Iterator[WebhookReceiver]:
    with WebhookReceiver(default=ok()) as r:
        yield r


class Producer:
    """Creates a video, then deletes it, every PACE_S, through the API with the demo app's secret key."""

    def __init__(self, up: WeirUp) -> None:
        self.http = httpx.AsyncClient(base_url=up.api_url, timeout=30,
                                      headers={"Authorization": f"Bearer {up.secret_key}"})
        self.videos: list[str] = []
        self.stop = asyncio.Event()

    async def run(self) -> None:
        while not self.stop.is_set():
            r = await self.http.post("/v1/videos", json={"name": "webhooks kill"})
            assert r.status_code == 201, r.text
            video = r.json()["id"]
            assert (await self.http.delete(f"/v1/videos/{video}")).status_code == 204
            self.videos.append(video)
            try:
                await asyncio.wait_for(self.stop.wait(), PACE_S)
            except TimeoutError:
                pass

    async def until(self, n: int, timeout: float) -> None:
        await wait_for(lambda: len(self.videos) >= n, timeout, f"{n} videos made")


async def make_endpoints(up: WeirUp, receiver: WebhookReceiver) -> tuple[dict[str, str], list[str]]:
    """The test's endpoints of the demo app (beside the demo page's own, which `weir up` made): their secrets by
    path, and their ids."""
    secrets: dict[str, str] = {}
    ids: list[str] = []
    async with httpx.AsyncClient(base_url=up.api_url, timeout=30,
                                 headers={"Authorization": f"Bearer {up.secret_key}"}) as http:
        for name, events in PATHS.items():
            r = await http.post("/v1/webhooks", json={"url": receiver.url(f"/{name}"), "events": events})
            assert r.status_code == 201, r.text
            secrets[f"/{name}"] = r.json()["secret"]
            ids.append(r.json()["id"])
    return secrets, ids


async def orphaned_claims(up: WeirUp, endpoints: list[str]) -> int:
    """Deliveries to `endpoints` marked in flight by an instance that is gone (read right after its kill): each may
    be sent again."""
    async with database(up) as conn:
        n: int = await conn.fetchval("SELECT count(*) FROM webhooks.deliveries WHERE state = 'pending'"
                                     " AND in_flight_until > now() AND endpoint_id = ANY($1::uuid[])", endpoints)
    return n


async def kill9_mid_delivery(up: WeirUp, held: Any, endpoints: list[str]) -> tuple[int, float]:
    """kill -9 the webhooks service while the slow endpoint holds one of its attempts; the claims it left, and the
    seconds until `weir up` has it ready again."""
    await wait_for(lambda: held.answering > 0, 30, "an attempt in flight at the slow endpoint", interval=0.005)
    old = up.pids()["webhooks"]
    t0 = time.monotonic()
    os.kill(old, signal.SIGKILL)
    left = await orphaned_claims(up, endpoints)
    within = BACKOFF_MS / 1000 + START_ALLOWANCE_S

    async def back() -> bool:
        new = up.pids().get("webhooks", old)
        if new == old:
            return False
        async with httpx.AsyncClient() as http:
            return await ready(http, up.url("webhooks"))

    await wait_for(back, within, "the webhooks service started again and ready", interval=0.05,
                   until=lambda is_back: is_back)
    assert not pid_alive(old)
    return left, time.monotonic() - t0


async def expected_events(up: WeirUp, app_id: str) -> dict[str, tuple[str, str]]:
    """Every event of the app's videos in the VIDEOS stream: id -> (type, video id)."""
    found: dict[str, tuple[str, str]] = {}
    for event_type in ("video.created", "video.deleted"):
        for _, e in await stream_events(up, "VIDEOS", f"{event_type}.*"):
            if e.data.get("app_id") == app_id:
                found[e.id] = (e.type, str(e.data["video_id"]))
    return found


def arrived(receiver: WebhookReceiver, path: str, owed: set[str]) -> bool:
    return owed <= {r.headers["webhook-id"] for r in receiver.requests(path)}


def takes(events: list[str], event_type: str) -> bool:
    return "*" in events or event_type in events


def check_endpoint(path: str, got: list[Received], secret: str, expected: dict[str, tuple[str, str]]) -> int:
    """Every arrival verified and of an expected event with its id as webhook-id; every expected event it takes
    arrived; per-video order. Returns how many arrivals were repeats."""
    events = PATHS[path.lstrip("/")]
    wanted = {i for i, (t, _) in expected.items() if takes(events, t)}
    hook = Webhook(secret)
    ids: list[str] = []
    for r in got:
        payload = hook.verify(r.body, r.headers)  # raises on a bad signature
        assert isinstance(payload, dict) and payload["id"] == r.headers["webhook-id"], (path, r.headers)
        ids.append(payload["id"])
    assert set(ids) <= set(wanted), f"{path}: events it does not take, or of no video made: {set(ids) - wanted}"
    lost = wanted - set(ids)
    assert not lost, f"{path}: {len(lost)} of {len(wanted)} events never arrived: {sorted(lost)[:5]}"
    # per-video order: no arrival of an event before the last arrival of its video's earlier event
    deleted: set[str] = set()
    for n, i in enumerate(ids):
        event_type, video = expected[i]
        if event_type == "video.deleted":
            deleted.add(video)
        else:
            assert video not in deleted, f"{path}: video.created of {video} arrived (#{n}) after its video.deleted"
    return len(ids) - len(set(ids))


async def test_a_webhooks_kill_mid_delivery_loses_no_event_and_repeats_only_webhook_ids(
        tmp_path: Path, receiver: WebhookReceiver) -> None:
    t_test = time.monotonic()
    held = receiver.route("/slow", slow(SLOW_ANSWER_S))
    env = stack_env(**webhook_env(SETTINGS), WEIR_SUPERVISE_BACKOFF_MS=str(BACKOFF_MS),
                    WEIR_CONSUMER_ACK_WAIT_SECONDS=str(CONSUMER_ACK_WAIT_S))
    with data_root() as root, weir_up(root, env, "--media", "0", keep_log=tmp_path / "weir-up.log") as up:
        started_s = time.monotonic() - t_test
        app_id = str(up.info["demo"]["app_id"])
        secrets, endpoint_ids = await make_endpoints(up, receiver)
        producer = Producer(up)
        making = asyncio.create_task(producer.run())
        try:
            await producer.until(VIDEOS_BEFORE, 60)
            left, back_s = await kill9_mid_delivery(up, held, endpoint_ids)
            made_at_kill = len(producer.videos)
            await producer.until(made_at_kill + VIDEOS_AFTER, 60)
        finally:
            producer.stop.set()
            await making
            await producer.http.aclose()
        assert up.log_lines("webhooks exited with -9; starting it again in"), up.log_tail()

        expected = await expected_events(up, app_id)
        assert len(expected) == 2 * len(producer.videos), (len(expected), len(producer.videos))
        # what is still owed arrives within: a dead instance's claim running out, then the backlog at the slow pace
        settle_s = (SETTINGS.webhook_delivery_timeout_seconds + SETTINGS.webhook_claim_grace_seconds
                    + CONSUMER_ACK_WAIT_S + len(expected) * SLOW_ANSWER_S + START_ALLOWANCE_S)
        t_settle = time.monotonic()
        for path, events in PATHS.items():
            owed = {i for i, (t, _) in expected.items() if takes(events, t)}
            await wait_for(functools.partial(arrived, receiver, f"/{path}", owed), settle_s,
                           f"every event owed to /{path}")
        settled_s = time.monotonic() - t_settle

        repeats = {path: check_endpoint(path, receiver.requests(path), secret, expected)
                   for path, secret in secrets.items()}
        duplicates = sum(repeats.values())
        bound = len(PATHS) * SETTINGS.webhook_endpoint_concurrency
        print(f"\nstack ready in {started_s:.1f} s; {len(producer.videos)} videos, {len(expected)} events; "
              f"{left} claim(s) left by the killed instance; back in {back_s:.2f} s; settled {settled_s:.2f} s "
              f"after the load; repeats by endpoint {repeats}; arrivals "
              f"{dict(Counter(r.path for r in receiver.requests()))}")
        assert left <= bound, f"{left} claims in flight at the kill, more than {bound}"
        assert duplicates <= left, f"{duplicates} repeats, more than the {left} claims the killed instance left"
        record_figure(TEST, "duplicates", duplicates)
        record_figure(TEST, "claims_left_at_kill", left)
        record_figure(TEST, "restart_ready_s", back_s)
        record_figure(TEST, "settled_after_load_s", settled_s)
        record_figure(TEST, "duration_s", time.monotonic() - t_test)
