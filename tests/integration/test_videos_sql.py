"""`shared/videos.py` against real PostgreSQL: the sweep's candidate predicate selects exactly the rows the pure rule
names, and the CHECKs the migrations leave in force hold exactly the vocabulary."""

from __future__ import annotations

import itertools
import re
import uuid
from datetime import UTC, datetime, timedelta

import pytest

from services.api.playback import PlaybackPolicy
from services.sweep.domain import Outcome, Trigger
from shared.settings import CommonSettings
from shared.videos import (
    SWEEP_CANDIDATE_SQL,
    ImportState,
    JobClass,
    OutputState,
    ProcessingState,
    VideoStatus,
    is_sweep_candidate,
)
from tests.conftest import fresh_schema

pytestmark = pytest.mark.asyncio(loop_scope="session")
TICK = timedelta(microseconds=1)  # timestamptz's resolution: the cutoff's edge on both sides


async def test_the_candidate_predicate_selects_what_the_rule_names(prepared: CommonSettings) -> None:
    cutoff = datetime.now(UTC) - timedelta(days=1)
    async with fresh_schema(prepared.database_url, "api") as (_, pool):
        imports = (None, *ImportState)
        for status, recorded, age, state in itertools.product(VideoStatus, (False, True),
                                                              (-TICK, timedelta(0), TICK), imports):
            await pool.execute(
                "INSERT INTO videos (id, app_id, account_id, key_id, name, object_key, status, created_at,"
                " file_recorded_at, import_state) VALUES ($1, $2, $2, $2, 'rule', 'k', $3, $4, $5, $6)",
                str(uuid.uuid4()), str(uuid.uuid4()), status.value, cutoff + age, cutoff if recorded else None,
                state,
            )
        rows = await pool.fetch("SELECT id::text, status, file_recorded_at, created_at, import_state FROM videos")
        selected = {r["id"] for r in await pool.fetch(f"SELECT id::text FROM videos WHERE {SWEEP_CANDIDATE_SQL}",
                                                      cutoff)}
    named = {r["id"] for r in rows
             if is_sweep_candidate(r["status"], r["file_recorded_at"], r["created_at"], cutoff=cutoff,
                                   import_state=r["import_state"])}
    assert len(rows) == len(VideoStatus) * 2 * 3 * len(imports)
    assert selected == named
    assert 0 < len(named) < len(rows)  # some rows are candidates and some are not: the comparison can fail


CHECK = re.compile(r"CHECK \(\(?(\w+) = ANY \(ARRAY\[(.*)\]\)\)")


async def test_the_checks_in_force_are_the_vocabulary(prepared: CommonSettings) -> None:
    expected = {
        ("api", "videos", "status"): set(VideoStatus),
        ("api", "videos", "playback_policy"): set(PlaybackPolicy),
        ("api", "videos", "import_state"): set(ImportState),
        ("encode", "videos", "state"): set(ProcessingState),
        ("encode", "videos", "job_class"): set(JobClass),
        ("encode", "outputs", "state"): set(OutputState),
        ("sweep", "runs", "trigger"): set(Trigger),
        ("sweep", "runs", "outcome"): set(Outcome),
    }
    found: dict[tuple[str, str, str], set[str]] = {}
    for service in ("api", "encode", "media", "sweep"):
        async with fresh_schema(prepared.database_url, service, max_size=1) as (schema, pool):
            rows = await pool.fetch(
                "SELECT c.conrelid::regclass::text AS qualified, pg_get_constraintdef(c.oid) AS definition"
                " FROM pg_constraint c JOIN pg_namespace n ON n.oid = c.connamespace"
                " WHERE n.nspname = $1 AND c.contype = 'c'", schema)
        for row in rows:
            m = CHECK.search(row["definition"])
            assert m is not None, row["definition"]
            table = row["qualified"].rsplit(".", 1)[-1]
            found[(service, table, m.group(1))] = set(re.findall(r"'([^']*)'::text", m.group(2)))
    assert found == expected
