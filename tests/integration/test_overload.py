"""Shedding (SPEC 15) through HTTP, on real processes: the api refuses at once, by priority, what it cannot start
in time; auth, slowed for real (a CPU quota), sheds its queue and the api answers those requests 503 `overloaded`
at once instead of after auth's timeout.

The api's limit is held still (initial = min = max) so that what each priority may have in flight follows from the
settings and shared/overload/domain.py alone; auth is stopped (SIGSTOP, by pid) so that admitted requests stay in
flight for as long as the test needs."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import nats
import pytest

from shared.bus import connect
from shared.overload import domain
from shared.settings import CommonSettings, ShedSettings
from tests.integration.apihelpers import (
    UNLIMITED,
    Client,
    Services,
    create,
    private_bus,
    readable_from_any_page,
    run_services,
)
from tests.integration.authhelpers import TEST_SECRETS, fresh_address, new_app
from tests.waiting import wait_for

pytestmark = pytest.mark.asyncio(loop_scope="session")
LIMIT = 10  # the api's concurrency limit, held still
STEP = 0.1  # each priority's own ceiling (the default is one ceiling below the reserve): the order shows in refusals
SHED = {"shed_policy": "gradient", "shed_priority_step": str(STEP),
        "shed_initial_limit": str(LIMIT), "shed_min_limit": str(LIMIT), "shed_max_limit": str(LIMIT),
        # a stopped auth's checks wait, never time out, within a test; and resumed, auth decides them all rather
        # than shed what waited (that is the last test's)
        "auth_timeout_ms": "60000", "shed_sender_clock": "false"}
DEFAULTS = ShedSettings()
SHARES = domain.ceilings(DEFAULTS.shed_reserve_share, STEP)


def admitted(priority: domain.Priority, limit: float = LIMIT) -> int:
    """How many requests in flight a priority may start alongside: the first n that its ceiling refuses."""
    n = 0
    while domain.admits(SHARES[priority], n, limit):
        n += 1
    return n


@pytest.fixture(scope="module")
def services(stack_env: dict[str, str], prepared: CommonSettings, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[Services]:
    with run_services(stack_env, tmp_path_factory.mktemp("logs"), **UNLIMITED, **SHED) as s:
        yield s


@pytest.fixture
async def client(services: Services, prepared: CommonSettings) -> AsyncIterator[Client]:
    nc = await connect(prepared, name="test")
    demo = await new_app(nc)
    await nc.close()
    c = Client(services, demo.app.secret_key, fresh_address())
    yield c
    await c.http.aclose()


async def gauge(services: Services, name: str) -> float:
    async with httpx.AsyncClient() as http:
        text = (await http.get(f"{services.urls['api']}/metrics")).text
    for line in text.splitlines():
        if line.startswith(f"weir_{name}{{") or line.startswith(f"weir_{name} "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def counter(url: str, name: str, **labels: str) -> float:
    async with httpx.AsyncClient() as http:
        text = (await http.get(f"{url}/metrics")).text
    wanted = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(f"weir_{name}{{") and all(w in line for w in wanted))


def assert_overloaded(r: httpx.Response) -> None:
    assert r.status_code == 503, r.text
    assert r.json()["code"] == "overloaded", r.text
    assert int(r.headers["retry-after"]) >= 1


async def test_priorities_shed_through_http(services: Services, client: Client) -> None:
    """Reads fill their ceiling and the next read is refused at once; writes still start up to theirs, then are
    refused; internal-token requests start while the top share is free; once auth answers, every admitted request
    gets its real answer."""
    video = await create(client)
    auth = services.procs[0]
    internal = {"X-Weir-Internal-Token": TEST_SECRETS["internal_token"]}
    reads, writes = admitted("read"), admitted("write")
    assert 0 < reads < writes < admitted("internal") == LIMIT
    os.kill(auth.pid, signal.SIGSTOP)
    try:
        held = [asyncio.create_task(client.call("GET", f"/v1/videos/{video['id']}")) for _ in range(reads)]
        await wait_for(lambda: gauge(services, "shed_in_flight"), 10, "requests in flight", until=lambda v: v == reads)
        started = time.monotonic()
        r = await client.call("GET", f"/v1/videos/{video['id']}")
        refused_in = time.monotonic() - started
        assert_overloaded(r)
        assert refused_in < 5, f"a refusal took {refused_in:.2f} s: it must not wait for auth"
        held += [asyncio.create_task(client.call("POST", "/v1/videos", json={"name": "held"}))
                 for _ in range(writes - reads)]
        await wait_for(lambda: gauge(services, "shed_in_flight"), 10, "requests in flight", until=lambda v: v == writes)
        assert_overloaded(await client.call("POST", "/v1/videos", json={"name": "refused"}))
        refused_read = await client.call("GET", f"/v1/videos/{video['id']}")
        assert_overloaded(refused_read)
        assert "access-control-allow-origin" not in refused_read.headers  # a secret-key route: no page reads it
        # a player's route and an SDK route: their refusals are readable from any page (status and Retry-After)
        for method, path in (("GET", f"/v1/videos/{video['id']}/storyboard.vtt"), ("POST", "/sdk/v1/videos")):
            r = await client.call(method, path, None, headers={"Origin": "https://player.example"})
            assert_overloaded(r)
            assert readable_from_any_page(r), (path, dict(r.headers))
        # the top share is free: Weir's own traffic starts (a forged token would not: it counts as a read)
        forged = await client.call("GET", f"/internal/v1/videos/{video['id']}", None,
                                   headers={"X-Weir-Internal-Token": "forged"})
        assert_overloaded(forged)
        held.append(asyncio.create_task(client.call("GET", f"/internal/v1/videos/{video['id']}", None,
                                                    headers=internal)))
        await wait_for(lambda: gauge(services, "shed_in_flight"), 10, "requests in flight",
                       until=lambda v: v == writes + 1)
    finally:
        os.kill(auth.pid, signal.SIGCONT)
    answers = await asyncio.gather(*held)
    assert [r.status_code for r in answers] == [200] * reads + [201] * (writes - reads) + [200], \
        [r.text for r in answers]
    api = services.urls["api"]
    assert await counter(api, "shed_total", priority="read") >= 3
    assert await counter(api, "shed_total", priority="write") >= 1
    assert await counter(api, "shed_total", priority="internal") == 0


async def test_a_burst_waits_instead_of_being_refused(services: Services, client: Client) -> None:
    """Twice the limit of reads at once on an idle api: a burst passing, not a standing queue, so the ones over
    the ceiling wait for a slot and every read is answered 200."""
    video = await create(client)
    answers = await asyncio.gather(*(client.call("GET", f"/v1/videos/{video['id']}") for _ in range(2 * LIMIT)))
    assert [r.status_code for r in answers] == [200] * (2 * LIMIT), [r.text for r in answers if r.status_code != 200]


async def test_auth_sheds_what_waited_and_the_api_says_overloaded(stack_env: dict[str, str],
                                                                  prepared: CommonSettings, tmp_path: Path) -> None:
    """auth paused (SIGSTOP) for a few of its windows while requests come: the checks wait in the server and the
    sockets, where auth's own queue never shows them. Resumed, auth counts their wait from the api's send time
    (Weir-Sent-At) and answers every one that waited past its queue's timeout `overloaded` at once, internal-token
    ones excepted; the api answers those requests 503 `overloaded` (never `unavailable`) and, once auth has caught
    up, the next request is answered. The api's own limit is out of the way (high and still)."""
    high, reads, internals = "100000", 20, 3
    burst_ms = 100.0  # the queue's allowance, short (the default 1 s would hold the test 3 s)
    window = burst_ms / 1000
    # a bus of its own: the module's auth, in the same queue group on the session's, would answer for the paused one
    with private_bus(stack_env, tmp_path / "nats") as env, run_services(
            env, tmp_path, **UNLIMITED, shed_policy="gradient", shed_initial_limit=high, shed_min_limit=high,
            shed_max_limit=high, shed_burst_ms=str(burst_ms), auth_timeout_ms="30000") as services:
        nc = await nats.connect(env["WEIR_NATS_URL"])  # the private server has no identities
        demo = await new_app(nc)
        await nc.close()
        c = Client(services, demo.app.secret_key, fresh_address())
        try:
            video = await create(c)
            internal = {"X-Weir-Internal-Token": TEST_SECRETS["internal_token"]}
            auth = services.procs[0]
            os.kill(auth.pid, signal.SIGSTOP)
            try:
                calls = [asyncio.create_task(c.call("GET", f"/v1/videos/{video['id']}")) for _ in range(reads)]
                calls += [asyncio.create_task(c.call("GET", f"/internal/v1/videos/{video['id']}", None,
                                                     headers=internal)) for _ in range(internals)]
                await wait_for(lambda: gauge(services, "shed_in_flight"), 10, "requests in flight",
                               until=lambda v: v == reads + internals)
                await asyncio.sleep(3 * window)  # they wait longer than auth's queue allows
            finally:
                os.kill(auth.pid, signal.SIGCONT)
            answers = await asyncio.gather(*calls)
            for r in answers[:reads]:
                assert_overloaded(r)
            assert [r.status_code for r in answers[reads:]] == [200] * internals, [r.text for r in answers[reads:]]
            assert await counter(services.urls["auth"], "shed_total", priority="read") == reads
            assert await counter(services.urls["auth"], "shed_total", priority="internal") == 0
            assert await counter(services.urls["api"], "auth_overloaded_total") == reads
            r = await c.call("GET", f"/v1/videos/{video['id']}")
            assert r.status_code == 200, r.text
        finally:
            await c.http.aclose()
