"""`weir replay --dry-run` says, per consumer, how many events of the slice it handled already (its inbox) and how
many it would apply; run as the operator identity against real JetStream and PostgreSQL."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import asyncpg
from nats.aio.client import Client as NATS

from shared.bus import HDR_MSG_ID
from tests.integration.bushelpers import replayable_reader, video_created
from tests.integration.test_dlq_cli import cli


async def test_the_dry_run_counts_what_each_consumer_handled_and_would_apply(
    schema_pool: tuple[str, asyncpg.Pool], nc: NATS, stack_env: dict[str, str],
) -> None:
    schema, pool = schema_pool
    js = nc.jetstream()
    async with replayable_reader(js, "VIDEOS", "video.created", "counts") as durable:
        since = datetime.now(UTC).isoformat()
        events = [video_created() for _ in range(5)]
        for ev in events:
            await js.publish(ev.type, ev.to_bytes(), headers={HDR_MSG_ID: ev.id})
        handled = events[:2]  # its inbox records two of them (and one event of another slice)
        async with pool.acquire() as conn:
            await conn.executemany("INSERT INTO inbox (consumer, event_id, event_type) VALUES ($1, $2, $3)",
                                   [(durable, e.id, e.type) for e in handled]
                                   + [(durable, str(uuid.uuid4()), "video.created")])
        args = ("replay", "--stream", "VIDEOS", "--subject", "video.created", "--since", since, "--to", durable,
                "--dry-run", "--inbox-schema", f"{durable}={schema}")
        result = await cli(stack_env, *args)
        assert result.returncode == 0, result.stdout + result.stderr
        assert f"{len(events)} events of video.created on VIDEOS" in result.stdout
        assert (f"{durable}: {len(handled)} handled already, would apply {len(events) - len(handled)}"
                in result.stdout), result.stdout
        again = await cli(stack_env, *args, "--reprocess")  # reprocess applies every one again
        assert f"would apply {len(events)}" in again.stdout, again.stdout
        unknown = await cli(stack_env, *args[:-2])  # a consumer no contract declares, and no schema named
        assert f"{durable}: inbox not readable, handled unknown" in unknown.stdout, unknown.stdout
