"""kill -9 each service of a `weir up` stack under load, one after the other: api and auth (during a storm of
creates), encode and a media worker (while encoding), the sweep (mid-run).

Each comes back on the same address; every request gets its success status or 503 within the settings' bound, never
a 500 (connection errors while the api is down are counted apart). Afterwards nothing is lost or doubled: one
upload.completed and one encode inbox row per upload, every video ready, no outbox row unsent, nothing parked; the
killed sweep run is marked interrupted and the next one retires the rest, each with exactly one video.retired.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from services.sweep.settings import SweepSettings
from tests.faults.stackhelpers import (
    Load,
    Restart,
    WeirUp,
    data_root,
    database,
    encoding_outputs,
    env_of,
    farm_env,
    kill9_and_wait_restart,
    request_bound_s,
    settled_delivery,
    stack_env,
    stream_events,
    sweep_run,
    weir_up,
)
from tests.integration.test_encode_helpers import make_source
from tests.waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

BACKOFF_MS = 100  # WEIR_SUPERVISE_BACKOFF_MS: a killed service is started again after this long
# the sweep's run is made slow enough to be killed in its middle: one storage call and one batch of a few rows at a
# time, over enough candidates for many batches (each batch is one transaction: retired rows and their events)
SWEEP = {"sweep_storage_concurrency": 1, "sweep_batch_concurrency": 1, "sweep_batch_size": 3}
CANDIDATES = 60
STORM_CLIENTS = 16  # creates in flight at the moment the api or auth is killed, besides the load
STORM_LEAD_S = 1.0  # the storm is well under way when the kill comes
KILLED_IN_TURN = ("api", "auth", "encode", "media-1", "sweep")


async def make_candidates(up: WeirUp, n: int) -> list[str]:
    """`n` videos created through the API that never get a file, made older than the sweep's minimum age (the
    sweep's own tests age rows the same way): candidates the sweep retires (never_uploaded)."""
    made: list[str] = []
    sem = asyncio.Semaphore(8)
    async with httpx.AsyncClient(base_url=up.api_url, timeout=30,
                                 headers={"Authorization": f"Bearer {up.secret_key}"}) as http:
        async def one(i: int) -> None:
            async with sem:
                r = await http.post("/v1/videos", json={"name": f"never uploaded {i}"})
                assert r.status_code == 201, r.text
                made.append(r.json()["id"])

        await asyncio.gather(*(one(i) for i in range(n)))
    older = SweepSettings().sweep_min_age_seconds + 3600
    async with database(up) as conn:
        await conn.execute("UPDATE videos.videos SET created_at = created_at - make_interval(secs => $2)"
                           " WHERE id = ANY($1::uuid[])", made, float(older))
    return made


async def retired_among(up: WeirUp, ids: list[str]) -> int:
    async with database(up) as conn:
        n: int = await conn.fetchval("SELECT count(*) FROM videos.videos WHERE id = ANY($1::uuid[])"
                                     " AND status = 'retired'", ids)
    return n


async def run_outcome(up: WeirUp, run_id: str) -> str:
    async with database(up) as conn:
        outcome: str = await conn.fetchval("SELECT outcome FROM sweep.runs WHERE id = $1::uuid", run_id)
    return outcome


async def test_each_service_killed_under_load_comes_back_and_nothing_is_lost_or_doubled(tmp_path: Path) -> None:
    t_test = time.monotonic()
    source = make_source(tmp_path / "clip.mp4", height=240, seconds=1, fps=10).read_bytes()
    env = stack_env(**farm_env(), **env_of(SWEEP), WEIR_SUPERVISE_BACKOFF_MS=str(BACKOFF_MS))
    bound = request_bound_s(env)
    restarts: list[Restart] = []
    notes: list[str] = []
    with data_root() as root, weir_up(root, env, "--media", "2", keep_log=tmp_path / "weir-up.log") as up:
        started_s = time.monotonic() - t_test
        candidates = await make_candidates(up, CANDIDATES)
        load = Load(up.api_url, up.secret_key, source, bound, transport_ok_phases=frozenset({"kill api"}))
        async with load.running():
            await load.wait_completions(3, 60)

            for service in ("api", "auth"):
                load.phase = f"kill {service}"
                restarts.append(await killed_in_a_storm(up, load, service))
                t0 = time.monotonic()
                await load.wait_completions(1, 60)  # uploads go through again
                notes.append(f"{service}: an upload completed {time.monotonic() - t0:.1f} s after it was ready")
                load.phase = "steady"

            # encode and a worker are killed while an output is out on the farm
            for service, worker in (("encode", None), ("media-1", "media-1")):
                out = await wait_for(functools.partial(_encoding, up, worker), 60,
                                     f"an output being encoded{' on ' + worker if worker else ''}")
                notes.append(f"{service}: killed while encoding {out}")
                load.phase = f"kill {service}"
                restarts.append(await kill9_and_wait_restart(up, service, backoff_ms=BACKOFF_MS))
                await load.wait_completions(1, 60)
                load.phase = "steady"

            # the sweep, in the middle of a run that retires the candidates in many small batches
            run = await sweep_run(up, force=True, timeout=30, wait_report=False)
            assert run.accepted.run_id is not None
            t_run = time.monotonic()
            await wait_for(lambda: _some_retired(up, candidates), 30, "the sweep run to retire its first batch")
            load.phase = "kill sweep"
            restarts.append(await kill9_and_wait_restart(up, "sweep", backoff_ms=BACKOFF_MS))
            load.phase = "steady"
            at_kill = await retired_among(up, candidates)
            assert 0 < at_kill < len(candidates), f"the run was not killed in its middle ({at_kill} retired)"
            assert await run_outcome(up, run.accepted.run_id) == "running", "the killed run's ledger row"
            notes.append(f"sweep: killed {time.monotonic() - t_run:.2f} s into its run, {at_kill} of "
                         f"{len(candidates)} candidates retired by then")
            again = await sweep_run(up, force=True, timeout=60)
            assert again.report is not None
            assert await run_outcome(up, run.accepted.run_id) == "interrupted"
            assert again.report["outcome"] == "completed", again.report
            assert again.report["retired"] == {"never_uploaded": len(candidates) - at_kill}, again.report
            await load.wait_completions(2, 60)

        # --- afterwards: what every client saw
        print(f"\nstack ready in {started_s:.1f} s; request bound {bound:.2f} s; slowest answer "
              f"{load.slowest():.2f} s")
        for r in restarts:
            print(f"  {r.service:<8} pid {r.old_pid} -> {r.new_pid}: restarted in {r.restarted_s:.2f} s, ready in "
                  f"{r.ready_s:.2f} s; answers {dict(sorted(load.outcomes(f'kill {r.service}').items()))}")
        for note in notes:
            print(f"  {note}")
        print(f"answers by phase (outcome: count):\n{load.table()}")
        print(f"storage PUTs {dict(load.storage_puts)}; {len(load.created)} videos created, "
              f"{len(load.completed)} uploads completed by clients")
        assert not load.unexpected, "\n".join(load.unexpected[:30])
        assert load.slowest() < bound
        statuses = Counter(a.outcome for a in load.answers if not a.transport_error)
        assert set(statuses) <= {"200", "201", "503"}, statuses
        errors = Counter(a.outcome for a in load.answers if a.transport_error)
        assert set(errors) <= {"ConnectError", "ReadError", "RemoteProtocolError"}, errors  # the api's kill only
        for service in KILLED_IN_TURN:
            assert up.log_lines(f"{service} exited with -9; starting it again in"), up.log_tail()
            assert up.log_lines(f"{service} started again (pid"), up.log_tail()

        # --- afterwards: the streams and the tables
        found, took = await settled_delivery(up, 120)
        print(f"settled in {took:.1f} s: {found.summary()}")
        found.check()
        assert set(load.completed) <= found.recorded
        retired = Counter(str(e.data["video_id"]) for _, e in await stream_events(up, "VIDEOS", "video.retired.*"))
        assert retired == Counter({vid: 1 for vid in candidates}), "one video.retired per candidate, once"
        async with database(up) as conn:
            statuses = Counter(r["status"] for r in await conn.fetch(
                "SELECT status FROM videos.videos WHERE id = ANY($1::uuid[])", candidates))
            processing = await conn.fetch("SELECT video_id, height, returns, attempt FROM encode.outputs"
                                          " WHERE returns > 0")
        assert statuses == Counter({"retired": len(candidates)})
        print(f"outputs handed back from a dead worker and encoded again: {[dict(r) for r in processing]}")
        print(f"test took {time.monotonic() - t_test:.1f} s")


async def killed_in_a_storm(up: WeirUp, load: Load, service: str) -> Restart:
    """kill -9 the service while a storm of creates goes on besides the load (each create asks auth twice: auth.check
    in the guard, then a token mint after its insert), and wait for `weir up` to start it again."""
    stop = asyncio.Event()
    storm = asyncio.create_task(load.storm(stop, STORM_CLIENTS))
    await asyncio.sleep(STORM_LEAD_S)
    try:
        return await kill9_and_wait_restart(up, service, backoff_ms=BACKOFF_MS)
    finally:
        stop.set()
        await storm


async def _encoding(up: WeirUp, worker: str | None) -> list[tuple[str, int, str]] | None:
    return await encoding_outputs(up, worker) or None


async def _some_retired(up: WeirUp, ids: list[str]) -> int | None:
    n = await retired_among(up, ids)
    return n if n > 0 else None
