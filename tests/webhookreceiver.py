"""A real HTTP/1.1 endpoint for webhook deliveries, for tests and benchmarks: an asyncio protocol parsing with
httptools, keep-alive, on 127.0.0.1 (or ::1) and a port the kernel picks while the socket stays bound (no race).

    with WebhookReceiver() as receiver:          # a thread and event loop (uvloop) of its own: sync or async tests
        flaky = receiver.route("/flaky", fail_then_ok(2))
        ... POST to receiver.url("/flaky") ...
        requests = receiver.wait_requests(3, timeout=5, path="/flaky")   # async: await wait_requests_async(...)
    async with WebhookReceiver() as receiver: ...  # on the running loop instead

Each path answers as its behaviour says (`ok`, `fail_then_ok`, `hang`, `slow`, `gone`, `redirect`, `big`, `trickle`,
`status`, `raw`, `reset`; unrouted paths 404), and every request is recorded whole (`Received`: path, headers, body,
arrival in wall and monotonic time, the connection it came on) before it is answered, so a test verifies signatures and
order. Stopping closes every connection, hanging ones too.

Why not h11 or uvicorn: the receiver's CPU per request, measured on this machine (2 cores, gVisor, 2026-12) with
sequential 300-byte POSTs from httpx.Client in another process over one keep-alive connection: h11 on asyncio
streams 260 us (h11 alone is ~50 us of parsing); httptools on streams 170 us, 105 us on uvloop; uvicorn (httptools,
uvloop) with a bare ASGI app 100 us; this protocol 120 us on asyncio, 80 us on uvloop. It also answers `hang` and
`trickle` on the socket itself and aborts hanging connections at stop (uvicorn waits for them). The sender is the
bottleneck: that client loop reaches 2,000-2,400 requests/s, in another process or in this one.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import struct
import threading
import time
from collections import deque
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass, field
from http import HTTPStatus
from types import TracebackType
from typing import Any, Self, TypeVar, cast

import httptools
import uvloop

from tests.waiting import TimedOut, wait_for

READ_CHUNK = 65536
BehaviourT = TypeVar("BehaviourT", bound="Behaviour")


@dataclass(frozen=True)
class Received:
    """One request as it arrived (recorded when its body was read whole, before it was answered)."""

    method: str
    target: str  # as sent, with the query
    path: str
    headers: dict[str, str]  # names lower-case; a repeated header's values joined by ", "
    body: bytes
    time: float  # time.time() at arrival
    monotonic: float  # time.monotonic() at arrival (comparable with the sender's in the same process)
    connection: int  # the connection's number, from 1: keep-alive shows as one number repeated


class Exchange(asyncio.Protocol):
    """One connection: httptools parsing what arrives, and what a behaviour answers with. A plain answer is written
    at once; one that takes time (hang, big, trickle) runs as a task, and what arrives meanwhile is dropped."""

    def __init__(self, receiver: WebhookReceiver) -> None:
        self.receiver = receiver
        self.number = 0
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.keep_alive = True
        self.closed = asyncio.get_running_loop().create_future()
        self.task: asyncio.Task[bool] | None = None
        self._ready: deque[Received] = deque()
        self._writable: asyncio.Future[None] | None = None
        self._target = b""
        self._headers: dict[str, str] = {}
        self._body = bytearray()

    # -- what a behaviour answers with

    def respond(self, status: int, body: bytes = b"", headers: Mapping[str, str] | None = None) -> None:
        self.write_head(status, len(body), headers)
        self.write(body)

    def write_head(self, status: int, length: int, headers: Mapping[str, str] | None = None) -> None:
        try:
            reason = HTTPStatus(status).phrase
        except ValueError:
            reason = ""
        lines = [f"HTTP/1.1 {status} {reason}", f"content-length: {length}",
                 *(f"{k}: {v}" for k, v in (headers or {}).items()),
                 *([] if self.keep_alive else ["connection: close"])]
        self.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))

    def write(self, data: bytes) -> None:
        if self.closed.done():
            raise ConnectionResetError("the sender closed the connection")
        assert self.transport is not None
        self.transport.write(data)

    async def drain(self) -> None:
        """Until what was written is taken by the kernel (or the connection closed)."""
        if self._writable is not None:
            await asyncio.wait([self._writable, self.closed], return_when=asyncio.FIRST_COMPLETED)
        if self.closed.done():
            raise ConnectionResetError("the sender closed the connection")

    # -- asyncio's callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self.number = self.receiver._opened(self)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)
        self.receiver._closed(self)

    def pause_writing(self) -> None:
        self._writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)
        self._writable = None

    def data_received(self, data: bytes) -> None:
        if self.task is not None:
            return  # an answer is under way (a hanging one, say): what the sender sends meanwhile is dropped
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.close()
            return
        self._answer_ready()

    def _answer_ready(self) -> None:
        while self._ready and self.task is None and not self.closed.done():
            request = self._ready.popleft()
            self.receiver._arrived(request)
            answer = self.receiver._behaviour(request.path).answer(self, request)
            if isinstance(answer, bool):
                self._after(answer)
            else:
                self.task = asyncio.ensure_future(answer)
                self.task.add_done_callback(self._answered)

    def _answered(self, task: asyncio.Task[bool]) -> None:
        self.task = None
        self._after(not task.cancelled() and task.exception() is None and task.result())
        self._answer_ready()

    def _after(self, keep: bool) -> None:
        if not (keep and self.keep_alive):
            self.close()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        if self.task is not None:
            self.task.cancel()
        if self.transport is not None:
            self.transport.abort()

    # -- httptools' callbacks

    def on_url(self, url: bytes) -> None:
        self._target += url

    def on_header(self, name: bytes, value: bytes) -> None:
        key, text = name.decode("latin-1").lower(), value.decode("latin-1")
        self._headers[key] = f"{self._headers[key]}, {text}" if key in self._headers else text

    def on_body(self, body: bytes) -> None:
        self._body += body

    def on_message_complete(self) -> None:
        target = self._target.decode("latin-1")
        self.keep_alive = self.parser.should_keep_alive()
        self._ready.append(Received(
            method=self.parser.get_method().decode("ascii"), target=target, path=target.partition("?")[0],
            headers=self._headers, body=bytes(self._body), time=time.time(), monotonic=time.monotonic(),
            connection=self.number))
        self._target, self._headers, self._body = b"", {}, bytearray()


# ------------------------------------------------------------------------------------------------ behaviours


class Behaviour:
    """How a path answers; `served` counts the requests it answered (or began to)."""

    served: int = 0

    def answer(self, exchange: Exchange, request: Received) -> bool | Coroutine[Any, Any, bool]:
        """Answer `request`, at once or in a coroutine; False when the connection is to be closed after it."""
        raise NotImplementedError


@dataclass
class Status(Behaviour):
    code: int
    body: bytes = b""
    headers: Mapping[str, str] = field(default_factory=dict)

    def answer(self, exchange: Exchange, request: Received) -> bool:
        self.served += 1
        exchange.respond(self.code, self.body, self.headers)
        return True


def status(code: int, body: bytes = b"") -> Status:
    return Status(code, body)


def ok(code: int = 204) -> Status:
    return Status(code)


def gone() -> Status:
    return Status(410)


@dataclass
class FailThenOk(Behaviour):
    """500 (or `fail_code`) `failures` times, then `ok_code` for ever."""

    failures: int
    fail_code: int = 500
    ok_code: int = 200

    def answer(self, exchange: Exchange, request: Received) -> bool:
        self.served += 1
        exchange.respond(self.fail_code if self.served <= self.failures else self.ok_code)
        return True


def fail_then_ok(failures: int) -> FailThenOk:
    return FailThenOk(failures)


@dataclass
class Hang(Behaviour):
    """Never answers; holds the connection until the sender (or `stop`) closes it."""

    async def _hold(self, exchange: Exchange) -> bool:
        await exchange.closed
        return False

    def answer(self, exchange: Exchange, request: Received) -> Coroutine[Any, Any, bool]:
        self.served += 1
        return self._hold(exchange)


def hang() -> Hang:
    return Hang()


@dataclass
class Slow(Behaviour):
    """`code` after `delay` s: an endpoint that takes its time; `answering` counts the requests it holds now (an
    attempt in flight at the sender)."""

    delay: float
    code: int = 204
    answering: int = 0

    async def _later(self, exchange: Exchange) -> bool:
        self.answering += 1
        try:
            await asyncio.sleep(self.delay)  # the behaviour under test, not a wait for something
            exchange.respond(self.code)
        except ConnectionError:
            return False  # the sender hung up (or died) meanwhile
        finally:
            self.answering -= 1
        return True

    def answer(self, exchange: Exchange, request: Received) -> Coroutine[Any, Any, bool]:
        self.served += 1
        return self._later(exchange)


def slow(delay: float, code: int = 204) -> Slow:
    return Slow(delay, code)


@dataclass
class Redirect(Behaviour):
    """`code` to `to`, a path of the same receiver (whether it was followed: `receiver.requests(to)`)."""

    to: str
    code: int = 302

    def answer(self, exchange: Exchange, request: Received) -> bool:
        self.served += 1
        exchange.respond(self.code, headers={"location": exchange.receiver.url(self.to)})
        return True


def redirect(to: str, code: int = 302) -> Redirect:
    return Redirect(to, code)


@dataclass
class Raw(Behaviour):
    """Writes `data` as the whole answer, then closes the connection: not HTTP at all, or an answer followed by a
    close the sender is not told of (no `connection: close`), as an endpoint dropping idle connections does."""

    data: bytes

    def answer(self, exchange: Exchange, request: Received) -> bool:
        self.served += 1
        exchange.write(self.data)
        return False


def raw(data: bytes) -> Raw:
    return Raw(data)


@dataclass
class Reset(Behaviour):
    """Resets the connection (TCP RST: SO_LINGER 0, then abort) instead of answering: an endpoint that crashed."""

    def answer(self, exchange: Exchange, request: Received) -> bool:
        self.served += 1
        assert exchange.transport is not None
        sock = exchange.transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        exchange.transport.abort()
        return False


def reset() -> Reset:
    return Reset()


@dataclass
class Streamed(Behaviour):
    """200 with a `size`-byte body sent in `chunk`s, one each `interval` s (0: as fast as the sender reads).
    `sent` counts the bytes handed to the kernel, so a sender that stopped reading shows as `sent` < `size`."""

    size: int
    chunk: int = READ_CHUNK
    interval: float = 0.0
    sent: int = 0

    async def _stream(self, exchange: Exchange) -> bool:
        exchange.write_head(200, self.size)
        left = self.size
        try:
            while left > 0:
                if self.interval:
                    await asyncio.sleep(self.interval)  # the behaviour under test, not a wait for something
                piece = min(self.chunk, left)
                exchange.write(b"x" * piece)
                await exchange.drain()
                self.sent += piece
                left -= piece
        except ConnectionError:
            return False  # the sender hung up: what a cap or a timeout does
        return True

    def answer(self, exchange: Exchange, request: Received) -> Coroutine[Any, Any, bool]:
        self.served += 1
        return self._stream(exchange)


def big(size: int) -> Streamed:
    """200 with a body of `size` bytes (pick one over the reader's cap)."""
    return Streamed(size)


def trickle(interval: float, size: int = 1 << 30) -> Streamed:
    """200 and its headers at once, then the body a byte each `interval` s (a body that would take for ever)."""
    return Streamed(size, chunk=1, interval=interval)


# ------------------------------------------------------------------------------------------------ the server


class WebhookReceiver:
    """See the module's docstring. `record=False` keeps counts only (a long benchmark); `tls`, a server context,
    makes it answer https only."""

    def __init__(self, routes: Mapping[str, Behaviour] | None = None, *, default: Behaviour | None = None,
                 host: str = "127.0.0.1", record: bool = True, start_timeout: float = 10.0,
                 tls: ssl.SSLContext | None = None) -> None:
        self.host, self.port = host, 0
        self.tls = tls  # a server context: https (`url` still writes http://)
        self._routes: dict[str, Behaviour] = dict(routes or {})
        self._default = default or Status(404)
        self._record = record
        self._start_timeout = start_timeout
        self._received: list[Received] = []
        self._counts: dict[str, int] = {}
        self._changed = threading.Condition()
        self._open: set[Exchange] = set()
        self._all_closed: asyncio.Event | None = None
        self.connections_opened = 0
        self._server: asyncio.Server | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # -- configuring and reading

    def url(self, path: str = "/") -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}{path}"

    def route(self, path: str, behaviour: BehaviourT) -> BehaviourT:
        """Answer `path` so from now on; the behaviour is returned (its `served`, `sent` can be read later)."""
        self._routes[path] = behaviour
        return behaviour

    def requests(self, path: str | None = None) -> list[Received]:
        """Every request recorded so far (of `path`), in arrival order."""
        with self._changed:
            return [r for r in self._received if path is None or r.path == path]

    @property
    def connections_open(self) -> int:
        return len(self._open)

    def count(self, path: str | None = None) -> int:
        """Requests arrived so far (of `path`), recorded or not."""
        with self._changed:
            return self._count_locked(path)

    def wait_requests(self, n: int, timeout: float, path: str | None = None) -> list[Received]:
        """Block until `n` requests (of `path`) arrived; them all. Not from the receiver's own loop (async mode):
        there, `wait_requests_async`."""
        with self._changed:
            if not self._changed.wait_for(lambda: self._count_locked(path) >= n, timeout):
                raise TimedOut(f"timed out after {timeout:g} s waiting for {n} requests on {path or 'any path'} "
                               f"(got {self._count_locked(path)})", self._count_locked(path))
        return self.requests(path)

    async def wait_requests_async(self, n: int, timeout: float, path: str | None = None,
                                  interval: float = 0.005) -> list[Received]:
        await wait_for(lambda: self.count(path), timeout, f"{n} requests on {path or 'any path'}", interval=interval,
                       until=lambda got: got >= n)
        return self.requests(path)

    def _count_locked(self, path: str | None) -> int:
        return sum(self._counts.values()) if path is None else self._counts.get(path, 0)

    # -- running: in a thread of its own, or on the caller's loop

    def __enter__(self) -> Self:
        started = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = self._loop = uvloop.new_event_loop()  # about 2/3 of the default loop's cost per request
            try:
                loop.run_until_complete(self._start())
            except BaseException as exc:  # handed to the caller below
                failure.append(exc)
                started.set()
                loop.close()
                return
            started.set()
            try:
                loop.run_forever()
            finally:
                loop.close()

        self._thread = threading.Thread(target=run, name="webhook-receiver", daemon=True)
        self._thread.start()
        if not started.wait(self._start_timeout):
            raise TimedOut(f"the receiver did not start within {self._start_timeout:g} s")
        if failure:
            raise failure[0]
        return self

    def __exit__(self, *exc: object) -> None:
        loop, thread = self._loop, self._thread
        assert loop is not None and thread is not None, "not started in a thread"
        asyncio.run_coroutine_threadsafe(self._stop(), loop).result(self._start_timeout)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(self._start_timeout)

    async def __aenter__(self) -> Self:
        self._loop = asyncio.get_running_loop()
        await self._start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self._stop()

    async def _start(self) -> None:
        self._all_closed = asyncio.Event()
        self._all_closed.set()
        self._server = await asyncio.get_running_loop().create_server(lambda: Exchange(self), self.host, 0,
                                                                            ssl=self.tls)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _stop(self) -> None:
        """Stop listening and close every connection, hanging ones too (3.11's `Server.close` leaves them open)."""
        assert self._server is not None and self._all_closed is not None
        self._server.close()
        for exchange in list(self._open):
            exchange.abort()  # at once, not after a sender that stopped reading took what is buffered
        async with asyncio.timeout(self._start_timeout):
            await self._all_closed.wait()
            await self._server.wait_closed()

    # -- the connections' reports

    def _opened(self, exchange: Exchange) -> int:
        self._open.add(exchange)
        assert self._all_closed is not None
        self._all_closed.clear()
        self.connections_opened += 1
        return self.connections_opened

    def _closed(self, exchange: Exchange) -> None:
        self._open.discard(exchange)
        if not self._open and self._all_closed is not None:
            self._all_closed.set()

    def _behaviour(self, path: str) -> Behaviour:
        return self._routes.get(path, self._default)

    def _arrived(self, request: Received) -> None:
        with self._changed:
            self._counts[request.path] = self._counts.get(request.path, 0) + 1
            if self._record:
                self._received.append(request)
            self._changed.notify_all()
