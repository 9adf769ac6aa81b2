"""Traces and JSON logs on the whole stack (auth, api, encode, media as processes, tracing to files).

- an upload that encodes is one trace across api, encode and media, as `weir trace` (the real CLI) draws it;
- a replayed upload.completed is handled in a new span that links to the original trace;
- a delivery that fails and is redelivered is handled again in the same trace;
- every line the services write is a JSON object (WEIR_LOG_FORMAT=json), with the trace id inside traced work.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import asyncpg
import pytest

from shared.bus import connect
from shared.settings import CommonSettings
from tests.integration.apihelpers import TRUSTED, Client, create, upload
from tests.integration.authhelpers import TEST_SECRETS, fresh_address, new_app
from tests.integration.test_encode_helpers import (
    Procs,
    clean_encode_state,
    fast_farm,
    make_source,
    prepare_encode_consumers,
    processes,
)
from tests.waiting import wait_for

pytestmark = pytest.mark.asyncio(loop_scope="session")

Node = dict[str, Any]


@pytest.fixture(scope="module")
def traces_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("traces")


@pytest.fixture(scope="module")
def stack_procs(stack_env: dict[str, str], traces_dir: Path,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[Procs]:
    env = {**stack_env, **{f"WEIR_{k.upper()}": v for k, v in TEST_SECRETS.items()}, "WEIR_TRUSTED_PROXIES": TRUSTED,
           "WEIR_TRACES_DIR": str(traces_dir), "WEIR_LOG_FORMAT": "json",
           # spans reach the files within a tenth of a second (the default waits 5 s)
           "OTEL_BSP_SCHEDULE_DELAY": "100"}
    env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
    with processes(env, tmp_path_factory.mktemp("tracing-logs")) as procs:
        yield procs


@pytest.fixture(scope="module")
async def client(stack_procs: Procs, prepared: CommonSettings) -> AsyncIterator[Client]:
    await prepare_encode_consumers(prepared)
    await clean_encode_state(prepared)
    [_, api, _, _] = stack_procs.start("auth", "api", "encode", "media-1", **fast_farm(media_slots=3))
    nc = await connect(prepared, name="test")
    demo = await new_app(nc)
    await nc.close()
    c = Client(SimpleNamespace(api_url=api.url), demo.app.secret_key, fresh_address())  # type: ignore[arg-type]
    yield c
    await c.http.aclose()
    await clean_encode_state(prepared)


def weir(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "weir.cli", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


async def weir_trace(video_id: str, traces_dir: Path) -> dict[str, Any]:
    result = await asyncio.to_thread(weir, "trace", video_id, "--dir", str(traces_dir), "--json")
    assert result.returncode in (0, 1), result.stderr
    document: dict[str, Any] = json.loads(result.stdout)
    return document


def walk(nodes: list[Node], path: tuple[Node, ...] = ()) -> Iterator[tuple[Node, tuple[Node, ...]]]:
    """Each span with its ancestors."""
    for node in nodes:
        yield node, path
        yield from walk(node["children"], (*path, node))


def chain(trace: dict[str, Any], steps: list[tuple[str, str]]) -> list[Node] | None:
    """Spans (service, name prefix) each a descendant of the one before, or None."""

    def find(nodes: list[Node], index: int) -> list[Node] | None:
        service, prefix = steps[index]
        for node, _ in walk(nodes):
            if node["service"] == service and node["name"].startswith(prefix):
                if index == len(steps) - 1:
                    return [node]
                rest = find(node["children"], index + 1)
                if rest is not None:
                    return [node, *rest]
        return None

    return find(trace["spans"], 0)


async def ready(client: Client, video_id: str) -> dict[str, Any] | None:
    r = await client.call("GET", f"/v1/videos/{video_id}")
    assert r.status_code == 200, r.text
    v: dict[str, Any] = r.json()
    return v if v["status"] == "ready" else None


JOURNEY = [
    ("api", "POST /v1/videos/{video_id}/upload/complete"),
    ("api", "outbox relay upload.completed"),
    ("encode", "upload.completed process"),
    ("encode", "encode dispatch round"),
    ("media", "media job"),
    ("encode", "outbox relay encode.completed"),
]


async def test_an_encoded_upload_is_one_trace_across_api_encode_and_media(
    client: Client, traces_dir: Path, tmp_path: Path
) -> None:
    source = make_source(tmp_path / "clip.mp4", height=360, seconds=1, fps=10)
    created = await create(client)
    video_id = created["id"]
    assert (await upload(client, video_id, source.read_bytes())).status_code == 200
    await wait_for(lambda: ready(client, video_id), 60, "the video to be ready")

    async def journey() -> tuple[dict[str, Any], list[Node]] | None:
        document = await weir_trace(video_id, traces_dir)
        for trace in document["traces"]:
            found = chain(trace, JOURNEY)
            if found is not None:
                return trace, found
        return None

    trace, steps = await wait_for(journey, 30, "the upload's journey in `weir trace`", interval=0.3)
    assert {"api", "encode", "media"} <= set(trace["services"])
    starts = [step["offset_ms"] for step in steps]
    assert starts == sorted(starts), "each step begins after the one before"
    assert all(step["attributes"].get("weir.video_id") == video_id for step in steps)
    job = steps[4]
    assert job["attributes"]["weir.outcome"] == "completed" and job["duration_ms"] > 0
    # the heartbeat a freed slot sends at once is no part of the job's trace (periodic subjects are not recorded)
    every = [node["name"] for node, _ in walk(trace["spans"])]
    assert not [name for name in every if name.startswith("farm.heartbeat")], every
    # the create request is a trace of its own, drawn before the upload's
    document = await weir_trace(video_id, traces_dir)
    names = [root["name"] for t in document["traces"] for root in t["spans"]]
    assert names.index("POST /v1/videos") < names.index(JOURNEY[0][1])
    # and the terminal drawing of it
    drawn = await asyncio.to_thread(weir, "trace", video_id, "--dir", str(traces_dir))
    assert drawn.returncode == 0, drawn.stderr
    text = drawn.stdout
    positions = [text.index(name) for _, name in JOURNEY]
    assert positions == sorted(positions), text


async def test_a_replayed_upload_completed_links_to_its_original_trace(
    client: Client, traces_dir: Path, tmp_path: Path, stack_env: dict[str, str]
) -> None:
    source = make_source(tmp_path / "replayed.mp4", height=240, seconds=1, fps=10)
    created = await create(client, name="replayed")
    video_id = created["id"]
    since = (datetime.now(UTC) - timedelta(seconds=1)).isoformat()
    assert (await upload(client, video_id, source.read_bytes())).status_code == 200
    until = (datetime.now(UTC) + timedelta(seconds=1)).isoformat()

    async def original() -> dict[str, Any] | None:
        for trace in (await weir_trace(video_id, traces_dir))["traces"]:
            if chain(trace, JOURNEY[:3]) is not None:
                return trace
        return None

    first = await wait_for(original, 30, "the upload's handling in its trace", interval=0.3)
    # the CLI's replay: the slice is this test's upload.completed, to encode's consumer
    result = await asyncio.to_thread(weir, "replay", "--stream", "VIDEOS", "--subject", "upload.completed",
                                     "--since", since, "--until", until, "--to", "encode_uploads", env=stack_env)
    assert result.returncode == 0, result.stdout + result.stderr

    async def replayed() -> Node | None:
        for trace in (await weir_trace(video_id, traces_dir))["traces"]:
            for node, _ in walk(trace["spans"]):
                if node["name"] == "upload.completed process" and node["attributes"].get("weir.replayed"):
                    return node
        return None

    handled = await wait_for(replayed, 30, "the replayed event's span", interval=0.3)
    assert handled["service"] == "encode" and handled["attributes"]["weir.video_id"] == video_id
    assert [link["trace_id"] for link in handled["links"]] == [first["trace_id"]]
    assert "weir.replayed_from" in handled["links"][0]["attributes"]


async def test_a_redelivered_event_is_handled_again_in_the_same_trace(
    client: Client, traces_dir: Path, tmp_path: Path, prepared: CommonSettings
) -> None:
    """encode's first handling of the upload.completed fails (a trigger refuses its row once); the redelivery
    succeeds, and both handlings are spans of the upload's trace."""
    created = await create(client, name="redelivered")
    video_id = created["id"]
    conn = await asyncpg.connect(prepared.database_url)
    name = f"trace_fail_once_{uuid.uuid4().hex[:8]}"
    try:
        await conn.execute(f"CREATE SEQUENCE encode.{name}")
        await conn.execute(f"""
            CREATE FUNCTION encode.{name}() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                -- nextval is not rolled back with the failed transaction: only the first try fails
                IF NEW.video_id = '{video_id}' AND nextval('encode.{name}') = 1 THEN
                    RAISE EXCEPTION 'planned failure of the first delivery';
                END IF;
                RETURN NEW;
            END $$""")
        await conn.execute(f"CREATE TRIGGER {name} BEFORE INSERT ON encode.videos FOR EACH ROW "
                           f"EXECUTE FUNCTION encode.{name}()")
        source = make_source(tmp_path / "redelivered.mp4", height=240, seconds=1, fps=10)
        assert (await upload(client, video_id, source.read_bytes())).status_code == 200

        async def handlings() -> list[tuple[Node, str]] | None:
            found = [(node, trace["trace_id"])
                     for trace in (await weir_trace(video_id, traces_dir))["traces"]
                     for node, _ in walk(trace["spans"])
                     if node["name"] == "upload.completed process" and node["service"] == "encode"]
            return found if len(found) >= 2 else None

        found = await wait_for(handlings, 30, "two handlings of the upload.completed", interval=0.3)
    finally:
        await conn.execute(f"DROP TRIGGER IF EXISTS {name} ON encode.videos")
        await conn.execute(f"DROP FUNCTION IF EXISTS encode.{name}()")
        await conn.execute(f"DROP SEQUENCE IF EXISTS encode.{name}")
        await conn.close()
    by_delivery = {node["attributes"]["weir.deliveries"]: (node, trace_id) for node, trace_id in found}
    (failed, failed_trace), (retried, retried_trace) = by_delivery[1], by_delivery[2]
    assert failed["status"] == "error" and "planned failure" in failed["status_message"]
    assert failed["attributes"]["weir.outcome"] == "retry"
    assert retried["status"] != "error" and retried["attributes"]["weir.outcome"] == "handled"
    assert failed_trace == retried_trace
    assert failed["attributes"]["weir.event_id"] == retried["attributes"]["weir.event_id"]


async def test_json_logs_name_the_service_level_and_trace(client: Client, stack_procs: Procs) -> None:
    """Every line each service wrote is one JSON object; lines logged inside traced work carry its trace id."""
    traced: dict[str, int] = {}
    for proc in stack_procs.procs:
        service = proc.name.split("-")[0]
        for number, line in enumerate(proc.log.read_text().splitlines(), 1):
            entry = json.loads(line)  # fails the test on any line that is not JSON
            assert isinstance(entry, dict), f"{proc.log}:{number}"
            assert entry["service"] == service and entry["level"] in {"DEBUG", "INFO", "WARNING", "ERROR",
                                                                      "CRITICAL"}, entry
            assert entry["message"] and entry["time"].endswith("Z")
            if "trace_id" in entry:
                assert len(entry["trace_id"]) == 32 and len(entry["span_id"]) == 16
                traced[service] = traced.get(service, 0) + 1
    # media's "accepted ..." and encode's "... accepted by ..." are logged inside the offer and the round
    assert traced.get("media") and traced.get("encode"), traced
    # the failed delivery's warning names its event
    warnings = [json.loads(line) for p in stack_procs.procs if p.name == "encode"
                for line in p.log.read_text().splitlines() if "delivery 1 of" in line]
    assert warnings and all("event_id" in w and "trace_id" in w for w in warnings), warnings
