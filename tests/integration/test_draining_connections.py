"""A draining instance closes its kept-alive connections spread over WEIR_HTTP_CLOSE_SPREAD_SECONDS, each after an
answer (Connection: close), so that its clients reconnect to the instance beside a few at a time; through real HTTP
on uvicorn, as shared/runtime.py serves."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time

import httpx
import pytest
import uvicorn
from starlette.types import Receive, Scope, Send

from shared.runtime import ClosingWhenDraining
from shared.settings import CommonSettings

CLIENTS = 24  # kept-alive connections; with delays drawn evenly, all of them within a quarter is ~(1/4)^24
SPREAD_S = 2.0  # WEIR_HTTP_CLOSE_SPREAD_SECONDS set (its default, 0, is the second case)
ANSWER_EVERY_S = 0.02  # each client's pace
SLACK_S = 1.0  # scheduling on a loaded machine


async def _ok(scope: Scope, receive: Receive, send: Send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"ok"})


async def _closed_after(http: httpx.AsyncClient, since: float, stop_at: float) -> float | None:
    """Seconds from `since` until an answer said Connection: close (None: none did before `stop_at`)."""
    while time.monotonic() < stop_at:
        r = await http.get("/")
        assert r.status_code == 200
        if r.headers.get("connection") == "close":
            return time.monotonic() - since
        await asyncio.sleep(ANSWER_EVERY_S)
    return None


@pytest.mark.parametrize("spread_s", [SPREAD_S, CommonSettings.model_fields["http_close_spread_seconds"].default])
async def test_a_draining_instance_closes_its_connections_spread_over_the_setting(spread_s: float) -> None:
    assert SPREAD_S > 0 and SPREAD_S < CommonSettings.model_fields["http_drain_seconds"].default
    app = ClosingWhenDraining(_ok, spread_s)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            await asyncio.sleep(0.01)
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        async with contextlib.AsyncExitStack() as clients:
            https = [await clients.enter_async_context(
                httpx.AsyncClient(base_url=url, limits=httpx.Limits(max_keepalive_connections=1)))
                for _ in range(CLIENTS)]
            for http in https:  # every client on its connection, answered without a close
                assert "connection" not in (await http.get("/")).headers
            app.drain()
            since = time.monotonic()
            closed = await asyncio.gather(*(_closed_after(http, since, since + spread_s + SLACK_S) for http in https))
    finally:
        server.should_exit = True
        await task
    after = [c for c in closed if c is not None]
    assert len(after) == CLIENTS, "every connection is closed within the spread"
    if spread_s:
        assert max(after) > spread_s / 4 and min(after) < spread_s * 3 / 4, "not all at once"
        assert max(after) < spread_s + SLACK_S
    else:
        assert max(after) < SLACK_S, "each closed at its next answer"
