"""`weir dlq list|show|redrive|purge` as an operator runs them: a subprocess connecting as the `operator` identity
(the session's nats-server enforces its rights) against real JetStream and PostgreSQL, on what a real consumer
parked."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import asyncpg
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import api

from shared.bus import HDR_CONSUMER, HDR_DELIVERIES, HDR_ERROR, HDR_MSG_ID
from shared.events import Event, VideoCreated, dlq_subject
from shared.settings import CommonSettings
from tests.integration.bushelpers import (
    SETTLE_S,
    consuming,
    create_effects,
    effect_counts,
    record_effect,
    spec,
    unique,
    video_created,
)

SECRET = "wsk_" + "A1b2C3d4E5f6G7h8J9k0" * 2  # shaped like a secret key: `show` may print its 12-character prefix only
# redrive's wait in these tests: long enough that a run ending in half of it ended on its copies' fate, not the clock
WAIT_S = SETTLE_S


def run(env: dict[str, str], *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "weir.cli", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env, "COLUMNS": "250"}, input=stdin or "")


async def cli(env: dict[str, str], *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(run, env, *args, stdin=stdin)


def listed(result: subprocess.CompletedProcess[str], consumer: str) -> dict[str, dict[str, Any]]:
    assert result.returncode == 0, result.stdout + result.stderr
    return {e["event_id"]: e for e in json.loads(result.stdout) if e["consumer"] == consumer}


async def test_parked_events_are_listed_shown_redacted_redriven_and_removed(
    schema_pool: tuple[str, asyncpg.Pool], nc: NATS, prepared: CommonSettings, stack_env: dict[str, str],
) -> None:
    schema, pool = schema_pool
    await create_effects(pool)
    settings = prepared.model_copy(update={"consumer_nak_delay_seconds": 0.05, "consumer_max_deliver": 2})
    js = nc.jetstream()
    broken = {"yes"}

    async def fails_until_fixed(conn: asyncpg.Connection, ev: Event[VideoCreated]) -> None:
        if broken:
            raise RuntimeError(f"storage refused Authorization: Bearer {SECRET} (key {SECRET}) for {ev.subject}")
        await record_effect(conn, ev)

    name = unique("dlq")
    inbox = ("--inbox-schema", f"{name}={schema}")
    events = [video_created() for _ in range(3)]
    watch = await js.pull_subscribe(dlq_subject("video.created"), stream="DLQ", config=api.ConsumerConfig(
        deliver_policy=api.DeliverPolicy.NEW, ack_policy=api.AckPolicy.NONE))
    async with consuming(settings, pool, spec(name, fails_until_fixed), from_now=True):
        for ev in events:
            await js.publish("video.created", ev.to_bytes(), headers={HDR_MSG_ID: ev.id})
        parked: list[Msg] = []
        while len([m for m in parked if (m.headers or {}).get(HDR_CONSUMER) == name]) < len(events):
            parked += await watch.fetch(10, timeout=SETTLE_S)
        await watch.unsubscribe()

        # one of them was handled meanwhile (a replay, say): the inbox says so, and the list shows it handled
        replayed = events[2]
        async with pool.acquire() as conn:
            await conn.execute("INSERT INTO inbox (consumer, event_id, event_type) VALUES ($1, $2, $3)",
                               name, replayed.id, replayed.type)
        found = listed(await cli(stack_env, "dlq", "list", "--type", "video.created", "--json", *inbox), name)
        assert set(found) == {e.id for e in events}
        assert {i: e["state"] for i, e in found.items()} == {
            events[0].id: "parked", events[1].id: "parked", replayed.id: "handled"}
        assert {e["deliveries"] for e in found.values()} == {settings.consumer_max_deliver}
        assert all(SECRET not in e["reason"] and "storage refused" in e["reason"] for e in found.values())

        # show: headers, the whole reason, the body; the secret down to its prefix, the Bearer value masked
        first = found[events[0].id]
        shown = await cli(stack_env, "dlq", "show", str(first["id"]), *inbox)
        assert shown.returncode == 0, shown.stdout + shown.stderr
        assert "Traceback" not in shown.stderr and "Task exception" not in shown.stderr, shown.stderr
        assert SECRET not in shown.stdout and f"(key {SECRET[:12]}…)" in shown.stdout
        assert "Bearer ***" in shown.stdout and f"{HDR_ERROR}:" in shown.stdout
        assert f"{HDR_CONSUMER}: {name}" in shown.stdout
        assert events[0].id in shown.stdout and events[0].subject in shown.stdout  # the body, as JSON
        missing = await cli(stack_env, "dlq", "show", str(10**12))
        assert missing.returncode == 1 and "no parked message" in missing.stdout

        dry = await cli(stack_env, "dlq", "redrive", "--to", name, "--dry-run", *inbox)
        assert dry.returncode == 0, dry.stdout + dry.stderr
        assert f"would re-drive 2 (2 to {name}); 1 handled already" in dry.stdout
        assert set((await effect_counts(pool, [e.id for e in events])).values()) == {0}  # nothing was sent

        broken.clear()  # the fix is deployed: the re-driven events are handled
        redriven = await cli(stack_env, "dlq", "redrive", "--to", name, *inbox)
        assert redriven.returncode == 0, redriven.stdout + redriven.stderr
        assert "handled and removed 3" in redriven.stdout and "still parked 0" in redriven.stdout
        assert await effect_counts(pool, [events[0].id, events[1].id]) == {events[0].id: 1, events[1].id: 1}
        after = listed(await cli(stack_env, "dlq", "list", "--json", *inbox), name)
        assert after == {}  # what was handled is gone from the DLQ


async def test_purge_asks_first_and_removes_only_the_type_given(
    nc: NATS, prepared: CommonSettings, stack_env: dict[str, str],
) -> None:
    js = nc.jetstream()
    kind, other = f"test.t{uuid.uuid4().hex[:8]}", f"test.t{uuid.uuid4().hex[:8]}"
    for event_type in (kind, kind, other):
        await js.publish(dlq_subject(event_type), b"{}", stream="DLQ",
                         headers={HDR_MSG_ID: uuid.uuid4().hex, HDR_CONSUMER: "nobody", HDR_ERROR: "test"})

    refused = await cli(stack_env, "dlq", "purge", "--type", kind, stdin="n\n")
    assert refused.returncode == 1 and "purge 2 parked messages" in refused.stdout, refused.stdout + refused.stderr
    assert len(json.loads((await cli(stack_env, "dlq", "list", "--type", kind, "--json")).stdout)) == 2

    purged = await cli(stack_env, "dlq", "purge", "--type", kind, stdin="y\n")
    assert purged.returncode == 0 and f"purged 2 parked messages of {kind}" in purged.stdout, purged.stdout
    assert json.loads((await cli(stack_env, "dlq", "list", "--type", kind, "--json")).stdout) == []
    assert len(json.loads((await cli(stack_env, "dlq", "list", "--type", other, "--json")).stdout)) == 1
    await js.purge_stream("DLQ", subject=dlq_subject(other))


def one_line(result: subprocess.CompletedProcess[str]) -> str:
    """The command's output, which must be one line and no traceback."""
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.stdout + result.stderr, result.stdout + result.stderr
    return lines[0]


async def test_a_redrive_that_fails_again_leaves_one_entry_per_event_and_ends_when_it_is_parked(
    schema_pool: tuple[str, asyncpg.Pool], nc: NATS, prepared: CommonSettings, stack_env: dict[str, str],
) -> None:
    schema, pool = schema_pool
    settings = prepared.model_copy(update={"consumer_nak_delay_seconds": 0.05, "consumer_max_deliver": 2})
    js = nc.jetstream()

    async def still_broken(conn: asyncpg.Connection, ev: Event[VideoCreated]) -> None:
        raise RuntimeError(f"still broken for {ev.subject}")

    name = unique("dlq")
    inbox = ("--inbox-schema", f"{name}={schema}")
    env = {**stack_env, "WEIR_DLQ_REDRIVE_WAIT_SECONDS": str(WAIT_S)}
    event = video_created()
    async with consuming(settings, pool, spec(name, still_broken), from_now=True):
        # the event parked twice long ago (before the DLQ's duplicate window, so under ids of their own): what
        # redrives that doubled the DLQ left behind
        for _ in range(2):
            await js.publish(dlq_subject(event.type), event.to_bytes(), stream="DLQ", headers={
                HDR_MSG_ID: uuid.uuid4().hex, HDR_CONSUMER: name, HDR_ERROR: "RuntimeError: broken",
                HDR_DELIVERIES: str(settings.consumer_max_deliver)})
        before = listed(await cli(env, "dlq", "list", "--json", *inbox), name)
        assert len(before) == 1  # keyed by event id: both entries are of this one event

        for attempt in range(2):  # the first copy's park is a new entry; the second's falls in the duplicate window
            started = time.monotonic()
            redriven = await cli(env, "dlq", "redrive", "--to", name, *inbox)
            took = time.monotonic() - started
            assert redriven.returncode == 1, redriven.stdout + redriven.stderr
            assert ("re-driven 1 " in redriven.stdout and "handled and removed 0" in redriven.stdout
                    and "parked again 1" in redriven.stdout and "still parked 1" in redriven.stdout), redriven.stdout
            assert took < WAIT_S / 2, f"attempt {attempt}: {took:.1f} s, as if it waited out the clock"
            entries = [e for e in json.loads((await cli(env, "dlq", "list", "--json", *inbox)).stdout)
                       if e["consumer"] == name]
            assert [(e["event_id"], e["state"]) for e in entries] == [(event.id, "parked")], entries

        # the entry left is the consumer's own park of the copy, and `show` of it is clean
        shown = await cli(env, "dlq", "show", str(entries[0]["id"]), *inbox)
        assert shown.returncode == 0 and "still broken" in shown.stdout, shown.stdout + shown.stderr
        assert "Traceback" not in shown.stderr and "Task exception" not in shown.stderr, shown.stderr
    await js.delete_msg("DLQ", entries[0]["id"])


async def test_bad_ids_types_and_consumers_are_refused_in_one_line(
    prepared: CommonSettings, stack_env: dict[str, str],
) -> None:
    for bad_id in ("0", "-1"):
        shown = await cli(stack_env, "dlq", "show", "--", bad_id)
        assert shown.returncode != 0 and "Traceback" not in shown.stdout + shown.stderr, shown.stdout + shown.stderr
        assert "greater than or equal to 1" in shown.stdout + shown.stderr
    for command in (("list", "--type", "a b"), ("purge", "--type", "up load", "--yes")):
        refused = await cli(stack_env, "dlq", *command)
        assert refused.returncode != 0 and "Traceback" not in refused.stdout + refused.stderr, refused.stderr
        assert "is no event type" in refused.stdout + refused.stderr

    nobody = await cli(stack_env, "dlq", "redrive", "--to", "nobody")
    assert nobody.returncode == 1
    line = one_line(nobody)
    assert "no consumer 'nobody'" in line and "known:" in line and "api_status" in line


async def test_with_no_nats_a_dlq_command_says_so_at_once(tmp_path: Path) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"nats://127.0.0.1:{s.getsockname()[1]}"
    started = time.monotonic()
    result = await cli({"WEIR_NATS_URL": url, "WEIR_STACK": str(tmp_path / "stack.json")}, "dlq", "list")
    assert result.returncode == 1
    assert f"NATS does not answer at {url}" in one_line(result)
    assert time.monotonic() - started < SETTLE_S
