"""PostgreSQL stopped mid-flow (fast shutdown: every session cut), down OUTAGE_S, started again on the same data.

Under a `weir up --external` stack with clients creating, uploading and reading: during the outage every request is
answered 503 with Retry-After within the settings' bound (never a 500 or a hang); afterwards the same pids have
reconnected, uploads complete, and each has one upload.completed, one encode inbox row, ready, nothing unsent or
parked. It stops while an output encodes at real time, so encode.progress events meet the outage: an event a
consumer cannot handle then (default NAK delay and attempts) is handled once it is back, not dead-lettered. The outage
outlasts the workers' heartbeat timeout: encode, which could not record their heartbeats, declares none of them dead.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from shared.settings import CommonSettings
from tests.faults.stackhelpers import (
    Load,
    WeirUp,
    all_ready,
    data_root,
    database,
    encoding_outputs,
    everything_ready,
    farm_env,
    own_servers,
    request_bound_s,
    same_processes,
    settled_delivery,
    stack_env,
    weir_up,
)
from tests.integration.test_encode_helpers import make_source
from tests.waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

_BUS = CommonSettings()
# how long PostgreSQL stays down: a few seconds, and longer than a consumer's deliveries last at the product's default
# NAK delay, so that an event taken during the outage must be kept for later, not given up on
OUTAGE_S = max(5.0, _BUS.consumer_nak_delay_seconds * _BUS.consumer_max_deliver + 1.0)
DOWN = "postgres down"
RECOVERY_WITHIN_S = 60.0  # from PostgreSQL's start to every service ready and an upload completed again
SETTLE_WITHIN_S = 45.0  # for what was in flight to land: encodes, events, projections (seconds when all is well)


async def test_services_reconnect_after_a_postgres_restart_and_nothing_is_lost_or_doubled(tmp_path: Path) -> None:
    t_test = time.monotonic()
    source = make_source(tmp_path / "clip.mp4", height=240, seconds=1, fps=10).read_bytes()
    with data_root() as root, own_servers(root) as (dev, servers):
        env = stack_env(**farm_env(consumers=False), **servers, WEIR_MEDIA_READ_RATE="1")
        bound = request_bound_s(env)
        assert OUTAGE_S > float(env["WEIR_MEDIA_HEARTBEAT_TIMEOUT_SECONDS"]), "the outage must outlast the timeout"
        with weir_up(root, env, "--external", "--media", "2", keep_log=tmp_path / "weir-up.log") as up:
            pids = up.pids()
            load = Load(up.api_url, up.secret_key, source, bound, clients=2, pause_s=0.5)
            async with load.running():
                await load.wait_completions(3, 60)
                encoding = await wait_for(lambda: _encoding(up), 60, "an output being encoded")
                completed_before = len(load.completed)
                load.phase = DOWN
                t0 = time.monotonic()
                await asyncio.to_thread(dev.stop_server, "postgres")
                stopped_s = time.monotonic() - t0
                readiness_down = await all_ready(up)
                await asyncio.sleep(OUTAGE_S)  # the outage itself: clients go on meanwhile
                load.phase = "postgres starting"
                t1 = time.monotonic()
                await asyncio.to_thread(dev.start_server, "postgres")
                started_s = time.monotonic() - t1
                load.phase = "postgres back"
                t2 = time.monotonic()
                await load.wait_completions(1, RECOVERY_WITHIN_S)
                first_upload_s = time.monotonic() - t2
                await wait_for(lambda: everything_ready(up), RECOVERY_WITHIN_S, "every service ready again")
                all_ready_s = time.monotonic() - t2
                await load.wait_completions(3, RECOVERY_WITHIN_S)

            print(f"\npostgres stopped (while encoding {encoding}) in {stopped_s:.1f} s, down {OUTAGE_S:g} s, "
                  f"started in {started_s:.1f} s; after its start: an upload completed in {first_upload_s:.1f} s, "
                  f"every service ready in {all_ready_s:.1f} s; readiness while down {readiness_down}")
            print(f"request bound {bound:.2f} s; slowest answer {load.slowest():.2f} s")
            print(f"answers by phase (outcome: count):\n{load.table()}")
            print(f"while down: {dict(sorted(load.outcomes(DOWN).items()))}")
            print(f"{len(load.created)} videos created, {len(load.completed)} uploads completed by clients "
                  f"({completed_before} before the outage)")
            assert not load.unexpected, "\n".join(load.unexpected[:30])
            assert load.slowest() < bound
            down = load.outcomes(DOWN)
            assert sum(n for k, n in down.items() if k.endswith(" 503")) > 0, "the outage was not felt"
            assert not readiness_down.get("api"), "the api says it is ready without its database"
            same_processes(up, pids)
            found, took = await settled_delivery(up, SETTLE_WITHIN_S)
            print(f"settled in {took:.1f} s: {found.summary()}")
            found.check()
            assert set(load.completed) <= found.recorded
            # the workers heartbeated all along: encode, unable to record their heartbeats meanwhile, judged none
            # dead for that silence, and so stopped no encode that was running
            async with database(up) as conn:
                buried = await conn.fetch("SELECT name, last_seen, dead_at FROM encode.workers WHERE dead_at IS NOT"
                                          " NULL")
                returned = await conn.fetchval("SELECT coalesce(sum(returns), 0) FROM encode.outputs")
            assert not buried and returned == 0, f"declared dead: {[dict(r) for r in buried]}, {returned} returned"
            print(f"test took {time.monotonic() - t_test:.1f} s")


async def _encoding(up: WeirUp) -> list[tuple[str, int, str]] | None:
    return await encoding_outputs(up) or None
