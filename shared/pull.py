"""The live path of one durable: JetStream's pull protocol on nats-py's core client (`DurablePull`).

Why not nats-py's `PullSubscription.fetch`: when its first, no-wait request comes back empty it sends a waiting one and,
once a message comes, waits for the rest of the batch until that request expires; a lone event then sits in the
client for up to the whole wait (`consumer_fetch_wait_seconds`, 1 s). With two webhooks instances on one durable this
put a video's later event ahead of its earlier one (stop 54's note); bench/pull.py measures it. Here pull requests
stay open on the server, topped up as they fill, and each message is handed on as soon as it is read: what has come
meanwhile goes on together, so a busy durable still hands on batches. The protocol (ADR-13): a request `{batch,
expires}` to `$JS.API.CONSUMER.MSG.NEXT.<stream>.<durable>` with our inbox as reply; messages come to the inbox,
and status messages (`Status` header) end requests: 408 when one expires, 409 when the server ends it otherwise,
with the messages it still owed in `Nats-Pending-Messages`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import NamedTuple

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import api

log = logging.getLogger("weir.bus")
JS_API = "$JS.API"
PENDING_MESSAGES = "Nats-Pending-Messages"
HEARTBEAT = "100"
NO_MESSAGES = "404"
REQUEST_TIMEOUT = "408"
CONFLICT = "409"


class Source(NamedTuple):
    """One durable a consumer reads: its main stream, or REPLAY."""

    stream: str
    durable: str
    subjects: list[str]


Deliver = Callable[[list[Msg]], Awaitable[None]]


@dataclass
class Request:
    """A pull request the server holds: how many messages it may still send, and when we stop counting on it."""

    owed: int
    gone_at: float  # its expiry and a grace: a request whose end never came (a reconnect) is forgotten then


class Requests:
    """The pull requests open on the server, oldest first. The server fills them in the order they came and all
    expire after the same wait, so a message fills the oldest and an end (408/409) is the oldest's. Pure: the pull
    feeds it what it reads and sends what `top_up` asks for."""

    def __init__(self, batch: int, wait: float) -> None:
        self.batch = batch
        self.wait = wait
        self.open: collections.deque[Request] = collections.deque()

    @property
    def owed(self) -> int:
        return sum(r.owed for r in self.open)

    def top_up(self, now: float) -> int:
        """How many messages to ask for now (0: none): a new request once half a batch is no longer owed."""
        self.forget(now)
        owed = self.owed
        if owed > self.batch // 2:
            return 0
        n = self.batch - owed
        self.open.append(Request(n, now + self.wait * 1.5 + 1.0))
        return n

    def message(self) -> None:
        if self.open:
            self.open[0].owed -= 1
            if self.open[0].owed <= 0:
                self.open.popleft()

    def withdraw(self) -> None:
        """The newest request could not be sent."""
        if self.open:
            self.open.pop()

    def ended(self) -> None:
        """The server ended a request (expired, or a 409 with what it still owed)."""
        if self.open:
            self.open.popleft()

    def reset(self) -> None:
        """The connection was made again: what the server held for the old one is not counted on."""
        self.open.clear()

    def forget(self, now: float) -> None:
        while self.open and self.open[0].gone_at <= now:
            self.open.popleft()

    def next_check(self, now: float) -> float:
        """Seconds until the oldest request is forgotten (the wait, with none open)."""
        return max(0.0, self.open[0].gone_at - now) if self.open else self.wait


class DurablePull:
    """Pulls one durable and hands each read on (`deliver`) at once, with whatever else has come meanwhile.

    `inbox`: the identity's reply inbox prefix (None: the connection's). `wait`: each request's expiry; also how long
    to wait after a failure. `stop` takes nothing new and hands on what the open requests still bring, until they end
    (within `wait`): a message the server sent is never left to its ack wait."""

    def __init__(self, nc: Client, source: Source, *, inbox: bytes | None, batch: int, wait: float,
                 deliver: Deliver) -> None:
        self.nc = nc
        self.source = source
        self.inbox = inbox
        self.batch = batch
        self.wait = wait
        self.deliver = deliver
        self.requests = Requests(batch, wait)
        self.read: collections.deque[Msg] = collections.deque()
        self.arrived = asyncio.Event()
        self.stopping = asyncio.Event()
        self.task: asyncio.Task[None] | None = None
        self.subject = f"{JS_API}.CONSUMER.MSG.NEXT.{source.stream}.{source.durable}"
        self._failure = ""
        self._paused_until = 0.0  # after a failure: no new request before then
        self._reconnects = nc.stats["reconnects"]

    def start(self) -> None:
        self.task = asyncio.create_task(self.run(), name=f"pull-{self.source.durable}")

    async def stop(self, timeout: float) -> None:
        self.stopping.set()
        self.arrived.set()
        if self.task is not None:
            await asyncio.wait([self.task], timeout=timeout)

    async def _on_message(self, msg: Msg) -> None:
        self.read.append(msg)
        self.arrived.set()

    def _inbox(self) -> str:
        if self.inbox is None:
            return self.nc.new_inbox()
        return self.inbox.decode() + uuid.uuid4().hex

    async def run(self) -> None:
        reply = self._inbox()
        sub: Subscription = await self.nc.subscribe(reply, cb=self._on_message)
        try:
            while not (self.stopping.is_set() and not self.requests.open and not self.read):
                if not self.stopping.is_set():
                    await self._ask(reply)
                if not self.read:
                    self.arrived.clear()
                    now = time.monotonic()
                    check = min(self.requests.next_check(now), self.wait)  # and a look at the connection
                    if self._paused_until > now:
                        check = min(check, self._paused_until - now)
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self.arrived.wait(), check)
                    self.requests.forget(time.monotonic())
                    if self.nc.stats["reconnects"] != self._reconnects:  # ask again at once
                        self._reconnects = self.nc.stats["reconnects"]
                        self.requests.reset()
                messages = self._take()
                if messages:
                    try:
                        await self.deliver(messages)
                    except Exception:  # what was not acknowledged comes back after the ack wait
                        log.exception("pull on %s: messages could not be handed on", self.source.durable)
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def _ask(self, reply: str) -> None:
        now = time.monotonic()
        if now < self._paused_until:
            return
        n = self.requests.top_up(now)
        if not n:
            return
        body = json.dumps({"batch": n, "expires": int(self.wait * 1e9)}).encode()
        try:
            await self.nc.publish(self.subject, body, reply=reply)
        except Exception as exc:  # closed, or its buffer full while reconnecting
            self.requests.withdraw()
            self._failed(repr(exc))

    def _take(self) -> list[Msg]:
        """The messages read so far (each status ends its request and is dropped)."""
        messages: list[Msg] = []
        while self.read:
            msg = self.read.popleft()
            status = msg.headers.get(api.Header.STATUS) if msg.headers else None
            if not status:
                self.requests.message()
                messages.append(msg)
                if self._failure:
                    self._failure = ""
                    log.warning("pull on %s works again", self.source.durable)
            elif status == HEARTBEAT:
                continue
            elif status == REQUEST_TIMEOUT or (status == CONFLICT and msg.headers and PENDING_MESSAGES in msg.headers):
                self.requests.ended()
            else:  # the durable gone, too many waiting requests...: asked again once the oldest is forgotten
                self.requests.ended()
                description = msg.headers.get(api.Header.DESCRIPTION, "") if msg.headers else ""
                self._failed(f"{status} {description}")
        return messages

    def _failed(self, failure: str) -> None:
        self._paused_until = time.monotonic() + self.wait
        if failure != self._failure:
            self._failure = failure
            log.warning("pull on %s: %s; asking again within %s s", self.source.durable, failure, self.wait)
