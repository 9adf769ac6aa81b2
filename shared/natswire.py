"""A lean NATS connection for the one request/reply path that runs once per API request: `auth.check`.

nats-py hands every message through a StreamReader, a read task, a per-subscription queue and task, and every
publish through a flusher task: four task steps a message. On this path that is most of the work: a nats-py echo
costs 140 us of CPU a request at 1,500 requests/s where a bare protocol one costs 65 (bench/RESULTS.md). This
connection speaks the same protocol (https://docs.nats.io/reference/reference-protocols/nats-protocol) straight
from an asyncio.Protocol: messages are parsed in `data_received` and handed over in arrival order, all that one
read brought at once; what is written in one loop iteration goes out in one write.

It does only what the path needs: plain TCP, user/password or token from the URL, PUB, SUB with a queue group,
MSG and HMSG, PING/PONG both ways, reconnecting to the listed servers. Anything else (TLS, NKEYs, JWTs) raises
`WireUnsupported` at connect, and callers keep to nats-py. Everything else Weir does on NATS stays on nats-py.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import json
import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast
from urllib.parse import unquote, urlsplit

from shared.metrics import Metrics

log = logging.getLogger("weir.natswire")

Batch = list[tuple[bytes, bytes]]  # (reply subject, payload) of each message one read brought, in arrival order
Handler = Callable[[Batch], None]

PING_INTERVAL_S = 10.0  # a silent server is noticed after PING_INTERVAL_S * MAX_PINGS_OUT
MAX_PINGS_OUT = 3
RECONNECT_WAIT_S = 0.25
CONNECT_TIMEOUT_S = 2.0


class WireError(Exception):
    """The request could not be answered over this connection."""


class WireUnsupported(WireError):
    """The server asks for something this connection does not speak (TLS, NKEYs, JWTs): use nats-py."""


class WireClosed(WireError):
    """Not connected (or the connection was lost while the request waited): the answer will not come."""


class WireTimeout(WireError, TimeoutError):
    """No reply within the timeout."""


class WireNoResponders(WireError):
    """Nobody subscribes to the subject (the server's 503 status)."""


# ------------------------------------------------------------------------------------------------ parsing


@dataclass
class Parsed:
    """What one `feed` found: messages per subscription id, and the control lines to act on."""

    messages: list[tuple[int, bytes, bytes, bytes, bytes]] = field(default_factory=list)  # sid, subject, reply,
    # headers (b"" for MSG), payload
    pings: int = 0
    pongs: int = 0
    infos: list[dict[str, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


class Parser:
    """The server-to-client half of the protocol, a pure function of the bytes fed to it, however they are cut."""

    def __init__(self) -> None:
        self.buf = bytearray()

    def feed(self, data: bytes) -> Parsed:
        buf = self.buf
        buf += data
        out = Parsed()
        pos = 0
        end = len(buf)
        while pos < end:
            eol = buf.find(b"\r\n", pos)
            if eol < 0:
                break
            op = buf[pos : pos + 4]
            if op == b"MSG " or op == b"HMSG":
                headers = op == b"HMSG"
                args = bytes(buf[pos + (5 if headers else 4) : eol]).split()
                if len(args) not in ((4, 5) if headers else (3, 4)):
                    raise ValueError(f"malformed {op.decode().strip()} line: {bytes(buf[pos:eol])!r}")
                total = int(args[-1])
                header_size = int(args[-2]) if headers else 0
                start = eol + 2
                if end < start + total + 2:
                    break  # the payload is not all here yet
                subject = args[0]
                sid = int(args[1])
                reply = args[2] if len(args) == (5 if headers else 4) else b""
                out.messages.append((sid, subject, reply, bytes(buf[start : start + header_size]),
                                     bytes(buf[start + header_size : start + total])))
                pos = start + total + 2
                continue
            line = bytes(buf[pos:eol])
            pos = eol + 2
            if line == b"PING":
                out.pings += 1
            elif line == b"PONG":
                out.pongs += 1
            elif line.startswith(b"INFO "):
                out.infos.append(json.loads(line[5:]))
            elif line.startswith(b"-ERR"):
                out.errors.append(line[4:].strip(b" '").decode(errors="replace"))
            # +OK (verbose is off, but harmless)
        del buf[:pos]
        return out


def no_responders(headers: bytes) -> bool:
    """The server's own answer to a request nobody subscribes to: `NATS/1.0 503`."""
    return headers.startswith(b"NATS/1.0 503")


# ------------------------------------------------------------------------------------------------ connection


@dataclass(frozen=True)
class Server:
    host: str
    port: int
    user: str | None = None
    password: str | None = None
    token: str | None = None


def servers_of(urls: str) -> list[Server]:
    """`nats://[user:pass@|token@]host[:port]`, comma-separated, as the nats_url setting gives them."""
    out = []
    for raw in urls.split(","):
        url = urlsplit(raw.strip() if "://" in raw else f"nats://{raw.strip()}")
        if url.scheme not in ("nats", ""):
            raise WireUnsupported(f"scheme {url.scheme!r}")
        user = unquote(url.username) if url.username else None
        password = unquote(url.password) if url.password else None
        out.append(Server(url.hostname or "127.0.0.1", url.port or 4222,
                          user if password is not None else None, password,
                          user if password is None else None))
    return out


class _Protocol(asyncio.Protocol):
    def __init__(self, owner: WireConnection) -> None:
        self.owner = owner
        self.parser = Parser()
        self.transport: asyncio.Transport | None = None
        self.info: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        # one entry per PING this side sent, answered in order: a future to resolve (a handshake or a flush
        # waiting) or None (the keep-alive's)
        self.pongs: collections.deque[asyncio.Future[None] | None] = collections.deque()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not asyncio.Transport's

    def data_received(self, data: bytes) -> None:
        try:
            parsed = self.parser.feed(data)
        except ValueError as exc:
            log.warning("NATS protocol error, reconnecting: %s", exc)
            self.abort()
            return
        if parsed.infos and not self.info.done():
            self.info.set_result(parsed.infos[0])
        if parsed.errors:
            log.warning("NATS server error: %s", "; ".join(parsed.errors))
            if not self.info.done():
                self.info.set_exception(WireError(parsed.errors[0]))
        if parsed.pings:
            self.owner._write(b"PONG\r\n" * parsed.pings)
        if parsed.pongs:
            self.owner._pings_out = 0
            for _ in range(parsed.pongs):
                waiter = self.pongs.popleft() if self.pongs else None
                if waiter is not None and not waiter.done():
                    waiter.set_result(None)
        if parsed.messages:
            self.owner._deliver(parsed.messages)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.info.done():
            self.info.set_exception(WireClosed("connection closed during the handshake"))
        for waiter in self.pongs:
            if waiter is not None and not waiter.done():
                waiter.set_exception(WireClosed("connection closed before the server answered"))
        self.owner._lost(self)

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()


class _Subscription:
    def __init__(self, sid: int, subject: str, queue: str | None, handler: Handler) -> None:
        self.sid = sid
        self.subject = subject
        self.queue = queue
        self.handler = handler

    def sub_line(self) -> bytes:
        queue = f" {self.queue}" if self.queue else ""
        return f"SUB {self.subject}{queue} {self.sid}\r\n".encode()


class WireConnection:
    """One TCP connection to one of `servers`, kept up (reconnecting) until `close`."""

    def __init__(self, servers: list[Server], *, name: str, connect_timeout: float = CONNECT_TIMEOUT_S,
                 ping_interval: float = PING_INTERVAL_S, reconnect_wait: float = RECONNECT_WAIT_S,
                 on_state: Callable[[bool], None] | None = None) -> None:
        self.servers = servers
        self.name = name
        self.on_state = on_state  # told True on every connection made, False on every one lost (a metric)
        self.connect_timeout = connect_timeout
        self.ping_interval = ping_interval
        self.reconnect_wait = reconnect_wait
        self._proto: _Protocol | None = None
        self._out: list[bytes] = []
        self._flush_scheduled = False
        self._subs: dict[int, _Subscription] = {}
        self._sids = itertools.count(2)  # sid 1: the request inbox
        self._inbox = f"_INBOX.{secrets.token_hex(11)}."
        self._tokens = itertools.count()
        self._waiting: dict[bytes, asyncio.Future[bytes]] = {}
        self._closing = False
        self._reconnecting: asyncio.Task[None] | None = None
        self._pinger: asyncio.TimerHandle | None = None
        self._pings_out = 0
        self._max_payload = 1024 * 1024  # the server's INFO says; a larger PUB would make it drop the connection
        self.connects = 0  # how many times a connection was established (tests and metrics read it)

    @property
    def is_connected(self) -> bool:
        return self._proto is not None

    async def connect(self) -> None:
        """The first connection: raises when no server can be reached (or WireUnsupported)."""
        last: Exception | None = None
        for server in self.servers:
            try:
                await self._open(server)
                return
            except WireUnsupported:
                raise
            except (OSError, WireError, TimeoutError) as exc:
                last = exc
        raise WireClosed(f"no NATS server answered: {last}")

    async def _open(self, server: Server) -> None:
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(self.connect_timeout):
            transport, proto = await loop.create_connection(lambda: _Protocol(self), server.host, server.port)
            try:
                info = await proto.info
                if info.get("tls_required") or info.get("nonce"):
                    raise WireUnsupported("the server requires TLS or NKEY/JWT authentication")
                self._max_payload = int(info.get("max_payload", self._max_payload))
                options: dict[str, Any] = {
                    "verbose": False, "pedantic": False, "headers": True, "no_responders": True, "protocol": 1,
                    "lang": "python-weir-wire", "version": "1", "name": self.name,
                }
                if server.user is not None:
                    options.update(user=server.user, **{"pass": server.password})
                elif server.token is not None:
                    options["auth_token"] = server.token
                pong: asyncio.Future[None] = loop.create_future()
                proto.pongs.append(pong)
                lines = [b"CONNECT " + json.dumps(options).encode() + b"\r\n",
                         b"SUB " + self._inbox.encode() + b"* 1\r\n",
                         *(sub.sub_line() for sub in self._subs.values()), b"PING\r\n"]
                transport.write(b"".join(lines))
                await pong  # the server has our CONNECT and every SUB (a refused CONNECT is an -ERR first)
            except BaseException:
                transport.abort()
                raise
        self._proto = proto
        self._pings_out = 0
        self.connects += 1
        if self.on_state is not None:
            self.on_state(True)
        self._schedule_ping()
        if self._out:
            self._flush()

    def subscribe(self, subject: str, handler: Handler, *, queue: str | None = None) -> int:
        """`handler` gets every message one read brought, at once, from inside the read: it must not block.
        The subscription is made again on every reconnect. Returns its id, for `unsubscribe`."""
        sub = _Subscription(next(self._sids), subject, queue, handler)
        self._subs[sub.sid] = sub
        if self._proto is not None:
            self._write(sub.sub_line())
        return sub.sid

    def unsubscribe(self, sid: int) -> None:
        if self._subs.pop(sid, None) is not None and self._proto is not None:
            self._write(f"UNSUB {sid}\r\n".encode())

    def publish(self, subject: bytes, payload: bytes) -> None:
        """Sent with what else this loop iteration writes; dropped when not connected (a reply nobody can get)."""
        if self._proto is not None:
            if len(payload) > self._max_payload:
                log.warning("NATS connection %s: a %d-byte message not sent (server limit %d)", self.name,
                            len(payload), self._max_payload)
                return
            self._write(b"PUB %s %d\r\n%s\r\n" % (subject, len(payload), payload))

    async def request(self, subject: str, payload: bytes, timeout: float) -> bytes:
        if self._proto is None:
            raise WireClosed("not connected")
        if len(payload) > self._max_payload:
            raise WireError(f"{len(payload)} bytes is more than the server's {self._max_payload}")
        token = str(next(self._tokens)).encode()
        loop = asyncio.get_running_loop()
        future: asyncio.Future[bytes] = loop.create_future()
        self._waiting[token] = future
        timer = loop.call_later(timeout, _expire, future)
        try:
            self._write(b"PUB %s %s%s %d\r\n%s\r\n" % (subject.encode(), self._inbox.encode(), token,
                                                     len(payload), payload))
            return await future
        finally:
            timer.cancel()
            self._waiting.pop(token, None)

    async def flush(self, timeout: float = 2.0) -> None:
        """Returns once the server has seen everything written before (a PING answered)."""
        proto = self._proto
        if proto is None:
            raise WireClosed("not connected")
        pong: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        proto.pongs.append(pong)
        self._write(b"PING\r\n")
        async with asyncio.timeout(timeout):
            await pong

    async def close(self) -> None:
        self._closing = True
        if self._reconnecting is not None:
            self._reconnecting.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reconnecting
        if self._pinger is not None:
            self._pinger.cancel()
        proto = self._proto
        if proto is not None:
            self._flush()
            assert proto.transport is not None
            proto.transport.close()  # after what is buffered is written
        self._proto = None
        self._fail_waiting()

    # ---- internals

    def _write(self, data: bytes) -> None:
        self._out.append(data)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        proto = self._proto
        if proto is None or not self._out or proto.transport is None:
            if proto is None:
                self._out.clear()
            return
        data = b"".join(self._out)
        self._out.clear()
        proto.transport.write(data)

    def _deliver(self, messages: list[tuple[int, bytes, bytes, bytes, bytes]]) -> None:
        batches: dict[int, Batch] = {}
        prefix = len(self._inbox)
        for sid, subject, reply, headers, payload in messages:
            if sid == 1:
                future = self._waiting.get(subject[prefix:])
                if future is not None and not future.done():
                    if headers and no_responders(headers):
                        future.set_exception(WireNoResponders(f"no responders on {subject!r}"))
                    else:
                        future.set_result(payload)
                continue
            batch = batches.get(sid)
            if batch is None:
                batches[sid] = [(reply, payload)]
            else:
                batch.append((reply, payload))
        for sid, batch in batches.items():
            sub = self._subs.get(sid)
            if sub is not None:
                try:
                    sub.handler(batch)
                except Exception:
                    log.exception("handler of %s failed", sub.subject)

    def _lost(self, proto: _Protocol) -> None:
        if self._proto is not proto:
            return  # a handshake that failed: connect() reports it
        self._proto = None
        if self._pinger is not None:
            self._pinger.cancel()
        self._fail_waiting()
        if self.on_state is not None:
            self.on_state(False)
        if not self._closing:
            log.warning("NATS connection %s lost; reconnecting", self.name)
            self._reconnecting = asyncio.ensure_future(self._reconnect())

    def _fail_waiting(self) -> None:
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(WireClosed("connection lost before the reply"))

    async def _reconnect(self) -> None:
        for attempt in itertools.count():
            server = self.servers[attempt % len(self.servers)]
            try:
                await self._open(server)
                log.info("NATS connection %s: connected again to %s:%d", self.name, server.host, server.port)
                return
            except WireUnsupported as exc:
                log.error("NATS connection %s cannot reconnect: %s", self.name, exc)
                return
            except (OSError, WireError, TimeoutError):
                await asyncio.sleep(self.reconnect_wait)

    def _schedule_ping(self) -> None:
        self._pinger = asyncio.get_running_loop().call_later(self.ping_interval, self._ping)

    def _ping(self) -> None:
        proto = self._proto
        if proto is None:
            return
        if self._pings_out >= MAX_PINGS_OUT:
            log.warning("NATS connection %s: %d PINGs unanswered; reconnecting", self.name, self._pings_out)
            proto.abort()
            return
        self._pings_out += 1
        proto.pongs.append(None)
        self._write(b"PING\r\n")
        self._schedule_ping()


async def open_wire(urls: str, *, name: str, enabled: bool = True,
                    on_state: Callable[[bool], None] | None = None) -> WireConnection | None:
    """A lean connection to the `nats_url` servers, or None where it cannot serve (turned off, or the server wants
    TLS or NKEY/JWT authentication): the caller then stays on nats-py. A server down now is no reason for None:
    the connection keeps trying in the background, and `is_connected` says when it is there."""
    if not enabled:
        return None
    try:
        wire = WireConnection(servers_of(urls), name=name, on_state=on_state)
        await wire.connect()
    except WireUnsupported as exc:
        log.info("lean NATS connection %s not used: %s", name, exc)
        return None
    except WireClosed as exc:
        log.warning("lean NATS connection %s: %s; retrying in the background", name, exc)
        if on_state is not None:
            on_state(False)
        wire._reconnecting = asyncio.ensure_future(wire._reconnect())
    return wire


def state_metric(metrics: Metrics, name: str) -> Callable[[bool], None]:
    """`on_state` as the gauge weir_nats_lean_connected{connection=name}: 1 while connected, 0 while not."""

    def record(up: bool) -> None:
        metrics.set("nats_lean_connected", 1.0 if up else 0.0,
                    help="the lean NATS connection of auth.check is up (1) or down (0)", connection=name)

    return record


def _expire(future: asyncio.Future[bytes]) -> None:
    if not future.done():
        future.set_exception(WireTimeout())
