"""The shedder's queue (shared/overload/edge.py) on an in-process ASGI app whose requests finish when the test says:
the slot a finished request frees goes to the highest priority waiting; a burst waits, a standing queue is refused
at once; the refusal is a 503 `overloaded` problem with Retry-After."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from shared.metrics import Metrics
from shared.overload import domain
from shared.overload.edge import ShedConfig, Shedder, shed_config
from shared.settings import ShedSettings

pytestmark = pytest.mark.asyncio(loop_scope="function")
LIMIT = 10
STEP = 0.1  # each priority its own ceiling (the default is one below the reserve): 8, 7 and 6 of 10
TOKEN = "internal-secret"


def still(policy: domain.Policy = "gradient", window_ms: float = 100.0) -> ShedConfig:
    return shed_config(ShedSettings(shed_policy=policy, shed_initial_limit=LIMIT, shed_min_limit=LIMIT,
                                    shed_max_limit=LIMIT, shed_window_ms=window_ms, shed_burst_ms=window_ms,
                                    shed_priority_step=STEP))


class App:
    """Each request waits for its release; the order they started in is kept."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.release: dict[str, asyncio.Event] = {}

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        name = scope["path"]
        self.started.append(name)
        event = self.release.setdefault(name, asyncio.Event())
        await event.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})


async def call(shedder: Shedder, path: str, method: str = "GET", token: str | None = None
               ) -> tuple[int, dict[str, str], bytes]:
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    headers = [(b"x-weir-internal-token", token.encode())] if token else []
    await shedder({"type": "http", "method": method, "path": path, "headers": headers}, receive, send)
    start = sent[0]
    return start["status"], {k.decode(): v.decode() for k, v in start["headers"]}, sent[1]["body"]


def admitted(priority: domain.Priority) -> int:
    shares = domain.ceilings(ShedSettings().shed_reserve_share, STEP)
    return next(n for n in range(100) if not domain.admits(shares[priority], n, LIMIT))


def classify(method: str, path: str) -> domain.Priority | None:
    return "completion" if path.endswith("/complete") else None


def make(app: App, config: ShedConfig | None = None) -> Shedder:
    return Shedder(app, config=config or still(), classify=classify, internal_token=TOKEN,  # type: ignore[arg-type]
                   metrics=Metrics("api"))


async def until(check: Any) -> None:
    for _ in range(200):
        if check():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("condition never held")


async def test_a_freed_slot_goes_to_the_highest_priority_waiting() -> None:
    app = App()
    shedder = make(app)
    reads = admitted("read")
    assert admitted("write") == reads + 1, "the test needs exactly one write's room above the reads' ceiling"
    held = [asyncio.create_task(call(shedder, f"/r{i}")) for i in range(reads)]
    await until(lambda: len(app.started) == reads)
    waiting_read = asyncio.create_task(call(shedder, "/late-read"))
    waiting_write = asyncio.create_task(call(shedder, "/late-write", "POST"))
    await until(lambda: shedder.n_waiting == 1)  # the write starts: its ceiling is higher than the reads'
    assert app.started[-1] == "/late-write"
    app.release["/r0"].set()  # a read's slot, but the write took one: reads still stand at their ceiling
    await asyncio.sleep(0.01)
    assert "/late-read" not in app.started
    app.release["/r1"].set()
    await until(lambda: "/late-read" in app.started)
    for name in app.started:
        app.release.setdefault(name, asyncio.Event()).set()
    results = await asyncio.gather(*held, waiting_read, waiting_write)
    assert [status for status, _, _ in results] == [200] * (reads + 2)


async def test_a_standing_queue_is_refused_at_once_and_the_top_priority_still_starts() -> None:
    app = App()
    window_ms = 50.0
    shedder = make(app, still(window_ms=window_ms))
    writes = admitted("write")
    held = [asyncio.create_task(call(shedder, f"/w{i}", "POST")) for i in range(writes)]
    await until(lambda: len(app.started) == writes)
    waiters = [asyncio.create_task(call(shedder, f"/q{i}")) for i in range(3)]
    await asyncio.sleep(2 * window_ms / 1000)  # the queue stood for longer than a window: its waiters refused
    loop = asyncio.get_running_loop()
    started = loop.time()
    status, headers, body = await call(shedder, "/refused")
    assert loop.time() - started < window_ms / 1000
    assert status == 503 and json.loads(body)["code"] == "overloaded"
    assert int(headers["retry-after"]) >= 1
    for w in waiters:  # those waiting past the target were refused too
        assert (await w)[0] == 503
    internal = asyncio.create_task(call(shedder, "/internal", token=TOKEN))
    await until(lambda: "/internal" in app.started)
    forged = await call(shedder, "/forged", token="forged")
    assert forged[0] == 503
    for name in app.started:
        app.release.setdefault(name, asyncio.Event()).set()
    assert [r[0] for r in await asyncio.gather(*held, internal)] == [200] * (len(held) + 1)
    assert shedder.shed["read"] >= 4 and shedder.shed["internal"] == 0
    # each refusal timed, by how: the waiters after their wait, the rest at once
    queued = shedder.metrics.value("shed_refusal_seconds", how="queued")
    at_once = shedder.metrics.value("shed_refusal_seconds", how="at_once")
    assert queued == len(waiters) and at_once >= 2  # "/refused" and the forged token's
    assert queued + at_once == sum(shedder.shed.values())


async def test_off_admits_everything() -> None:
    app = App()
    shedder = make(app, still(policy="off"))
    calls = [asyncio.create_task(call(shedder, f"/x{i}")) for i in range(4 * LIMIT)]
    await until(lambda: len(app.started) == 4 * LIMIT)
    for name in app.started:
        app.release[name].set()
    assert {r[0] for r in await asyncio.gather(*calls)} == {200}
