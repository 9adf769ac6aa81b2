"""An idle kept-alive connection stays open WEIR_HTTP_KEEP_ALIVE_SECONDS, then the service closes it: through real
HTTP on uvicorn as shared/runtime.py configures it (uvicorn's own 5 s would close, under a client pool or a load
balancer that keeps connections longer, connections they are about to send on)."""

from __future__ import annotations

import asyncio
import socket

import uvicorn
from starlette.types import Receive, Scope, Send

from shared.runtime import http_config
from shared.settings import CommonSettings

KEEP_ALIVE_S = 2  # the setting, shrunk
SLACK_S = 1.0  # scheduling on a loaded machine
REQUEST = b"GET / HTTP/1.1\r\nHost: test\r\n\r\n"


async def _ok(scope: Scope, receive: Receive, send: Send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


async def _answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
    writer.write(REQUEST)
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    return head + await asyncio.wait_for(reader.readexactly(2), 5)


async def test_an_idle_connection_is_kept_for_the_setting_then_closed() -> None:
    default = CommonSettings.model_fields["http_keep_alive_seconds"].default
    assert KEEP_ALIVE_S + SLACK_S < default
    settings = CommonSettings(http_keep_alive_seconds=KEEP_ALIVE_S, http_host="127.0.0.1")
    assert http_config(_ok, CommonSettings()).timeout_keep_alive == default
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(http_config(_ok, settings))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            await asyncio.sleep(0.01)
        reader, writer = await asyncio.open_connection(*sock.getsockname())
        assert (await _answer(reader, writer)).startswith(b"HTTP/1.1 200")
        await asyncio.sleep(KEEP_ALIVE_S - SLACK_S)  # idle, but within the setting: the same connection answers
        assert (await _answer(reader, writer)).endswith(b"ok")
        await asyncio.sleep(KEEP_ALIVE_S + SLACK_S)  # idle past it: the service has closed it
        assert await asyncio.wait_for(reader.read(), SLACK_S) == b""  # already: not at uvicorn's 5 s
        writer.close()
    finally:
        server.should_exit = True
        await task
