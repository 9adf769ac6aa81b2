"""`weir dlq list|show|redrive|purge` as an operator runs them: a subprocess connecting as the `operator` identity
(the session's nats-server enforces its rights) against real JetStream and PostgreSQL, on what a real consumer
parked."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from typing import Any

import asyncpg
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import api

from shared.bus import HDR_CONSUMER, HDR_ERROR, HDR_MSG_ID
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
    kind, other = f"test.{uuid.uuid4().hex[:8]}", f"test.{uuid.uuid4().hex[:8]}"
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
