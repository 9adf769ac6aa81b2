"""Each request/reply contract's caller, answered by a responder of a newer release (a plain nats-py subscriber of the
test's on the real subject, its replies under a `Weir-Version` header naming a release after this one), on a real
nats-server:
(a) a reply with fields and closed-set values this release does not know is read with the declared fallbacks, and the
    user sees the right answer;
(b) a truncated reply and (c) a reply of another shape (valid JSON) cannot be read: the CLI prints one clear error line
    naming the subject and both releases and exits non-zero; the farm's callers take the safe outcome (an offer
    answered so was not taken: the output stays pending, neither accepted nor busy; a result answered so stays
    undelivered and is sent again), with one log line naming the subject and both releases.
encode.status, asked by GET /v1/videos/{id} of a video being processed: an answer the api cannot read shows the api's
own projection of encode's events instead, with one log line naming the subject and both releases.
The api's auth contracts (auth.check, auth.manage.* through HTTP) are in test_api_auth_replies.py."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import nats
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from services.api import domain as api_domain
from services.api import store as api_store
from services.encode.domain import AnswerKind
from services.encode.farm import Farm, Registry
from services.encode.settings import EncodeSettings
from services.media.settings import MediaSettings
from services.media.worker import Worker
from services.sweep.trigger import QUEUE_GROUP as SWEEP_QUEUE
from services.sweep.trigger import RUN_SUBJECT
from shared import db
from shared.authcheck import CHECK_SUBJECT, QUEUE_GROUP, manage_subject
from shared.bus import HDR_VERSION, subscriptions_in_place
from shared.media.protocol import RESULT_SUBJECT, STATUS_SUBJECT, Heartbeat, Offer, offer_subject
from shared.messaging import make_broker
from shared.release import VERSION
from shared.settings import CommonSettings
from shared.videos import VideoStatus
from tests.conftest import fresh_schema
from tests.integration.apihelpers import private_bus, run_services

pytestmark = pytest.mark.asyncio(loop_scope="session")

NEWER_RELEASE = "9.4.0"  # a release after this one
WRONG_SHAPE = {"video": {"id": "v1", "status": "ready"}}  # valid JSON, another object


def truncated(reply: dict[str, Any]) -> bytes:
    body = json.dumps(reply).encode()
    return body[: len(body) // 2]


def naming(subject: str) -> str:
    """How the log line about an unreadable reply on `subject` begins (the releases follow)."""
    return f"unreadable reply on {subject}"


class Responder:
    """Answers with `body` under a newer release's header, keeping what it was asked."""

    def __init__(self, nc: NATS, body: bytes) -> None:
        self.nc = nc
        self.body = body
        self.asked: list[Msg] = []

    async def answer(self, msg: Msg) -> None:
        self.asked.append(msg)
        await self.nc.publish(msg.reply, self.body, headers={HDR_VERSION: NEWER_RELEASE})


def weir(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "weir.cli", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env, "COLUMNS": "200"})


def one_clear_line(result: subprocess.CompletedProcess[str], subject: str) -> None:
    """The CLI's answer to a reply it cannot read: non-zero, no traceback, a line naming the subject and both
    releases."""
    out = result.stdout + result.stderr
    assert result.returncode not in (0, None), out
    assert "Traceback" not in out, out
    lines = [line for line in out.splitlines() if subject in line and VERSION in line and NEWER_RELEASE in line]
    assert lines, out


@pytest.fixture
async def bus(stack_env: dict[str, str], tmp_path: Path) -> AsyncIterator[tuple[dict[str, str], NATS]]:
    """A nats-server of the test's own (its streams applied) and a plain connection to it (it admits anyone)."""
    (tmp_path / "nats").mkdir()
    with private_bus(stack_env, tmp_path / "nats") as env:
        nc = await nats.connect(env["WEIR_NATS_URL"])
        try:
            yield env, nc
        finally:
            await nc.close()


async def test_weir_keys_list_reads_a_newer_auth_and_names_both_releases_when_it_cannot(
    bus: tuple[dict[str, str], NATS],
) -> None:
    """`weir keys list`: auth.check (the account token) then auth.manage.keys.list, both answered by a newer auth."""
    env, nc = bus
    allowed = {"allowed": True, "status": 200, "client_address": "127.0.0.1", "headers": {}, "trust": "high",
               "identity": {"key_type": "account_token", "user_id": "u1", "account_id": "a1", "team": "t"}}
    keys = {"keys": [{"id": "k9", "kind": "robot", "prefix": "wrk_abcd", "created_at": "2026-12-03T10:00:00Z",
                      "revoked_at": None, "last_used_at": "2026-12-03T11:00:00Z"}], "next": None}
    listing = manage_subject("keys.list")
    check = Responder(nc, json.dumps(allowed).encode())
    answer = Responder(nc, json.dumps(keys).encode())
    await nc.subscribe(CHECK_SUBJECT, queue=QUEUE_GROUP, cb=check.answer)
    await nc.subscribe(listing, queue=QUEUE_GROUP, cb=answer.answer)
    await subscriptions_in_place(nc)
    args = ("keys", "list", "app1", "--account-token", "wat_" + "t" * 32)

    read = await asyncio.to_thread(weir, env, *args)
    assert read.returncode == 0, read.stdout + read.stderr
    (row,) = [line for line in read.stdout.splitlines() if "k9" in line]
    assert "secret" in row and "robot" not in row  # the kind this release does not know: the one never exposed
    assert answer.asked[-1].headers == {HDR_VERSION: VERSION}  # the CLI's request names its release

    for body in (truncated(keys), json.dumps(WRONG_SHAPE).encode()):
        answer.body = body
        one_clear_line(await asyncio.to_thread(weir, env, *args), listing)
    check.body = truncated(allowed)  # the check before the operation: the same for auth.check
    one_clear_line(await asyncio.to_thread(weir, env, *args), CHECK_SUBJECT)


async def test_weir_sweep_run_reads_a_newer_sweep_and_names_both_releases_when_it_cannot(
    bus: tuple[dict[str, str], NATS],
) -> None:
    """`weir sweep run --dry-run` asks the sweep service: a newer one accepts with more fields, sends an update of a
    kind this release does not know (a heartbeat) and a report with a trigger and fields it does not know."""
    env, nc = bus
    run_id = str(uuid.uuid4())
    accepted = {"accepted": True, "run_id": run_id, "detail": "", "queue_position": 0}
    report = {"id": run_id, "trigger": "on_schedule_of_robot", "dry_run": True, "force": False,
              "started_at": datetime.now(UTC).isoformat(), "daily_for": None, "outcome": "completed",
              "finished_at": datetime.now(UTC).isoformat(), "duration_seconds": 0.5, "note": "",
              "examined": 7, "retired": {}, "left_alone": {"young": 4}, "would_retire": {"stale_file": 3},
              "dry_run_retire": {"stale_file": 3}, "errors": 0, "bytes_removed": 0, "regions": ["eu"]}
    answer = Responder(nc, json.dumps(accepted).encode())

    async def run(msg: Msg) -> None:
        await answer.answer(msg)
        updates = json.loads(msg.data)["updates"]
        if answer.body == json.dumps(accepted).encode():
            for update in ({"kind": "checkpoint", "phase": "survey", "done": 1, "total": 7, "shard": 2},
                           {"kind": "report", "report": report, "signed": "x"}):
                await nc.publish(updates, json.dumps(update).encode(), headers={HDR_VERSION: NEWER_RELEASE})

    await nc.subscribe(RUN_SUBJECT, queue=SWEEP_QUEUE, cb=run)
    await subscriptions_in_place(nc)

    read = await asyncio.to_thread(weir, env, "sweep", "run", "--dry-run")
    assert read.returncode == 0, read.stdout + read.stderr
    assert run_id in read.stdout and "on_demand, dry run" in read.stdout, read.stdout  # the unknown trigger's fallback
    assert any("examined" in line and "7" in line for line in read.stdout.splitlines()), read.stdout
    assert (answer.asked[-1].headers or {}).get(HDR_VERSION) == VERSION  # FastStream's request names its release

    for body in (truncated(accepted), json.dumps(WRONG_SHAPE).encode()):
        answer.body = body
        one_clear_line(await asyncio.to_thread(weir, env, "sweep", "run", "--dry-run"), RUN_SUBJECT)


async def test_encode_takes_an_unreadable_offer_answer_as_not_taken(
    prepared: CommonSettings, nc: NATS, caplog: pytest.LogCaptureFixture
) -> None:
    """farm.offer: a newer worker's busy answer (more fields, a reason this release does not know) is busy and its
    acceptance accepted; an answer encode cannot read means the worker did not take the output, and did not say
    busy either: beside a busy worker the round's answer is unreachable (the deadline keeps running) and not in
    doubt (the output is known not taken: it stays pending, offered again next round)."""
    settings = EncodeSettings(nats_url=prepared.nats_url, nats_nkey_seed_dir=prepared.nats_nkey_seed_dir,
                              nats_identity=prepared.nats_identity)
    broker = make_broker(settings, name="encode-test")
    await broker.connect()
    busy, newer = uuid.uuid4().hex, uuid.uuid4().hex
    busy_answer = {"accepted": False, "worker": "busy-1", "instance": busy, "reason": "full"}
    newer_answer = {"accepted": False, "worker": "newer-1", "instance": newer, "reason": "thermal_throttle",
                    "gpu": "a100"}
    busy_worker = Responder(nc, json.dumps(busy_answer).encode())
    newer_worker = Responder(nc, json.dumps(newer_answer).encode())
    subs = [await nc.subscribe(offer_subject(busy), cb=busy_worker.answer),
            await nc.subscribe(offer_subject(newer), cb=newer_worker.answer)]
    await subscriptions_in_place(nc)
    try:
        registry = Registry(settings.media_heartbeat_timeout_seconds, settings.large_output_height)
        farm = Farm.declare(broker, registry, settings.dispatch_answer_timeout_ms / 1000)
        offer = Offer(video_id=str(uuid.uuid4()), output=360, attempt=1, job_class="developer", object_key="k")
        now = datetime.now(UTC)
        registry.heard(Heartbeat(worker="busy-1", instance=busy, slots=2, sent_at=now))
        registry.heard(Heartbeat(worker="newer-1", instance=newer, slots=2, sent_at=now))
        answer = await farm.offer(offer)
        assert answer.kind == AnswerKind.BUSY and set(answer.busy_workers) == {"busy-1", "newer-1"}
        assert newer_worker.asked[-1].headers is not None
        assert newer_worker.asked[-1].headers[HDR_VERSION] == VERSION  # encode's offer names its release

        newer_worker.body = json.dumps({**newer_answer, "accepted": True}).encode()
        accepted = await farm.offer(offer)
        assert accepted.kind == AnswerKind.ACCEPTED and accepted.instance == newer
        registry.heard(Heartbeat(worker="newer-1", instance=newer, slots=2, sent_at=now))  # its slot free again

        subject = offer_subject(newer)
        for count, body in enumerate((truncated(newer_answer), json.dumps(WRONG_SHAPE).encode()), start=1):
            newer_worker.body = body
            with caplog.at_level(logging.WARNING, logger="weir.messaging"):
                answer = await farm.offer(offer)
            assert answer.kind == AnswerKind.UNREACHABLE and not answer.in_doubt, answer
            assert answer.busy_workers == ("busy-1",)
            lines = [r.getMessage() for r in caplog.records if naming(subject) in r.getMessage()]
            assert len(lines) == count, lines
            assert f"this release {VERSION}, the sender's {NEWER_RELEASE}" in lines[-1]
            assert "stays pending" in lines[-1]
    finally:
        for sub in subs:
            await sub.unsubscribe()
        await broker.stop()


async def test_media_keeps_a_result_undelivered_while_the_ack_cannot_be_read(
    bus: tuple[dict[str, str], NATS], caplog: pytest.LogCaptureFixture
) -> None:
    """farm.result: a newer encode's acknowledgement (more fields) marks the result delivered; one media cannot read
    leaves it undelivered (it goes again on the next delivery: never lost), with one log line each time."""
    env, nc = bus
    settings = MediaSettings(**{k[len("WEIR_"):].lower(): v for k, v in env.items()})  # type: ignore[arg-type]
    ack = {"recorded": True, "applied": True, "stored_as": "v2"}
    encode = Responder(nc, json.dumps(ack).encode())
    await nc.subscribe(RESULT_SUBJECT, queue="encode", cb=encode.answer)
    await subscriptions_in_place(nc)
    broker = make_broker(settings, name="media")
    await broker.connect()
    async with fresh_schema(settings.database_url, "media") as (_, pool):
        try:
            worker = Worker(settings=settings, broker=broker, events=None, pool=pool, s3=None)  # type: ignore[arg-type]

            async def record() -> tuple[str, int, int]:
                key = (str(uuid.uuid4()), 360, 1)
                payload = {"video_id": key[0], "output": 360, "attempt": 1, "worker": "w", "instance": "i",
                           "outcome": "completed", "finished_at": datetime.now(UTC).isoformat()}
                await pool.execute("INSERT INTO results (video_id, output, attempt, payload) VALUES ($1, $2, $3, $4)",
                                   *key, json.dumps(payload))
                return key

            async def undelivered(key: tuple[str, int, int]) -> bool:
                return bool(await pool.fetchval("SELECT delivered_at IS NULL FROM results WHERE video_id = $1", key[0]))

            key = await record()
            assert await worker.deliver(only=key) == 1 and not await undelivered(key)
            assert encode.asked[-1].headers is not None and encode.asked[-1].headers[HDR_VERSION] == VERSION

            for count, body in enumerate((truncated(ack), json.dumps(WRONG_SHAPE).encode()), start=1):
                encode.body = body
                key = await record()
                with caplog.at_level(logging.WARNING, logger="weir.messaging"):
                    assert await worker.deliver(only=key) == 0
                assert await undelivered(key)
                lines = [r.getMessage() for r in caplog.records if naming(RESULT_SUBJECT) in r.getMessage()]
                assert len(lines) == count, lines
                assert f"this release {VERSION}, the sender's {NEWER_RELEASE}" in lines[-1]
                assert "stays undelivered" in lines[-1]
            encode.body = json.dumps(ack).encode()  # an encode it can read again: the result goes
            assert await worker.deliver(only=key) == 1 and not await undelivered(key)
        finally:
            await broker.stop()


async def test_get_video_reads_a_newer_encode_status_and_shows_the_projection_when_it_cannot(
    bus: tuple[dict[str, str], NATS], tmp_path: Path
) -> None:
    """A video being processed, its projection saying 360p is encoding on "w-events"; encode.status answered by a
    newer encode: its fields and an output state this release does not know (shown as pending, the fallback) are
    read, and its answer is shown; a truncated answer and one of another shape show the projection."""
    env, nc = bus
    app_id, account_id, key_id = (str(uuid.uuid4()) for _ in range(3))
    allowed = {"allowed": True, "status": 200, "client_address": "10.9.8.7", "headers": {},
               "identity": {"key_type": "secret_key", "app_id": app_id, "account_id": account_id, "key_id": key_id}}
    pool = await db.create_pool(env["WEIR_DATABASE_URL"], schema=db.SCHEMAS["api"], max_size=2)
    try:
        async with pool.acquire() as conn:
            video = await api_store.create(conn, app_id=app_id, account_id=account_id, key_id=key_id, name="n",
                                           metadata={})
            await api_store.save_projection(conn, video.id, api_domain.Projection(
                status=VideoStatus.PROCESSING, renditions=(), failure=None,
                processing={"deadline_at": None, "busy_at": None,
                            "outputs": [{"height": 360, "state": "encoding", "worker": "w-events"}]}))
    finally:
        await pool.close()
    live = {"video_id": video.id, "found": True, "status": "processing", "deadline_at": None, "busy_at": None,
            "outputs": [{"height": 360, "state": "encoding", "worker": "w-live", "restarts": 0, "gpu": "a100"},
                        {"height": 720, "state": "queued_on_gpu", "worker": None, "restarts": 0}],
            "restarted": [], "queue_depth": 3}
    encode = Responder(nc, json.dumps(live).encode())
    await nc.subscribe(CHECK_SUBJECT, queue=QUEUE_GROUP, cb=Responder(nc, json.dumps(allowed).encode()).answer)
    await nc.subscribe(STATUS_SUBJECT, queue="encode", cb=encode.answer)
    await subscriptions_in_place(nc)

    def lines() -> list[str]:
        return [line for log in tmp_path.glob("api-*.log") for line in log.read_text().splitlines()
                if f"unreadable reply on {STATUS_SUBJECT}:" in line]

    with run_services(env, tmp_path, names=("api",)) as api:
        async with httpx.AsyncClient(base_url=api.api_url, timeout=10,
                                     headers={"Authorization": "Bearer wsk_" + "s" * 32}) as http:
            shown = await http.get(f"/v1/videos/{video.id}")
            assert shown.status_code == 200, shown.text
            outputs = [(o["height"], o["state"], o["worker"]) for o in shown.json()["processing"]["outputs"]]
            assert outputs == [(360, "encoding", "w-live"), (720, "pending", None)]  # encode's answer, read
            assert shown.json()["status"] == "processing"
            assert (encode.asked[-1].headers or {}).get(HDR_VERSION) == VERSION
            assert lines() == []

            for count, body in enumerate((truncated(live), json.dumps(WRONG_SHAPE).encode()), start=1):
                encode.body = body
                shown = await http.get(f"/v1/videos/{video.id}")
                assert shown.status_code == 200, shown.text
                outputs = [(o["height"], o["state"], o["worker"]) for o in shown.json()["processing"]["outputs"]]
                assert outputs == [(360, "encoding", "w-events")]  # the projection of encode's events
                async with asyncio.timeout(10):  # the api's log reaches its file on its own schedule
                    while len(lines()) < count:
                        await asyncio.sleep(0.05)
                assert len(lines()) == count, lines()
                assert f"this release {VERSION}, the sender's {NEWER_RELEASE}; showing the projection" in lines()[-1]
        assert "Traceback" not in "".join(p.read_text() for p in tmp_path.glob("api-*.log"))
