"""`weir status --json` against the session's real servers and real service processes: a message parked in the DLQ,
a media worker killed (fewer workers and slots once its heartbeats are overdue), and the limits store on local
windows while the counter store is unreachable (and shared again once it is back)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.aio.client import Client as NATS

from services.auth.settings import AuthSettings
from shared.authcheck import CheckRequest
from shared.authclient import check
from shared.bus import HDR_MSG_ID
from shared.events import Envelope, UploadCompleted, new_event
from shared.settings import CommonSettings
from shared.streams import STREAMS, apply_streams
from tests.integration.apihelpers import private_bus, run_services
from tests.integration.authhelpers import STORE_BUDGET_MS, TEST_SECRETS, fresh_address
from tests.integration.test_encode_helpers import (
    Procs,
    clean_encode_state,
    fast_farm,
    prepare_encode_consumers,
    processes,
)
from tests.waiting import wait_for

pytestmark = pytest.mark.asyncio(loop_scope="session")
Doc = dict[str, Any]


async def weir_status(env: dict[str, str], *args: str) -> tuple[int, Doc]:
    """`weir status --json` as a process (the operator's identity, from the seeds' directory in `env`)."""
    result = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "weir.cli", "status", "--json", *args], capture_output=True,
        text=True, timeout=120, env={**os.environ, **env})
    assert result.returncode in (0, 1), result.stdout + result.stderr
    doc: Doc = json.loads(result.stdout)
    assert doc["ok"] is (result.returncode == 0)
    return result.returncode, doc


@pytest.fixture
async def farm(stack_env: dict[str, str], prepared: CommonSettings, tmp_path: Path) -> AsyncIterator[Procs]:
    await prepare_encode_consumers(prepared)  # encode's durables start at the end of their streams
    await clean_encode_state(prepared)  # no worker of an earlier test in encode's table
    with processes(stack_env, tmp_path) as procs:
        yield procs
    await clean_encode_state(prepared)


def malformed_upload() -> tuple[str, bytes]:
    """An upload.completed whose envelope is fine and whose data is not an UploadCompleted: parked at once."""
    event = new_event(UploadCompleted(video_id=str(uuid.uuid4()), app_id=str(uuid.uuid4()),
                                      account_id=str(uuid.uuid4()), key_id=str(uuid.uuid4()),
                                      object_key="sources/none", size=1, content_type="video/mp4", source_height=240),
                      source="api", subject="malformed")
    bad = Envelope.model_validate({**event.model_dump(), "data": {**event.data, "size": "a lot"}})
    return str(event.id), bad.to_bytes()


async def test_status_reports_a_parked_message_and_a_killed_worker(
    farm: Procs, stack_env: dict[str, str], nc: NATS, tmp_path: Path
) -> None:
    settings = fast_farm(media_slots=2)
    heartbeat_timeout = float(settings["media_heartbeat_timeout_seconds"])
    farm.start("auth", **TEST_SECRETS, counter_store_timeout_ms=STORE_BUDGET_MS)
    farm.start("encode", **settings)
    _, killed = farm.start("media-1", "media-2", **settings)
    # the addresses as `weir up` writes them; the CLI judges a worker live by encode's own heartbeat timeout
    stack = tmp_path / "stack.json"
    stack.write_text(json.dumps({"services": {p.name: p.url for p in farm.procs}}))
    env = {**stack_env, "WEIR_MEDIA_HEARTBEAT_TIMEOUT_SECONDS": str(heartbeat_timeout)}

    async def status() -> tuple[int, Doc]:
        return await weir_status(env, "--stack", str(stack))

    async def with_workers(n: int) -> tuple[int, Doc] | None:
        rc, doc = await status()
        return (rc, doc) if doc["farm"] is not None and doc["farm"]["workers"] == n else None

    rc, doc = await wait_for(lambda: with_workers(2), 30, "both workers in the farm")
    assert rc == 0, doc  # everything answered, everything ready
    assert set(doc["services"]) == {"auth", "encode", "media-1", "media-2"}
    assert all(s["ready"] for s in doc["services"].values())
    assert {k: doc["farm"][k] for k in ("workers", "slots", "busy")} == {"workers": 2, "slots": 4, "busy": 0}
    assert sorted(w["name"] for w in doc["farm"]["detail"]) == ["media-1", "media-2"]
    assert [s["name"] for s in doc["streams"]] == [s.name for s in STREAMS]
    assert {"stream": "VIDEOS", "name": "encode_uploads"}.items() <= next(
        c for c in doc["consumers"] if c["name"] == "encode_uploads").items()
    assert set(doc["outbox"]) == {"auth", "api", "sweep", "encode", "media", "webhooks"}
    assert doc["limits"]["mode"] == "shared"
    assert "last_run" in doc["sweep"]

    # a malformed upload.completed on the real stream: encode's consumer parks it on dlq.upload.completed
    parked_before = doc["dlq"].get("upload.completed", 0)
    msg_id, malformed = malformed_upload()
    await nc.jetstream().publish("upload.completed", malformed, headers={HDR_MSG_ID: msg_id})

    async def parked() -> Doc | None:
        _, doc = await status()
        return doc if doc["dlq"].get("upload.completed", 0) == parked_before + 1 else None

    await wait_for(parked, 30, "the parked message in the DLQ counts")

    # kill -9 of one worker: no leaving heartbeat, so it leaves the farm once its heartbeats are overdue
    killed.kill9()
    rc, doc = await wait_for(lambda: with_workers(1), heartbeat_timeout + 30, "one worker left in the farm")
    assert {k: doc["farm"][k] for k in ("workers", "slots")} == {"workers": 1, "slots": 2}
    assert [w["name"] for w in doc["farm"]["detail"]] == ["media-1"]
    assert doc["services"]["media-2"]["ready"] is False and doc["services"]["media-2"]["reason"].startswith(
        "unreachable")
    assert rc == 1


async def test_status_shows_the_limits_store_local_while_the_counter_store_is_unreachable(
    stack_env: dict[str, str], prepared: CommonSettings, tmp_path: Path
) -> None:
    """On a NATS server of this test's own, the counter stream is deleted: auth's next count finds nothing to
    answer it (ResilientCounters: unavailable) and it decides on local windows; once the stream is back its probe
    finds the store and it counts shared again."""
    (tmp_path / "nats").mkdir()
    with private_bus(stack_env, tmp_path / "nats") as env, run_services(env, tmp_path, names=("auth",)) as auth:
        args = ("--service", f"auth={auth.urls['auth']}", "--stack", str(tmp_path / "no-stack.json"))

        async def limits_mode(mode: str) -> tuple[int, Doc] | None:
            rc, doc = await weir_status(env, *args)
            return (rc, doc) if doc["limits"]["mode"] == mode else None

        rc, doc = await wait_for(lambda: limits_mode("shared"), 30, "the shared counter store")
        assert doc["limits"] == {"mode": "shared", "instances": {"auth": "shared"}}
        assert rc == 0, doc

        nc = await nats.connect(env["WEIR_NATS_URL"])  # the test's own server admits anyone
        try:
            js = nc.jetstream()
            limits = next(s for s in STREAMS if s.name == "LIMITS")
            await js.delete_stream(limits.name)
            # a request counted by client address: auth asks the store, nothing answers
            await check(nc, CheckRequest(peer=fresh_address(), route_class="public", route="GET /v1/videos"),
                        timeout=10)
            rc, doc = await wait_for(lambda: limits_mode("local"), 30, "the limits store in local mode")
            assert doc["services"]["auth"]["ready"] is True  # auth answers; only its counter store does not
            assert doc["unavailable"]["streams.LIMITS"] == "stream not found"
            assert rc == 1

            await apply_streams(js, prepared, (limits,))
            budget_s = AuthSettings(counter_store_timeout_ms=STORE_BUDGET_MS).counter_store_timeout_ms / 1000
            rc, doc = await wait_for(lambda: limits_mode("shared"), 30 + budget_s, "the shared counter store again")
            assert rc == 0, doc
        finally:
            await nc.close()
