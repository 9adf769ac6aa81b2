"""Every event consumer reads an event from a newer release (its `Weir-Version` header after this one, an envelope
attribute and data fields this release does not know, a value of an open set it has not seen) and handles it as
the event it knows: the effect happens, the inbox records it, nothing is parked. On the real JetStream and
PostgreSQL, with each service's own handler (encode's uploads, recordings and deletions; the api's status
projection). No event these consumers read has a closed set today (`shared/events/catalog.py`: the closed sets are in
key.created, credential.rejected and video.retired, which no Weir consumer reads); encode.failed's `reason` is open,
shown as sent."""

from __future__ import annotations

import json
import uuid
from typing import Any

import asyncpg
import pytest
from nats.aio.client import Client as NATS

from services.api import store as api_store
from services.api.app import consumers as api_consumers
from services.encode.app import consumers as encode_consumers
from services.encode.processing import Processing
from services.encode.settings import EncodeSettings
from shared.bus import HDR_MSG_ID, HDR_VERSION
from shared.consumer import ConsumerSpec
from shared.events import (
    EncodeFailed,
    EncodeStarted,
    Envelope,
    Event,
    RecordingCompleted,
    UploadCompleted,
    VideoDeleted,
    new_event,
)
from shared.runtime import Runtime
from shared.settings import CommonSettings
from shared.streams import stream_for_type
from shared.videos import JobClass, VideoStatus
from tests.conftest import fresh_schema
from tests.integration.bushelpers import SETTLE_S, consumer_idle, consuming, unique
from tests.waiting import wait_for

pytestmark = pytest.mark.asyncio(loop_scope="session")

NEWER_RELEASE = "9.4.0"


def newer(event: Envelope, **data: Any) -> bytes:
    """The event as a newer release would send it: an envelope extension and data fields this release lacks."""
    body = json.loads(event.to_bytes())
    return json.dumps({**body, "region": "eu-2", "data": {**body["data"], **data}}).encode()


async def publish_newer(nc: NATS, event: Envelope, **data: Any) -> None:
    await nc.jetstream().publish(event.type, newer(event, **data),
                                 headers={HDR_MSG_ID: event.id, HDR_VERSION: NEWER_RELEASE})


async def handled(pool: asyncpg.Pool, consumer: str) -> set[str]:
    async with pool.acquire() as conn:
        return {r[0] for r in await conn.fetch("SELECT event_id::text FROM inbox WHERE consumer = $1", consumer)}


async def consumer_settled(nc: NATS, stream: str, durable: str) -> None:
    async def idle() -> bool:
        return await consumer_idle(nc.jetstream(), stream, durable)

    await wait_for(idle, SETTLE_S, f"{durable} idle")


class Recorded(Processing):
    """encode's processing as far as its consumers reach: what they asked, recorded."""

    calls: list[tuple[str, str, JobClass | None]]

    async def open(self, conn: asyncpg.Connection, *, video_id: str, job_class: JobClass, object_key: str,
                   source_height: int | None, account_id: str | None = None, learned_from: str = "") -> None:
        self.calls.append(("open", video_id, job_class))

    async def learn_account(self, conn: asyncpg.Connection, video_id: str, account_id: str, *,
                            learned_from: str) -> None:
        pass  # what a video's account does is tests/integration/test_recordings_checked.py's

    async def take_recording(self, conn: asyncpg.Connection, event: Event[RecordingCompleted], origin: str) -> None:
        # a first-party recording on the bare subject is taken as it is (the rules: tests/unit/test_encode_recordings)
        self.calls.append(("open", event.data.recording_id, JobClass.FIRST_PARTY))

    async def delete(self, conn: asyncpg.Connection, *, video_id: str) -> None:
        self.calls.append(("delete", video_id, None))


async def test_encode_handles_newer_uploads_recordings_and_deletions(
    schema_pool: tuple[str, asyncpg.Pool], nc: NATS, prepared: CommonSettings
) -> None:
    _, pool = schema_pool
    rt = Runtime(definition=None, settings=EncodeSettings(), metrics=None)  # type: ignore[arg-type]
    processing = Recorded(settings=EncodeSettings(), pool=None, farm=None, s3=None)  # type: ignore[arg-type]
    processing.calls = []
    rt.parts = processing
    specs = {c.name: ConsumerSpec(name=unique(c.name), handler=c.handler) for c in encode_consumers(rt)}
    vid = str(uuid.uuid4())
    upload = new_event(UploadCompleted(video_id=vid, app_id=vid, account_id=vid, key_id=vid, object_key=f"s/{vid}",
                                       size=1, content_type="video/av1", source_height=None), source="api", subject=vid)
    rid = str(uuid.uuid4())
    recording = new_event(RecordingCompleted(recording_id=rid, object_key=f"r/{rid}", size=1), source="studio",
                          subject=rid)
    deleted = new_event(VideoDeleted(video_id=vid, app_id=vid, account_id=vid), source="api", subject=vid)
    async with consuming(prepared, pool, *specs.values(), from_now=True):
        await publish_newer(nc, upload, codec="av1", hdr=True)
        await publish_newer(nc, recording, studio="b", duration_seconds=12.5)
        await publish_newer(nc, deleted, deleted_by="retention_policy_v3")
        expected = [("open", vid, JobClass.DEVELOPER), ("open", rid, JobClass.FIRST_PARTY), ("delete", vid, None)]

        async def all_handled() -> bool:
            return all(call in processing.calls for call in expected)

        await wait_for(all_handled, SETTLE_S, "the three newer events handled")
        for name, event in (("encode_uploads", upload), ("encode_recordings", recording),
                            ("encode_deletions", deleted)):
            await consumer_settled(nc, stream_for_type(event.type).name, specs[name].name)
    assert await handled(pool, specs["encode_uploads"].name) == {upload.id}  # in the inbox: handled, not parked
    assert await handled(pool, specs["encode_recordings"].name) == {recording.id}
    assert await handled(pool, specs["encode_deletions"].name) == {deleted.id}


async def test_the_api_projects_newer_encode_events(nc: NATS, prepared: CommonSettings) -> None:
    """encode.started then encode.failed (the whole video, a reason this release has not seen) from a newer encode:
    the api's projection shows the video failed with that reason, as GET /v1/videos/{id} then shows it."""
    async with fresh_schema(prepared.database_url, "api") as (_, pool):
        async with pool.acquire() as conn:
            ids = [str(uuid.uuid4()) for _ in range(3)]
            video = await api_store.create(conn, app_id=ids[0], account_id=ids[1], key_id=ids[2], name="n",
                                           metadata={})
        (status,) = api_consumers(None)  # type: ignore[arg-type]
        spec = ConsumerSpec(name=unique("api_status"), handler=status.handler)
        started = new_event(EncodeStarted(video_id=video.id, output=360, worker="w1"), source="encode",
                            subject=video.id)
        failed = new_event(EncodeFailed(video_id=video.id, output=None, worker=None, reason="gpu_quota_exhausted",
                                        message="No GPU left"), source="encode", subject=video.id)
        async with consuming(prepared, pool, spec, from_now=True):
            await publish_newer(nc, started, gpu="a100", pass_number=2)
            await publish_newer(nc, failed, retry_after_seconds=600)

            async def shown_failed() -> bool:
                async with pool.acquire() as conn:
                    got = await api_store.get(conn, video.id)
                return got is not None and got.projection.status == VideoStatus.FAILED

            await wait_for(shown_failed, SETTLE_S, "the video failed in the projection")
            await consumer_settled(nc, stream_for_type(failed.type).name, spec.name)
        async with pool.acquire() as conn:
            got = await api_store.get(conn, video.id)
        assert got is not None and got.projection.failure == ("gpu_quota_exhausted", "No GPU left")
        assert await handled(pool, spec.name) == {started.id, failed.id}
