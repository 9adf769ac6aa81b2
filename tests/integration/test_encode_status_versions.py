"""encode.status shipped in two versions side by side (SPEC section 11: a breaking change is a new version served
beside the old), through the api's HTTP routes with real auth, api and encode processes on the session's servers.

v1 (`encode.status`, release 1.0.0) asks one video per request; v2 (`encode.status.v2`) asks many. The current
encode serves both; the current api asks v2 (a listing page in one request, GET one too) and, when no encode serves v2
(NATS answers "no responders"), asks v1 for GET one and shows its own projection in the listing.
"""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import NoRespondersError

from shared.authcheck import AppCreated
from shared.authclient import create_account_with_app
from shared.bus import connect
from shared.media.protocol import (
    STATUS_SUBJECT,
    STATUS_V2_SUBJECT,
    ProcessingStatus,
    ProcessingStatuses,
    StatusesRequest,
)
from shared.messaging import error_in
from shared.settings import CommonSettings
from tests.integration.apihelpers import Client, Services, create, run_services, upload
from tests.integration.authhelpers import fresh_address
from tests.integration.test_encode_helpers import (
    FakeWorker,
    Procs,
    fast_farm,
    make_source,
)
from tests.waiting import wait_for

pytestmark = pytest.mark.asyncio(loop_scope="session")
Doc = dict[str, Any]
# the api asks encode about this many videos per v2 request at most (its setting): the listing tests use one more
# processing video than this, so a page larger than it takes two requests and one within it takes one
ASKED_PER_REQUEST = 2
# the encode the tests start refuses a v2 request for more videos than this (its setting)
ENCODE_MAX_VIDEOS = 3
WAIT = 30.0  # seconds a test waits for the services to show a state (a loaded machine is slow, never this slow)


@pytest.fixture(scope="module")
def services(stack_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Services]:
    with run_services(stack_env, tmp_path_factory.mktemp("logs"), status_max_videos=str(ASKED_PER_REQUEST),
                      **{f"limit_{rule}_per_minute": "100000" for rule in ("address", "key", "owner")}) as s:
        yield s


@pytest.fixture(scope="module")
def clip(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """A short 360p MP4 (made now with ffmpeg): encode opens one 360p output for it."""
    return make_source(tmp_path_factory.mktemp("media") / "clip.mp4", height=360, seconds=1).read_bytes()


@pytest.fixture
async def client(services: Services, prepared: CommonSettings) -> AsyncIterator[Client]:
    """A client of a fresh app: its listing holds only the test's own videos."""
    nc = await connect(prepared, name="test")
    app: AppCreated
    _, app = await create_account_with_app(nc, "status-versions")
    await nc.close()
    c = Client(services, app.secret_key, fresh_address())
    yield c
    await c.http.aclose()


@pytest.fixture
def encode(farm: Procs) -> Procs:
    """The current encode (no media worker: its videos stay processing, their outputs pending)."""
    farm.start("encode", **fast_farm(status_max_videos=ENCODE_MAX_VIDEOS))
    return farm


class Requests:
    """Every request sent on a subject, heard by a plain subscriber that does not answer (encode's queue group does)."""

    def __init__(self) -> None:
        self.bodies: list[Doc] = []

    async def on(self, msg: Msg) -> None:
        self.bodies.append(json.loads(msg.data))


@pytest.fixture
async def heard(nc: NATS) -> AsyncIterator[dict[str, Requests]]:
    """What the api sends on each version of encode.status."""
    by_subject = {STATUS_SUBJECT: Requests(), STATUS_V2_SUBJECT: Requests()}
    subs = [await nc.subscribe(subject, cb=r.on) for subject, r in by_subject.items()]
    await nc.flush()
    yield by_subject
    for s in subs:
        await s.unsubscribe()


async def uploaded(client: Client, clip: bytes, count: int) -> list[str]:
    """`count` videos created and uploaded through HTTP (each then `uploaded` in the api's own row)."""
    ids = []
    for _ in range(count):
        video = await create(client)
        r = await upload(client, video["id"], clip)
        assert r.status_code == 200 and r.json()["status"] == "uploaded", r.text
        ids.append(video["id"])
    return ids


async def v2_statuses(nc: NATS, video_ids: list[str]) -> dict[str, ProcessingStatus]:
    reply = await nc.request(STATUS_V2_SUBJECT, StatusesRequest(video_ids=video_ids).model_dump_json().encode(),
                             timeout=5)
    return {s.video_id: s for s in ProcessingStatuses.model_validate_json(reply.data).videos}


async def processing_at_encode(nc: NATS, video_ids: list[str]) -> dict[str, ProcessingStatus]:
    """encode's own state of the videos, once it has opened every one (from their upload.completed)."""

    async def opened() -> dict[str, ProcessingStatus] | None:
        shown = await v2_statuses(nc, video_ids)
        return shown if all(s.found and s.status == "processing" for s in shown.values()) else None

    return await wait_for(opened, WAIT, "encode to open every uploaded video")


async def listed(client: Client, limit: int) -> dict[str, Doc]:
    r = await client.call("GET", f"/v1/videos?limit={limit}")
    assert r.status_code == 200, r.text
    return {v["id"]: v for v in r.json()["videos"]}


async def no_encode_on_the_bus(nc: NATS) -> None:
    """Wait until nothing answers v2: an encode of an earlier test may still be leaving the bus."""

    async def v2_unanswered() -> bool:
        try:
            await nc.request(STATUS_V2_SUBJECT, StatusesRequest(video_ids=[]).model_dump_json().encode(), timeout=5)
        except NoRespondersError:
            return True
        return False

    await wait_for(v2_unanswered, WAIT, "no responder on encode.status.v2")


def shows_encode(shown: Doc, state: ProcessingStatus) -> bool:
    """The api shows encode's own state of the video (its deadline and outputs), not its projection of events, of
    which these videos have none (no worker ever took an output)."""
    processing = shown["processing"]
    return (shown["status"] == "processing" and processing is not None
            and processing["deadline_at"] == (state.deadline_at.isoformat() if state.deadline_at else None)
            and [o["height"] for o in processing["outputs"]] == [o.height for o in state.outputs])


# ----------------------------------------------------------------------------------------------- tests


async def test_the_listing_shows_encodes_state_asked_in_one_v2_request_per_page(
    encode: Procs, client: Client, clip: bytes, nc: NATS, heard: dict[str, Requests]
) -> None:
    ids = await uploaded(client, clip, ASKED_PER_REQUEST + 1)
    waiting = (await create(client))["id"]  # no file yet: encode is not asked about it
    at_encode = await processing_at_encode(nc, ids)
    assert all(s.deadline_at is not None and s.outputs for s in at_encode.values())
    heard[STATUS_V2_SUBJECT].bodies.clear()

    # the whole listing: the page's processing videos, more than the api asks per request
    async def all_from_encode() -> dict[str, Doc] | None:
        shown = await listed(client, 100)
        return shown if all(shows_encode(shown[i], at_encode[i]) for i in ids) else None

    page = await wait_for(all_from_encode, WAIT, "the listing to show encode's state of every processing video")
    assert page[waiting]["status"] == "created" and page[waiting]["processing"] is None
    await nc.flush()  # the api's requests reached the server before its answer: their copies are here now
    asked = [b["video_ids"] for b in heard[STATUS_V2_SUBJECT].bodies]
    assert asked and len(asked) % math.ceil(len(ids) / ASKED_PER_REQUEST) == 0, asked  # ceil(n / per request) each
    assert all(len(a) <= ASKED_PER_REQUEST for a in asked) and {i for a in asked for i in a} == set(ids), asked
    assert heard[STATUS_SUBJECT].bodies == []  # never v1

    # a page within the api's per-request count: one request for the page's processing videos
    heard[STATUS_V2_SUBJECT].bodies.clear()
    newest = ids[-ASKED_PER_REQUEST:]  # the page of the newest videos, after `waiting`, which is not asked about

    async def page_from_encode() -> dict[str, Doc] | None:
        shown = await listed(client, ASKED_PER_REQUEST + 1)
        return shown if all(shows_encode(shown[i], at_encode[i]) for i in newest) else None

    await wait_for(page_from_encode, WAIT, "a page to show encode's state")
    await nc.flush()
    calls = len(heard[STATUS_V2_SUBJECT].bodies)
    assert calls >= 1 and all(sorted(b["video_ids"]) == sorted(newest) for b in heard[STATUS_V2_SUBJECT].bodies)
    assert heard[STATUS_SUBJECT].bodies == []


async def test_get_one_asks_v2(
    encode: Procs, client: Client, clip: bytes, nc: NATS, heard: dict[str, Requests]
) -> None:
    [video_id] = await uploaded(client, clip, 1)
    state = (await processing_at_encode(nc, [video_id]))[video_id]
    heard[STATUS_V2_SUBJECT].bodies.clear()

    async def from_encode() -> Doc | None:
        shown: Doc = (await client.call("GET", f"/v1/videos/{video_id}")).json()
        return shown if shows_encode(shown, state) else None

    await wait_for(from_encode, WAIT, "GET one to show encode's state")
    await nc.flush()
    assert heard[STATUS_V2_SUBJECT].bodies and all(
        b == {"video_ids": [video_id]} for b in heard[STATUS_V2_SUBJECT].bodies)
    assert heard[STATUS_SUBJECT].bodies == []


async def test_with_only_a_v1_encode_get_one_asks_v1_and_the_listing_shows_the_projection(
    client: Client, clip: bytes, nc: NATS
) -> None:
    """An encode of release 1.0.0 on the bus: it answers encode.status only, and nothing answers v2."""
    await no_encode_on_the_bus(nc)
    deadline = "2026-12-03T18:00:00+00:00"
    asked: list[str] = []

    async def encode_of_release_1_0_0(msg: Msg) -> None:  # its reply, as that release's models write it
        video_id = json.loads(msg.data)["video_id"]
        asked.append(video_id)
        await msg.respond(json.dumps({
            "video_id": video_id, "found": True, "status": "processing", "deadline_at": deadline, "busy_at": None,
            "outputs": [{"height": 360, "state": "pending", "worker": None, "started_at": None, "restarts": 0}],
            "failure_reason": None, "failure_message": None, "restarted": [],
        }).encode())

    sub = await nc.subscribe(STATUS_SUBJECT, queue="encode", cb=encode_of_release_1_0_0)
    await nc.flush()
    try:
        [video_id] = await uploaded(client, clip, 1)

        async def from_v1() -> Doc | None:
            shown: Doc = (await client.call("GET", f"/v1/videos/{video_id}")).json()
            return shown if shown["processing"] is not None else None

        shown = await wait_for(from_v1, WAIT, "GET one to show the v1 encode's state")
        assert shown["status"] == "processing" and shown["processing"]["deadline_at"] == deadline
        assert [o["height"] for o in shown["processing"]["outputs"]] == [360]
        assert video_id in asked

        asked.clear()
        page = await listed(client, 100)
        assert page[video_id]["status"] == "uploaded" and page[video_id]["processing"] is None  # the projection
        assert asked == []  # the listing does not ask v1 per video
    finally:
        await sub.unsubscribe()


async def test_an_old_caller_is_answered_by_the_current_encode(
    encode: Procs, client: Client, clip: bytes, nc: NATS
) -> None:
    """The api of release 1.0.0 sends encode.status as it did: the current encode answers it as v2 does."""
    [video_id] = await uploaded(client, clip, 1)
    await processing_at_encode(nc, [video_id])
    reply = await nc.request(STATUS_SUBJECT, json.dumps({"video_id": video_id}).encode(), timeout=5)
    old = ProcessingStatus.model_validate_json(reply.data)
    assert old.found and old.status == "processing" and old.deadline_at is not None and old.outputs
    # one implementation under both versions (nothing changes the video meanwhile: no worker takes its outputs)
    assert old == (await v2_statuses(nc, [video_id]))[video_id]
    unknown = await nc.request(STATUS_SUBJECT, b'{"video_id": "no-such-video"}', timeout=5)
    assert json.loads(unknown.data)["found"] is False


async def test_a_v2_request_for_more_videos_than_encode_allows_is_refused(encode: Procs, nc: NATS) -> None:
    most = ENCODE_MAX_VIDEOS  # the setting this encode runs with
    ids = [f"unknown-{i}" for i in range(most + 1)]
    answered = await v2_statuses(nc, ids[:most])
    assert list(answered) == ids[:most] and not any(s.found for s in answered.values())
    reply = await nc.request(STATUS_V2_SUBJECT, StatusesRequest(video_ids=ids).model_dump_json().encode(), timeout=5)
    refused = error_in(reply.data)
    assert refused is not None and (refused.error.status, refused.error.code) == (400, "too_many_videos")



async def test_v2_applies_the_stuck_rule_as_v1_does(farm: Procs, client: Client, clip: bytes, nc: NATS) -> None:
    """Outputs encoding past the threshold on a worker that never finishes: one v2 request restarts each video's."""
    threshold = 1.0
    farm.start("encode", **fast_farm(stuck_restart_seconds=threshold, processing_deadline_seconds=120))
    async with FakeWorker(nc) as worker:
        ids = await uploaded(client, clip, 2)

        async def encoding() -> bool:
            shown = await v2_statuses(nc, ids)
            return all(s.found and [o.state for o in s.outputs] == ["encoding"] for s in shown.values())

        await wait_for(encoding, WAIT, "each video's output to encode on the worker")
        restarted: dict[str, list[int]] = {}

        async def each_restarted() -> bool:
            for video_id, s in (await v2_statuses(nc, ids)).items():
                if s.restarted:
                    restarted.setdefault(video_id, s.restarted)
            return set(restarted) == set(ids)

        await wait_for(each_restarted, WAIT, "v2 to restart each video's stuck output")
        assert restarted == {video_id: [360] for video_id in ids}
        await wait_for(lambda: {c.video_id for c in worker.cancelled if c.attempt == 1} >= set(ids), WAIT,
                       "the hung jobs to be cancelled")
        shown = await v2_statuses(nc, ids)
        assert all(s.outputs[0].restarts >= 1 for s in shown.values())  # counted, as v1 shows it


async def test_a_v2_reply_from_a_newer_or_broken_encode_is_read_with_its_fallbacks_or_shows_the_projection(
    client: Client, clip: bytes, nc: NATS
) -> None:
    """Only a plain subscriber answers v2 here, as a newer encode would (fields added, a processing state and an output
    state this release does not know), then broken (truncated, of the wrong shape, a refusal): GET one and the listing
    answer 200 with the fallbacks, or the projection; v1 is never asked, since v2 has a responder."""
    await no_encode_on_the_bus(nc)
    [video_id] = await uploaded(client, clip, 1)
    deadline = "2026-12-03T18:00:00+00:00"
    newer = json.dumps({"videos": [{
        "video_id": video_id, "found": True, "status": "paused_by_operator", "deadline_at": deadline, "priority": 3,
        "outputs": [{"height": 360, "state": "throttled", "worker": "w9", "eta_seconds": 4}],
    }], "served_by": "encode-9"}).encode()
    broken = {
        "truncated": newer[: len(newer) // 2],
        "wrong shape": json.dumps({"videos": {video_id: "processing"}}).encode(),
        "a refusal": json.dumps({"error": {"status": 503, "code": "unavailable", "detail": "later"}}).encode(),
    }
    reply = {"body": newer}
    answered: list[Doc] = []

    async def v2_encode(msg: Msg) -> None:
        answered.append(json.loads(msg.data))
        await msg.respond(reply["body"])

    v1 = Requests()
    subs = [await nc.subscribe(STATUS_V2_SUBJECT, cb=v2_encode), await nc.subscribe(STATUS_SUBJECT, cb=v1.on)]
    await nc.flush()
    try:
        async def get_from_newer() -> Doc | None:
            shown: Doc = (await client.call("GET", f"/v1/videos/{video_id}")).json()
            return shown if shown["processing"] is not None else None

        shown = await wait_for(get_from_newer, WAIT, "GET one to show the newer encode's v2 reply")
        assert shown["status"] == "uploaded"  # a processing state it does not know: its own status
        assert shown["processing"]["deadline_at"] == deadline
        assert [(o["height"], o["state"], o["worker"]) for o in shown["processing"]["outputs"]] == [
            (360, "pending", "w9")]  # an output state it does not know: pending

        async def listed_from_newer() -> Doc | None:
            entry = (await listed(client, 100))[video_id]
            return entry if entry["processing"] is not None else None

        entry = await wait_for(listed_from_newer, WAIT, "the listing to show the newer encode's v2 reply")
        assert entry["processing"] == shown["processing"]

        for case, body in broken.items():
            reply["body"] = body
            asked = len(answered)
            r = await client.call("GET", f"/v1/videos/{video_id}")
            assert r.status_code == 200 and r.json()["processing"] is None, (case, r.text)  # the projection
            r = await client.call("GET", "/v1/videos?limit=100")
            assert r.status_code == 200, (case, r.text)
            assert {v["id"]: v for v in r.json()["videos"]}[video_id]["processing"] is None, case
            await wait_for(lambda n=asked + 2: len(answered) >= n, WAIT, f"both to ask v2 ({case})")  # each asked it
        await nc.flush()
        assert v1.bodies == []
    finally:
        for s in subs:
            await s.unsubscribe()
