"""The api reads auth.check's reply tolerantly, through HTTP, with a responder of the test's own in auth's place on a
NATS server of the test's own: a reply with fields and values this release does not know is read (the unknown fields
ignored, the unknown closed-set values read as their fallbacks), and a reply that cannot be read is a 503
`unavailable` with Retry-After and one log line naming the subject, never a 500."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import nats
import pytest
from nats.aio.msg import Msg

from shared.authcheck import CHECK_SUBJECT, QUEUE_GROUP, manage_subject
from tests.integration.apihelpers import private_bus, run_services

pytestmark = pytest.mark.asyncio(loop_scope="session")

NO_ROUTE = "/v1/no-such-route"  # allowed by auth as a route of class "public": the api itself then answers 404
NEWER = {  # a newer auth's reply: a field, an identity's key type and a counter mode this release does not know
    "allowed": True, "status": 200, "problem": None, "verdict": "allowed by policy 7",
    "identity": {"key_type": "robot_key", "scopes": ["read"]}, "client_address": "10.9.8.7",
    "counter_mode": "quorum", "cors_origin": None, "headers": {"RateLimit": '"address";r=9;t=60'},
}
UNREADABLE = {"allowed": "perhaps", "status": 200, "client_address": "10.9.8.7", "headers": {}}
LOG_LINE = f"unreadable reply on {CHECK_SUBJECT}"


def log_lines(logs: Path) -> list[str]:
    return [line for log in logs.glob("api-*.log") for line in log.read_text().splitlines() if LOG_LINE in line]


async def test_a_newer_reply_is_read_and_an_unreadable_one_is_a_503(
    stack_env: dict[str, str], tmp_path: Path
) -> None:
    (tmp_path / "nats").mkdir()
    with private_bus(stack_env, tmp_path / "nats") as env, run_services(env, tmp_path, names=("api",)) as api:
        nc = await nats.connect(env["WEIR_NATS_URL"])  # the test's own server admits anyone
        answer = {"body": json.dumps(NEWER).encode()}

        async def respond(msg: Msg) -> None:
            await nc.publish(msg.reply, answer["body"])

        try:
            await nc.subscribe(CHECK_SUBJECT, queue=QUEUE_GROUP, cb=respond)
            await nc.flush()
            async with httpx.AsyncClient(base_url=api.api_url, timeout=10) as http:
                read = await http.get(NO_ROUTE)
                assert read.status_code == 404, read.text
                assert read.headers["ratelimit"] == NEWER["headers"]["RateLimit"]  # type: ignore[index]
                assert log_lines(tmp_path) == []

                answer["body"] = json.dumps(UNREADABLE).encode()
                refused = await http.get(NO_ROUTE)
                assert refused.status_code == 503, refused.text
                assert refused.headers["retry-after"].isdigit()
                assert refused.json()["code"] == "unavailable"
                async with asyncio.timeout(10):  # the api's log reaches its file on its own schedule
                    while not log_lines(tmp_path):
                        await asyncio.sleep(0.05)
                assert len(log_lines(tmp_path)) == 1  # one line, naming the subject (no traceback)
                assert "Traceback" not in "".join(p.read_text() for p in tmp_path.glob("api-*.log"))
        finally:
            await nc.close()


async def test_a_management_reply_a_newer_auth_extends_is_read_and_an_unreadable_one_is_a_503(
    stack_env: dict[str, str], tmp_path: Path
) -> None:
    """POST /v1/account/apps with auth's two subjects answered by the test: auth.check allows an account token, and
    auth.manage.app.create answers a newer auth's reply (one more field), then one this release cannot read."""
    subject = manage_subject("app.create")
    allowed = {"allowed": True, "status": 200, "client_address": "10.9.8.7", "headers": {},
               "identity": {"key_type": "account_token", "user_id": "u1", "account_id": "a1"}}
    created = {"id": "app1", "name": "n", "secret_key": "wsk_" + "s" * 32, "publishable_key": "wpk_" + "p" * 32,
               "secret_key_id": "k1", "publishable_key_id": "k2", "quota": {"videos": 10}}
    (tmp_path / "nats").mkdir()
    with private_bus(stack_env, tmp_path / "nats") as env, run_services(env, tmp_path, names=("api",)) as api:
        nc = await nats.connect(env["WEIR_NATS_URL"])
        answer = {"body": json.dumps(created).encode()}

        async def check(msg: Msg) -> None:
            await nc.publish(msg.reply, json.dumps(allowed).encode())

        async def manage(msg: Msg) -> None:
            await nc.publish(msg.reply, answer["body"])

        def lines() -> list[str]:
            return [line for log in tmp_path.glob("api-*.log") for line in log.read_text().splitlines()
                    if f"unreadable reply on {subject}" in line]

        try:
            await nc.subscribe(CHECK_SUBJECT, queue=QUEUE_GROUP, cb=check)
            await nc.subscribe(subject, queue=QUEUE_GROUP, cb=manage)
            await nc.flush()
            async with httpx.AsyncClient(base_url=api.api_url, timeout=10) as http:
                headers = {"Authorization": "Bearer wat_" + "t" * 32}
                read = await http.post("/v1/account/apps", json={"name": "n"}, headers=headers)
                assert read.status_code == 201, read.text
                assert read.json()["id"] == "app1" and "quota" not in read.json()

                answer["body"] = json.dumps({**created, "secret_key_id": None}).encode()
                refused = await http.post("/v1/account/apps", json={"name": "n"}, headers=headers)
                assert refused.status_code == 503, refused.text
                assert refused.json()["code"] == "unavailable" and refused.headers["retry-after"].isdigit()
                async with asyncio.timeout(10):
                    while not lines():
                        await asyncio.sleep(0.05)
                assert len(lines()) == 1
                assert "Traceback" not in "".join(p.read_text() for p in tmp_path.glob("api-*.log"))
        finally:
            await nc.close()
