"""The sweep service: the on-demand trigger over NATS and `weir sweep run|history`, and the daily run that two
instances run once between them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
from collections.abc import AsyncIterator, Sequence
from datetime import UTC, date, datetime, timedelta

import asyncpg
import httpx
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from services.sweep import store
from services.sweep.app import SERVICE, parts, sweeper
from services.sweep.cli import ANSWER_SECONDS
from services.sweep.domain import Outcome, RunReport, Tally, Trigger
from services.sweep.sweep import ReadStage
from services.sweep.trigger import RUN_SUBJECT, UPDATES_PATTERN, RunAccepted, report_to_json
from shared.devstack.ports import free_port
from shared.messaging import error_in
from shared.runtime import Runtime, build_http, started
from shared.settings import CommonSettings
from tests.integration.test_encode_helpers import asyncapi_channels, asyncapi_replies
from tests.integration.test_sweep_support import (
    insert_video,
    open_upload,
    quiet_table,
    retired_events,
    sweep_settings,
    video_row,
)

pytestmark = pytest.mark.asyncio(loop_scope="session")
DAY_OLD = timedelta(seconds=sweep_settings(CommonSettings()).sweep_min_age_seconds, hours=1)


@pytest.fixture
async def service(prepared: CommonSettings) -> AsyncIterator[Runtime]:
    async with started(SERVICE, sweep_settings(prepared, sweep_valve_min_candidates=4)) as rt:
        _, _, pool = rt.require()
        await quiet_table(pool)
        yield rt


async def sweep_cli(stack_env: dict[str, str], *args: str, **env: str) -> tuple[int, str]:
    """`weir sweep ...` as a process (not blocking this test's event loop, where the service runs)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "services.sweep.cli", *args,
        env={**os.environ, **stack_env, "COLUMNS": "200", **env},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode is not None
    return proc.returncode, out.decode()


async def test_weir_sweep_run_asks_the_service_and_prints_a_summary(
    service: Runtime, stack_env: dict[str, str], prepared: CommonSettings
) -> None:
    _, _, pool = service.require()
    gone, _ = await insert_video(pool, age=DAY_OLD)
    kept, key = await insert_video(pool, age=DAY_OLD, status="uploading")
    await open_upload(prepared, key)

    code, out = await sweep_cli(stack_env, "run", "--dry-run")
    assert code == 0, out
    assert "dry run" in out and "would retire" in out and "no sweep service answers" not in out
    assert (await video_row(pool, gone))["status"] == "created"

    code, out = await sweep_cli(stack_env, "run")
    assert code == 0, out
    assert "never_uploaded" in out and "upload_open" in out and "completed" in out
    assert (await video_row(pool, gone))["status"] == "retired"
    assert (await video_row(pool, kept))["status"] == "uploading"
    assert len(await retired_events(prepared, gone)) == 1  # published by the service's relay
    assert service.metrics.value("sweep_retired_total", reason="never_uploaded") == 1

    code, out = await sweep_cli(stack_env, "history", "--limit", "2")
    assert code == 0, out
    assert "on_demand (dry run)" in out and "never_uploaded 1" in out and "upload_open 1" in out


async def test_the_valve_and_force_from_the_cli(service: Runtime, stack_env: dict[str, str]) -> None:
    _, _, pool = service.require()
    vids = [(await insert_video(pool, age=DAY_OLD))[0] for _ in range(4)]
    code, out = await sweep_cli(stack_env, "run")
    assert code == 3, out  # stopped by the safety valve
    assert "stopped" in out and "--force" in out
    assert {(await video_row(pool, v))["status"] for v in vids} == {"created"}
    code, out = await sweep_cli(stack_env, "run", "--force")
    assert code == 0, out
    assert {(await video_row(pool, v))["status"] for v in vids} == {"retired"}


async def test_a_second_run_is_refused_while_one_runs(service: Runtime, stack_env: dict[str, str]) -> None:
    _, _, pool = service.require()
    await insert_video(pool, age=DAY_OLD)
    release = asyncio.Event()

    async def hold(stage: ReadStage, ids: Sequence[str]) -> None:
        await release.wait()

    sweeper(service).hook = hold
    try:
        first = asyncio.create_task(sweep_cli(stack_env, "run"))
        while not await pool.fetchval("SELECT count(*) FROM sweep.runs WHERE outcome = 'running'"):
            await asyncio.sleep(0.02)
        code, out = await sweep_cli(stack_env, "run")
        assert code == 4 and "in progress" in out, out
        release.set()
        code, out = await first
        assert code == 0, out
    finally:
        release.set()
        sweeper(service).hook = None


async def test_without_a_service_the_cli_runs_the_sweep_itself(
    prepared: CommonSettings, stack_env: dict[str, str]
) -> None:
    async with started(SERVICE, sweep_settings(prepared)) as rt:  # only for its pool; stopped before the CLI runs
        _, _, pool = rt.require()
        await quiet_table(pool)
        vid, _ = await insert_video(pool, age=DAY_OLD)
    code, out = await sweep_cli(stack_env, "run")
    assert code == 0, out
    assert "no sweep service answers: running here" in out and "never_uploaded" in out
    assert len(await retired_events(prepared, vid)) == 1, out  # the CLI published what it wrote to the outbox


async def test_without_nats_the_cli_runs_the_sweep_and_its_events_wait_in_the_outbox(
    prepared: CommonSettings, stack_env: dict[str, str]
) -> None:
    async with started(SERVICE, sweep_settings(prepared)) as rt:  # only for its pool; stopped before the CLI runs
        _, _, pool = rt.require()
        await quiet_table(pool)
        vid, _ = await insert_video(pool, age=DAY_OLD)
    nowhere = f"nats://127.0.0.1:{free_port()}"  # a port nothing listens on
    t0 = time.monotonic()
    code, out = await sweep_cli(stack_env, "run", WEIR_NATS_URL=nowhere)
    assert code == 0, out
    assert "NATS unreachable" in out and "running here" in out and "wait in the" in out and "never_uploaded" in out
    assert time.monotonic() - t0 < 30, "both connects give up within seconds"
    conn = await asyncpg.connect(prepared.database_url)
    try:
        waiting = await conn.fetchval(
            "SELECT count(*) FROM sweep.outbox WHERE sent_at IS NULL AND subject = 'video.retired'"
            " AND convert_from(payload, 'UTF8')::jsonb -> 'data' ->> 'video_id' = $1", vid)
    finally:
        await conn.close()
    assert waiting == 1  # the sweep service's relay sends it once it runs


async def test_two_instances_run_the_days_sweep_once(prepared: CommonSettings) -> None:
    settings = sweep_settings(prepared, sweep_daily_enabled=True, sweep_daily_at="00:00",
                              sweep_daily_retry_seconds=0.05)
    today = datetime.now(UTC).date()
    async with contextlib.AsyncExitStack() as stack:
        holder = await asyncpg.connect(prepared.database_url)
        stack.push_async_callback(holder.close)
        # a run in progress elsewhere: both instances find the day due and wait for the run lock together
        assert await holder.fetchval(f"SELECT pg_try_advisory_lock({store.RUN_LOCK})")
        a = await stack.enter_async_context(started(SERVICE, settings))
        b = await stack.enter_async_context(started(SERVICE, settings))
        _, _, pool = a.require()
        await quiet_table(pool)
        before = await daily_runs(pool, today)  # none, unless these servers already ran today's sweep
        await holder.execute(f"SELECT pg_advisory_unlock({store.RUN_LOCK})")
        deadline = asyncio.get_running_loop().time() + 60
        while not all(parts(rt).daily_checked == today for rt in (a, b)):
            assert asyncio.get_running_loop().time() < deadline, "the daily loops did not settle"
            await asyncio.sleep(0.05)
        assert await daily_runs(pool, today) == (before or ["completed"])


async def daily_runs(pool: asyncpg.Pool, day: date) -> list[str]:
    rows = await pool.fetch("SELECT outcome FROM sweep.runs WHERE trigger = 'daily' AND daily_for = $1", day)
    return [r["outcome"] for r in rows]


async def test_the_run_subject_is_documented_and_refuses_a_request_that_does_not_validate(
    service: Runtime, nc: NATS
) -> None:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_http(service)), base_url="http://sweep") as c:
        doc = (await c.get("/asyncapi.json")).raise_for_status().json()
    assert asyncapi_channels(doc) >= {(RUN_SUBJECT, "receive", "RunRequest"), (UPDATES_PATTERN, "send", "RunUpdate")}
    assert asyncapi_replies(doc) == {RUN_SUBJECT: {"RunAccepted", "ErrorReply"}}
    assert {c["address"]: c["bindings"]["nats"].get("queue") for c in doc["channels"].values()}[RUN_SUBJECT] == "sweep"
    _, _, pool = service.require()
    runs = await pool.fetchval("SELECT count(*) FROM sweep.runs")
    for body in (b'{"updates": "sweep.elsewhere"}', b'{"dry_run": true}', b'{"updates": "_INBOX.x", "force": "maybe"}'):
        reply = await nc.request(RUN_SUBJECT, body, timeout=ANSWER_SECONDS)  # silence would end in a timeout here
        refused = error_in(reply.data)  # what `weir sweep run` reads as a refusal (it prints the detail)
        assert refused is not None and (refused.error.status, refused.error.code) == (400, "validation_error"), \
            reply.data
    assert await pool.fetchval("SELECT count(*) FROM sweep.runs") == runs  # no run started
    inbox = nc.new_inbox()
    # a good request runs as before, with a field a newer caller adds ignored
    body = f'{{"dry_run": true, "updates": "{inbox}", "priority": "high"}}'.encode()
    reply = await nc.request(RUN_SUBJECT, body, timeout=ANSWER_SECONDS)
    assert RunAccepted.model_validate_json(reply.data).accepted


# ---------------------------------------------------------- `weir sweep run` against a newer (or broken) service


@contextlib.asynccontextmanager
async def answering(nc: NATS, answer: bytes, *updates: bytes) -> AsyncIterator[None]:
    """A sweep service of another release on `sweep.run`: it answers `answer`, then sends `updates` to the inbox
    the request named."""

    async def on_run(msg: Msg) -> None:
        await msg.respond(answer)
        for update in updates:
            await nc.publish(json.loads(msg.data)["updates"], update)

    sub = await nc.subscribe(RUN_SUBJECT, queue="sweep", cb=on_run)
    try:
        yield
    finally:
        await sub.unsubscribe()


def _report(**changes: object) -> dict[str, object]:
    now = datetime.now(UTC)
    report = RunReport(id="r1", trigger=Trigger.ON_DEMAND, dry_run=False, force=False, started_at=now,
                       daily_for=None, outcome=Outcome.COMPLETED, finished_at=now, duration_seconds=0.5,
                       tally=Tally(examined=3))
    return {**report_to_json(report), **changes}


async def test_the_cli_reads_a_newer_services_answers(prepared: CommonSettings, stack_env: dict[str, str],
                                                     nc: NATS) -> None:
    """Unknown fields are ignored, an update of an unknown kind is progress, an unknown outcome reads as failed."""
    accepted = b'{"accepted": true, "run_id": "r1", "queue_position": 0}'
    odd_update = b'{"kind": "estimate", "phase": "survey", "done": 1, "eta_seconds": 3}'
    report = json.dumps({"kind": "report", "report": _report(outcome="paused", trigger="weekly", shards=2),
                         "signed": "x"}).encode()
    async with answering(nc, accepted, odd_update, report):
        code, out = await sweep_cli(stack_env, "run")
    assert code == 1, out  # an outcome this version cannot judge is not taken for success
    assert "failed" in out and "'paused', which this version does not know" in out and "Traceback" not in out


@pytest.mark.parametrize(("answer", "updates"), [
    (b'{"accepted": "perhaps"}', ()),
    (b'{"accepted": true, "run_id": "r1"}', (b'{"kind": "report", "report": {"id": "r1"}}',)),
    (b'{"accepted": true, "run_id": "r1"}', (b'{"kind": 7}',)),
], ids=["answer", "report", "update"])
async def test_an_unreadable_answer_is_one_error_line_not_a_crash(
    prepared: CommonSettings, stack_env: dict[str, str], nc: NATS, answer: bytes, updates: tuple[bytes, ...]
) -> None:
    async with answering(nc, answer, *updates):
        code, out = await sweep_cli(stack_env, "run")
    assert code == 1, out
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1 and f"{RUN_SUBJECT}: the sweep service sent" in lines[0], out
    assert "cannot read" in out and "Traceback" not in out
