"""`weir rollout` on a running `weir up` (SPEC 11, rollouts lose no request), through the real command.

The api rolled out under a steady stream of guarded requests (kept-alive clients and clients that open a connection
per request): every answer 2xx, no connection error. auth, encode, media and sweep rolled out in turn while uploads
flow and encode: uploads keep completing, the sweep answers, and afterwards nothing is lost or doubled. A new
instance that never gets ready is stopped and the old one serves on, the stream seeing nothing of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from shared.devstack.ports import free_port
from shared.devstack.processes import pid_alive
from tests.faults.stackhelpers import (
    Load,
    WeirUp,
    data_root,
    farm_env,
    request_bound_s,
    settled_delivery,
    stack_env,
    sweep_run,
    weir_up,
)
from tests.integration.test_encode_helpers import make_source
from tests.waiting import wait_for
from weir.cpucap import CGROUP_ROOT, CpuCap, CpuCapUnavailable

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

KEPT_ALIVE_CLIENTS = 4  # each on one kept-alive connection, moved by the draining instance's Connection: close
PER_REQUEST_CLIENTS = 2  # each request on a new connection: the shared port hands them to whichever listens
# the cap on a start's CPU is the api test's; here a looser one keeps the five starts of the suite short
QUICKER_STARTS = {"WEIR_ROLLOUT_START_CPU_SHARE": "0.5"}
# the last one of them starts at the tightest cap, lifted after a second whether or not it got to its gate
CAP_LIFTED_AFTER = {"WEIR_ROLLOUT_START_CPU_SHARE": "0.1", "WEIR_ROLLOUT_START_CAP_SECONDS": "1"}
NOT_READY_TIMEOUT_S = 5.0  # `--ready-timeout` of the rollout whose new instance never gets ready
ANSWERS_AFTER = 50  # answers the stream must get after a rollout (it goes on through the new instance)
ROLLED_IN_TURN = ("auth", "encode", "media", "sweep", "webhooks")


@dataclass
class Stream:
    """Guarded requests back to back (a list read, then a create) from a few clients, each answer recorded with the
    phase it was sent in."""

    api_url: str
    secret_key: str
    bound_s: float
    phase: str = "steady"
    outcomes: dict[str, Counter[str]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    def count(self, phase: str | None = None) -> int:
        return sum(sum(c.values()) for p, c in self.outcomes.items() if phase is None or p == phase)

    async def client(self, stop: asyncio.Event, *, keep_alive: bool) -> None:
        limits = httpx.Limits(max_keepalive_connections=1 if keep_alive else 0)
        async with httpx.AsyncClient(base_url=self.api_url, timeout=self.bound_s, limits=limits,
                                     headers={"Authorization": f"Bearer {self.secret_key}"}) as http:
            while not stop.is_set():
                for method, path, body in (("GET", "/v1/videos?limit=5", None),
                                           ("POST", "/v1/videos", {"name": "rollout stream"})):
                    phase = self.phase
                    try:
                        r = await http.request(method, path, json=body)
                        outcome = str(r.status_code)
                        if not 200 <= r.status_code < 300:
                            self.failures.append(f"{method} {path} ({phase}): {r.status_code} {r.text[:200]}")
                    except httpx.TransportError as exc:
                        outcome = type(exc).__name__
                        self.failures.append(f"{method} {path} ({phase}): {exc!r}")
                    self.outcomes.setdefault(phase, Counter())[outcome] += 1

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[Stream]:
        stop = asyncio.Event()
        tasks = [asyncio.create_task(self.client(stop, keep_alive=i < KEPT_ALIVE_CLIENTS))
                 for i in range(KEPT_ALIVE_CLIENTS + PER_REQUEST_CLIENTS)]
        try:
            await wait_for(lambda: self.count() >= ANSWERS_AFTER, 30, "the stream under way")
            yield self
        finally:
            stop.set()
            await asyncio.gather(*tasks)

    async def answers_after(self, phase: str) -> None:
        self.phase = phase
        await wait_for(lambda: self.count(phase) >= ANSWERS_AFTER, 30, f"{ANSWERS_AFTER} answers {phase}")


@dataclass(frozen=True)
class Rollout:
    code: int
    output: str
    seconds: float

    def new_pids(self) -> list[int]:
        return [int(p) for p in re.findall(r"started pid (\d+)", self.output)]


async def weir_rollout(up: WeirUp, *args: str, env: dict[str, str] | None = None) -> Rollout:
    """The command as an operator runs it, beside the test's `weir up` (`env` on top of this environment)."""
    t0 = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "weir.cli", "rollout", *args, "--data-dir", str(up.data_dir),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env={**os.environ, **(env or {})})
    out, _ = await proc.communicate()
    assert proc.returncode is not None
    return Rollout(proc.returncode, out.decode(errors="replace"), time.monotonic() - t0)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[WeirUp, dict[str, str]]]:
    env = stack_env(**farm_env())
    log = tmp_path_factory.mktemp("rollout") / "weir-up.log"
    with data_root() as root, weir_up(root, env, "--media", "2", keep_log=log) as up:
        yield up, env


async def test_the_api_rolled_out_under_a_steady_stream_loses_no_request(stack: tuple[WeirUp, dict[str, str]]
                                                                        ) -> None:
    up, env = stack
    before = up.pids()["api"]
    stream = Stream(up.api_url, up.secret_key, request_bound_s(env))
    async with stream.running():
        stream.phase = "rollout"
        rollout = await weir_rollout(up, "api")
        await stream.answers_after("after")
    print(f"\n{rollout.output}answers by phase: {stream.outcomes}")
    assert rollout.code == 0, rollout.output
    assert "rolled out api" in rollout.output
    assert up.pids()["api"] == rollout.new_pids()[0] != before
    assert not pid_alive(before)
    assert stream.count("rollout") > 0, "the stream went on during the rollout"
    assert not stream.failures, "\n".join(stream.failures[:20])
    assert not up.log_lines("starting it again"), up.log_tail()
    # its start ran CPU-capped where root may make the cgroup, and the cap came off at the gate, before it took work
    if cpu_cap_possible():
        assert "its CPU capped at" in rollout.output, rollout.output
        assert "its CPU no longer capped, it takes work" in rollout.output, rollout.output
    assert not list(CGROUP_ROOT.glob("**/weir-start-*")), "the start's cgroup was left behind"


def cpu_cap_possible() -> bool:
    if os.geteuid() != 0:
        return False
    try:
        CpuCap.create(f"weir-test-probe-{os.getpid()}", 0.5).remove()
    except CpuCapUnavailable:
        return False
    return True


async def test_auth_encode_media_sweep_and_webhooks_rolled_out_in_turn_keep_the_flow(
        stack: tuple[WeirUp, dict[str, str]], tmp_path: Path) -> None:
    up, env = stack
    source = make_source(tmp_path / "clip.mp4", height=240, seconds=1, fps=10).read_bytes()
    before = up.pids()
    load = Load(up.api_url, up.secret_key, source, request_bound_s(env))
    took: dict[str, float] = {}
    async with load.running():
        await load.wait_completions(2, 60)
        for service in ROLLED_IN_TURN:
            load.phase = f"rollout {service}"
            last = service == ROLLED_IN_TURN[-1]
            rollout = await weir_rollout(up, service, env=CAP_LIFTED_AFTER if last else QUICKER_STARTS)
            assert rollout.code == 0, rollout.output
            if last and cpu_cap_possible():
                assert "not at its gate after 1 s (WEIR_ROLLOUT_START_CAP_SECONDS): its CPU no longer capped" \
                    in rollout.output, rollout.output
            took[service] = rollout.seconds
            load.phase = f"after {service}"
            await load.wait_completions(1, 60)  # uploads still go through and encode
        run = await sweep_run(up, force=True, timeout=60)
        assert run.report is not None and run.report["outcome"] == "completed", run.report
    print(f"\nrollouts took {took}\nanswers by phase:\n{load.table()}")
    after = up.pids()
    for name in before:
        rolled = name != "weir" and name != "api"
        assert (after[name] != before[name]) == rolled, (name, before[name], after[name])
        if rolled:
            assert not pid_alive(before[name]), name
    assert not load.unexpected, "\n".join(load.unexpected[:20])
    outcomes = Counter(a.outcome for a in load.answers)
    assert set(outcomes) <= {"200", "201"}, outcomes
    found, settled_s = await settled_delivery(up, 120)
    print(f"settled in {settled_s:.1f} s: {found.summary()}")
    found.check()
    assert set(load.completed) <= found.recorded
    assert not up.log_lines("starting it again"), up.log_tail()


async def test_a_new_instance_that_never_gets_ready_is_stopped_and_the_old_serves_on(
        stack: tuple[WeirUp, dict[str, str]]) -> None:
    up, env = stack
    before = up.pids()["api"]
    stream = Stream(up.api_url, up.secret_key, request_bound_s(env))
    nowhere = f"http://127.0.0.1:{free_port()}"  # storage the new instance never reaches: its /readyz says 503
    async with stream.running():
        stream.phase = "rollout"
        rollout = await weir_rollout(up, "api", "--ready-timeout", str(NOT_READY_TIMEOUT_S),
                                     "--env", f"WEIR_S3_ENDPOINT={nowhere}")
        await stream.answers_after("after")
    print(f"\n{rollout.output}answers by phase: {stream.outcomes}")
    assert rollout.code == 1, rollout.output
    assert f"was not ready after {NOT_READY_TIMEOUT_S:g} s" in rollout.output
    assert f"the old one (pid {before}) keeps serving" in rollout.output
    assert rollout.seconds >= NOT_READY_TIMEOUT_S
    [new] = rollout.new_pids()
    assert not pid_alive(new), "the new instance was stopped"
    assert up.pids()["api"] == before and pid_alive(before)
    assert stream.count("rollout") > 0
    assert not stream.failures, "\n".join(stream.failures[:20])
    # one that dies at its start: the rollout says why, from what it printed last
    died = await weir_rollout(up, "api", "--env", "WEIR_DB_POOL_MAX=many", env={"COLUMNS": "1000"})
    assert died.code == 1 and "exited with 1 before it was ready" in died.output, died.output
    assert "Its last words:" in died.output and "db_pool_max" in died.output, died.output
    assert up.pids()["api"] == before and pid_alive(before)


async def test_a_service_the_stack_does_not_run_is_named_and_nothing_is_touched(
        stack: tuple[WeirUp, dict[str, str]]) -> None:
    up, _ = stack
    before = up.pids()
    rollout = await weir_rollout(up, "nosuch")
    assert rollout.code == 1, rollout.output
    assert "no service 'nosuch' in this stack (it runs api, auth, encode, media, sweep, webhooks)" in rollout.output
    assert up.pids() == before
