"""Issue 16, fault 1: the node that leads the VIDEOS stream is killed -9 during a steady flow of uploads through the
public API, and later started again. Nothing is lost or doubled: every `upload.completed` is handled by encode
exactly once, every video becomes ready, and no outbox row is left unsent. The time from the node's death to the
next successful publish is printed and appended to .weir/test-artifacts/faults.jsonl.

Its own stack (a 3-node cluster, streams at 3 replicas) and its own service processes: auth, api, encode and two
media workers, each given all three URLs (so some of them are connected to the node that dies)."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from shared.bus import connect
from shared.db import SCHEMAS
from tests.faults.clusterhelpers import (
    ClusterStack,
    PublishProbe,
    cluster_stack,
    connection_trouble,
    fetch,
    quiet,
    record_figure,
    stream_events,
    stream_leader,
    wait_stream_whole,
)
from tests.integration.apihelpers import Client
from tests.integration.authhelpers import fresh_address, new_app
from tests.integration.test_encode_helpers import Procs, fast_farm, make_source, processes
from tests.waiting import wait_for

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.slow]

TEST = "nats_node_loss"
COMPLETIONS = 200  # uploads completed through the API in the run
UPLOADERS = 8  # uploading side by side
# offered load: about what two media workers on 2 cores encode of the tiny source, so the flow spans the whole fault
# (the kill, the time without a leader, the restart) instead of being over before it
UPLOADS_PER_SECOND = 6.0
KILL_AT = COMPLETIONS // 4  # completions before the VIDEOS leader is killed
RESTART_AT = COMPLETIONS // 2  # ... and before it is started again (once a publish went through without it)
MEDIA_SLOTS = 3  # one is kept for first-party jobs: two developer slots per worker
STEP_TIMEOUT = 30.0  # one API call, retried while it answers 503
SETTLE_TIMEOUT = 90.0  # after the last completion: every video ready, every outbox sent
HIGH = "1000000"  # every limit out of the way: this test is about the bus


@pytest.fixture(scope="module")
def cluster() -> Iterator[ClusterStack]:
    with cluster_stack("weir-fault-nodeloss-") as stack:
        yield stack


@pytest.fixture(scope="module")
def services(cluster: ClusterStack) -> Iterator[Procs]:
    with processes(cluster.env, cluster.logs) as procs:
        procs.start("auth", "api", "encode", "media-1", "media-2", **fast_farm(
            media_slots=MEDIA_SLOTS, limit_key_per_minute=HIGH, limit_owner_per_minute=HIGH,
            limit_address_per_minute=HIGH, limit_upload_token_per_minute=HIGH))
        yield procs


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """A tiny clip (240p, half a second), made once and uploaded many times."""
    return make_source(tmp_path_factory.mktemp("media") / "tiny.mp4", height=240, seconds=0.5).read_bytes()


@pytest.fixture
async def client(cluster: ClusterStack, services: Procs) -> AsyncIterator[Client]:
    api = next(p for p in services.procs if p.name == "api")
    nc = await connect(cluster.settings, name="test", error_cb=quiet)
    demo = await new_app(nc)
    await nc.close()
    c = Client(SimpleNamespace(api_url=api.url), demo.app.secret_key, fresh_address())  # type: ignore[arg-type]
    yield c
    await c.http.aclose()


@dataclass
class Flow:
    """What the uploaders did: each completed video with the time of its completion, and the 503s they retried."""

    completed: dict[str, float] = field(default_factory=dict)
    retried_503: int = 0
    progress: asyncio.Event = field(default_factory=asyncio.Event)  # set at each completion

    def done(self, video_id: str) -> None:
        self.completed[video_id] = time.monotonic()
        self.progress.set()

    async def until(self, count: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while len(self.completed) < count:
            self.progress.clear()
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"{len(self.completed)} of {count} completions within {timeout} s"
            try:
                async with asyncio.timeout(remaining):
                    await self.progress.wait()
            except TimeoutError:
                continue


async def call(c: Client, flow: Flow, method: str, path: str, **kw: Any) -> httpx.Response:
    """One API call as a client makes it: a 503 (auth did not answer while its connection moved) is retried after
    its Retry-After; anything else is the answer."""
    deadline = time.monotonic() + STEP_TIMEOUT
    while True:
        r = await c.call(method, path, **kw)
        if r.status_code != 503:
            return r
        flow.retried_503 += 1
        assert time.monotonic() < deadline, f"{method} {path}: 503 for {STEP_TIMEOUT} s: {r.text}"
        await asyncio.sleep(float(r.headers.get("retry-after", "1")))


async def upload_one(c: Client, s3: httpx.AsyncClient, flow: Flow, data: bytes) -> None:
    """Create a video and upload the clip in one part, through the public API (the part straight to storage)."""
    r = await call(c, flow, "POST", "/v1/videos", json={"name": "fault"})
    assert r.status_code == 201, r.text
    video_id = r.json()["id"]
    r = await call(c, flow, "POST", f"/v1/videos/{video_id}/upload", json={"content_type": "video/mp4"})
    assert r.status_code == 200, r.text
    r = await call(c, flow, "POST", f"/v1/videos/{video_id}/upload/parts", json={"part_numbers": [1]})
    assert r.status_code == 200, r.text
    put = await s3.put(r.json()["parts"][0]["url"], content=data)
    assert put.status_code == 200, put.text
    parts = [{"part_number": 1, "etag": put.headers["etag"]}]
    r = await call(c, flow, "POST", f"/v1/videos/{video_id}/upload/complete", json={"parts": parts})
    assert r.status_code == 200 and r.json()["file"] is not None, r.text
    flow.done(video_id)


async def uploaders(c: Client, flow: Flow, data: bytes) -> None:
    """COMPLETIONS uploads by UPLOADERS side by side, the n-th started no earlier than n / UPLOADS_PER_SECOND."""
    tickets = itertools.count()
    started = time.monotonic()

    async def uploader() -> None:
        async with httpx.AsyncClient(timeout=30) as s3:
            while (n := next(tickets)) < COMPLETIONS:
                await asyncio.sleep(max(0.0, started + n / UPLOADS_PER_SECOND - time.monotonic()))
                await upload_one(c, s3, flow, data)

    await asyncio.gather(*(uploader() for _ in range(UPLOADERS)))


@pytest.mark.timeout(240)
async def test_losing_the_videos_leader_loses_and_doubles_nothing(
    cluster: ClusterStack, services: Procs, client: Client, source: bytes
) -> None:
    t_start = time.monotonic()
    nc = await connect(cluster.settings, name="test", error_cb=quiet)
    js = nc.jetstream()
    flow = Flow()
    try:
        await wait_stream_whole(js, "VIDEOS", 30)
        async with PublishProbe(cluster.settings) as probe:
            uploading = asyncio.create_task(uploaders(client, flow, source))
            try:
                await flow.until(KILL_AT, 60)
                victim = await stream_leader(js, "VIDEOS")
                on_victim = cluster.clients_of(victim)
                killed_wall = time.time()
                killed = cluster.kill9(victim)
                print(f"\nkilled {victim} (the VIDEOS leader) after {len(flow.completed)} completions; its clients: "
                      f"{on_victim}")

                await wait_for(lambda: probe.first_ack_after(killed), 60, "a publish to VIDEOS without the dead node")
                new_leader = await stream_leader(js, "VIDEOS")
                await flow.until(RESTART_AT, 90)
                took = await cluster.restart(victim)
                print(f"{victim} started again after {len(flow.completed)} completions ({took:.1f} s to healthy); "
                      f"the VIDEOS leader meanwhile: {new_leader}")
                await asyncio.wait_for(asyncio.shield(uploading), 120)
            finally:
                if not uploading.done():
                    uploading.cancel()
                    await asyncio.gather(uploading, return_exceptions=True)
        flow_s = time.monotonic() - t_start
        assert len(flow.completed) == COMPLETIONS
        leader_after = await wait_stream_whole(js, "VIDEOS", 60)  # the restarted node caught up
        ours = set(flow.completed)

        # every outbox drained (the api's above all: its upload.completed and video.created)
        async def outboxes_sent() -> bool:
            for schema in sorted(set(SCHEMAS.values())):
                (row,) = await fetch(cluster.settings.database_url,
                                     f"SELECT count(*) AS n FROM {schema}.outbox WHERE sent_at IS NULL")
                if row["n"]:
                    return False
            return True

        await wait_for(outboxes_sent, SETTLE_TIMEOUT, "every outbox row sent", interval=0.2)

        # every video ready: first as the api's table says (its projection of encode's events), then over HTTP
        async def all_ready() -> bool:
            rows = await fetch(cluster.settings.database_url,
                               "SELECT id::text AS id FROM videos.videos WHERE status = 'ready' AND id::text = ANY($1)",
                               list(ours))
            return len(rows) == COMPLETIONS

        try:
            await wait_for(all_ready, SETTLE_TIMEOUT, "every video ready", interval=0.5)
        finally:
            states = await fetch(cluster.settings.database_url,
                                 "SELECT status, count(*) AS n FROM videos.videos WHERE id::text = ANY($1)"
                                 " GROUP BY status", list(ours))
            print("video states:", {r["status"]: r["n"] for r in states})
        # read as a client reads: a 503 (auth not answering within WEIR_AUTH_TIMEOUT_MS while 200 checks arrive at
        # once on a slow machine) is retried after its Retry-After; anything else is the answer
        shown = await asyncio.gather(*(call(client, flow, "GET", f"/v1/videos/{v}") for v in ours))
        assert {(r.status_code, r.json()["status"]) for r in shown} == {(200, "ready")}
        settled_s = time.monotonic() - t_start

        # each completion published once (one event id per video), and handled by encode once
        events = [e for e, _ in await stream_events(js, "VIDEOS", "upload.completed.*")]
        ids_by_video: dict[str, set[str]] = {}
        for e in events:
            ids_by_video.setdefault(e.data["video_id"], set()).add(str(e.id))
        assert set(ids_by_video) == ours
        assert all(len(ids) == 1 for ids in ids_by_video.values()), "a video completed twice"
        event_ids = {next(iter(ids)) for ids in ids_by_video.values()}
        copies = len(events) - len(event_ids)  # the same event stored twice (the duplicate window failed)
        inbox = await fetch(cluster.settings.database_url,
                            "SELECT event_id::text AS id, times FROM encode.inbox WHERE consumer = 'encode_uploads'")
        assert {r["id"] for r in inbox} == event_ids and len(inbox) == COMPLETIONS
        assert {r["times"] for r in inbox} == {1}
        processed = await fetch(cluster.settings.database_url,
                                "SELECT video_id FROM encode.videos WHERE video_id = ANY($1)", list(ours))
        assert len(processed) == COMPLETIONS

        # the figures: death to the next publish, the probe's and the api's own (the first of its events stored)
        probe_s = probe.first_ack_after(killed)
        assert probe_s is not None
        api_after = [stored for e, stored in [*await stream_events(js, "VIDEOS", "upload.completed.*"),
                                              *await stream_events(js, "VIDEOS", "video.created.*")]
                     if e.source == "api" and stored.timestamp() > killed_wall]
        assert api_after, "no event of the api's stored after the node died"
        api_s = min(api_after).timestamp() - killed_wall
        record_figure(TEST, "death_to_probe_publish_s", probe_s)
        record_figure(TEST, "death_to_api_publish_s", api_s)
        record_figure(TEST, "stored_copies", copies)
        record_figure(TEST, "flow_s", flow_s)
        record_figure(TEST, "duration_s", settled_s)
        print(f"killed {victim}; leader after: {leader_after}; 503s retried: {flow.retried_503}; "
              f"probe publishes failed: {probe.failures}; stored copies of one event: {copies}; NATS connection "
              f"trouble logged: {connection_trouble({p.name: p.log for p in services.procs})}")
    finally:
        await nc.close()
