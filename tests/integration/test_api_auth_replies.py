"""The api reads auth's replies tolerantly, through HTTP, with a responder of the test's own in auth's place on a NATS
server of the test's own, answering as a newer release would (its `Weir-Version` header names a release after this
one): a reply with fields and values this release does not know is read (the unknown fields ignored, the unknown
closed-set values read as their fallbacks), and a reply that cannot be read (truncated, or valid JSON of another
shape) is a 503 `unavailable` with Retry-After and one log line naming the subject and both releases, never a 500.
A reply without the header comes from a release before 1.1.0: the line names its release "unknown"."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping
from pathlib import Path

import httpx
import nats
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from shared.authcheck import CHECK_SUBJECT, QUEUE_GROUP, SENT_AT_HEADER, manage_subject
from shared.bus import HDR_VERSION, UNKNOWN_VERSION
from shared.release import VERSION
from tests.integration.apihelpers import private_bus, run_services

pytestmark = pytest.mark.asyncio(loop_scope="session")

NEWER_RELEASE = "9.4.0"  # a release after this one
NO_ROUTE = "/v1/no-such-route"  # allowed by auth as a route of class "public": the api itself then answers 404
NEWER = {  # a newer auth's reply: a field, an identity's key type and a counter mode this release does not know
    "allowed": True, "status": 200, "problem": None, "verdict": "allowed by policy 7",
    "identity": {"key_type": "robot_key", "scopes": ["read"]}, "client_address": "10.9.8.7",
    "counter_mode": "quorum", "cors_origin": None, "headers": {"RateLimit": '"address";r=9;t=60'},
}
WRONG_SHAPE = {"video": {"id": "v1", "status": "ready"}}  # valid JSON, another object


def truncated(reply: Mapping[str, object]) -> bytes:
    body = json.dumps(reply).encode()
    return body[: len(body) // 2]


def unreadable_lines(logs: Path, subject: str) -> list[str]:
    return [line for log in logs.glob("api-*.log") for line in log.read_text().splitlines()
            if f"unreadable reply on {subject}:" in line]


def naming(subject: str, sender: str) -> str:
    """What the api's one log line for an unreadable reply says: the subject, this release and the sender's."""
    return f"unreadable reply on {subject}: this release {VERSION}, the sender's {sender}:"


async def lines_reach(logs: Path, subject: str, count: int) -> list[str]:
    """The api's unreadable-reply lines on `subject`, once there are `count` (its log reaches the file on its own
    schedule)."""
    async with asyncio.timeout(10):
        while len(unreadable_lines(logs, subject)) < count:
            await asyncio.sleep(0.05)
    return unreadable_lines(logs, subject)


class Responder:
    """Answers a subject with `body`, under the header `headers` (a newer release's by default)."""

    def __init__(self, nc: NATS, body: bytes) -> None:
        self.nc = nc
        self.body = body
        self.headers: dict[str, str] | None = {HDR_VERSION: NEWER_RELEASE}

    async def answer(self, msg: Msg) -> None:
        await self.nc.publish(msg.reply, self.body, headers=self.headers)


async def test_a_newer_check_reply_is_read_and_an_unreadable_one_is_a_503(
    stack_env: dict[str, str], tmp_path: Path
) -> None:
    (tmp_path / "nats").mkdir()
    with private_bus(stack_env, tmp_path / "nats") as env, run_services(env, tmp_path, names=("api",)) as api:
        nc = await nats.connect(env["WEIR_NATS_URL"])  # the test's own server admits anyone
        respond = Responder(nc, json.dumps(NEWER).encode())
        asked: list[Msg] = []

        async def check(msg: Msg) -> None:
            asked.append(msg)
            await respond.answer(msg)

        try:
            await nc.subscribe(CHECK_SUBJECT, queue=QUEUE_GROUP, cb=check)
            await nc.flush()
            async with httpx.AsyncClient(base_url=api.api_url, timeout=10) as http:
                read = await http.get(NO_ROUTE)
                assert read.status_code == 404, read.text
                assert read.headers["ratelimit"] == NEWER["headers"]["RateLimit"]  # type: ignore[index]
                assert unreadable_lines(tmp_path, CHECK_SUBJECT) == []
                # the api's request names its release, and when it was sent (auth sheds what waited too long)
                assert asked[-1].headers is not None and asked[-1].headers[HDR_VERSION] == VERSION
                sent_at = int(asked[-1].headers[SENT_AT_HEADER]) / 1000
                assert abs(time.time() - sent_at) < 10

                for count, (body, sender) in enumerate([
                    (truncated(NEWER), NEWER_RELEASE),
                    (json.dumps(WRONG_SHAPE).encode(), NEWER_RELEASE),
                    (json.dumps(WRONG_SHAPE).encode(), UNKNOWN_VERSION),  # a release before the header
                ], start=1):
                    respond.body = body
                    respond.headers = None if sender == UNKNOWN_VERSION else {HDR_VERSION: sender}
                    refused = await http.get(NO_ROUTE)
                    assert refused.status_code == 503, refused.text
                    assert refused.headers["retry-after"].isdigit()
                    assert refused.json()["code"] == "unavailable"
                    lines = await lines_reach(tmp_path, CHECK_SUBJECT, count)
                    assert len(lines) == count  # one line per unreadable reply
                    assert naming(CHECK_SUBJECT, sender) in lines[-1], lines[-1]
                assert "Traceback" not in "".join(p.read_text() for p in tmp_path.glob("api-*.log"))
        finally:
            await nc.close()


async def test_a_management_reply_a_newer_auth_extends_is_read_and_an_unreadable_one_is_a_503(
    stack_env: dict[str, str], tmp_path: Path
) -> None:
    """POST /v1/account/apps and GET /v1/account/apps/{id}/keys with auth's subjects answered by the test: auth.check
    allows an account token, and auth.manage.* answers a newer auth's replies (one more field, a key kind this
    release does not know: read as "secret", the kind never to expose), then ones this release cannot read."""
    create = manage_subject("app.create")
    listing = manage_subject("keys.list")
    allowed = {"allowed": True, "status": 200, "client_address": "10.9.8.7", "headers": {},
               "identity": {"key_type": "account_token", "user_id": "u1", "account_id": "a1"}}
    created = {"id": "app1", "name": "n", "secret_key": "wsk_" + "s" * 32, "publishable_key": "wpk_" + "p" * 32,
               "secret_key_id": "k1", "publishable_key_id": "k2", "quota": {"videos": 10}}
    keys = {"keys": [{"id": "k9", "kind": "robot", "prefix": "wrk_abcd", "created_at": "2026-12-03T10:00:00Z",
                      "revoked_at": None, "last_used_at": "2026-12-03T11:00:00Z"}], "next": None}
    (tmp_path / "nats").mkdir()
    with private_bus(stack_env, tmp_path / "nats") as env, run_services(env, tmp_path, names=("api",)) as api:
        nc = await nats.connect(env["WEIR_NATS_URL"])
        answers = {create: Responder(nc, json.dumps(created).encode()),
                   listing: Responder(nc, json.dumps(keys).encode())}
        try:
            await nc.subscribe(CHECK_SUBJECT, queue=QUEUE_GROUP, cb=Responder(nc, json.dumps(allowed).encode()).answer)
            for subject, respond in answers.items():
                await nc.subscribe(subject, queue=QUEUE_GROUP, cb=respond.answer)
            await nc.flush()
            async with httpx.AsyncClient(base_url=api.api_url, timeout=10) as http:
                headers = {"Authorization": "Bearer wat_" + "t" * 32}
                read = await http.post("/v1/account/apps", json={"name": "n"}, headers=headers)
                assert read.status_code == 201, read.text
                assert read.json()["id"] == "app1" and "quota" not in read.json()
                listed = await http.get("/v1/account/apps/app1/keys", headers=headers)
                assert listed.status_code == 200, listed.text
                assert [(k["id"], k["kind"]) for k in listed.json()["keys"]] == [("k9", "secret")]

                bad = [truncated(created), json.dumps({**created, "secret_key_id": None}).encode(),
                       json.dumps(WRONG_SHAPE).encode()]
                for count, body in enumerate(bad, start=1):
                    answers[create].body = body
                    refused = await http.post("/v1/account/apps", json={"name": "n"}, headers=headers)
                    assert refused.status_code == 503, refused.text
                    assert refused.json()["code"] == "unavailable" and refused.headers["retry-after"].isdigit()
                    lines = await lines_reach(tmp_path, create, count)
                    assert len(lines) == count and naming(create, NEWER_RELEASE) in lines[-1], lines
                answers[listing].body = truncated(keys)
                refused = await http.get("/v1/account/apps/app1/keys", headers=headers)
                assert refused.status_code == 503 and refused.json()["code"] == "unavailable", refused.text
                (line,) = await lines_reach(tmp_path, listing, 1)
                assert naming(listing, NEWER_RELEASE) in line
                assert "Traceback" not in "".join(p.read_text() for p in tmp_path.glob("api-*.log"))
        finally:
            await nc.close()
