"""`auth.check` on a plain nats-py subscription whose callback feeds a `CheckBatcher`; answers go out by `nc.publish`.

FastStream's per-message pipeline costs about 60 us of CPU a message (docs/ENGINEERING.md), too dear for the one
check every API request makes, so this subject has no FastStream subscriber on the running broker: its contract is
declared only where auth's AsyncAPI document is built (`app.declare_check`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from shared.authcheck import CHECK_SUBJECT, QUEUE_GROUP, SENT_AT_HEADER
from shared.bus import VERSION_HEADER
from shared.messaging import error_reply
from shared.metrics import Metrics
from shared.overload import domain

log = logging.getLogger("weir.auth.check")

Respond = Callable[[list[tuple[str, bytes]]], Awaitable[None]]  # [(reply subject, body)], sent together
OVERLOADED_REPLY = error_reply(503, "overloaded", "auth is over capacity; retry").model_dump_json().encode()


@dataclass(frozen=True)
class QueueShedding:
    """auth's shedding of its check queue (SPEC 15): seconds a check may wait (shared/overload/domain.py)."""

    target: float
    interval: float
    sender_clock: bool = True  # count a check's wait from the edge's Weir-Sent-At, not only from auth's receipt


MAX_TRANSIT = 3600.0  # a sender's clock far ahead must not make a wait of more than this


# the parts of an encoded CheckRequest that say where it stands (shared/overload/domain.py), read as bytes: only
# checks already past their timeout are looked at, and the model is validated later, in the decision
_NO_TOKEN = b'"internal_token":null'
_TOKEN = b'"internal_token":'
_MANAGEMENT = b'"route_class":"management"'  # an internal route's check counts as internal only with the token
_COMPLETION = b'/upload/complete"'
_READS = tuple(b'"route":"' + m.encode() + b" " for m in domain.READ_METHODS)


def check_priority(payload: bytes) -> domain.Priority:
    """A check's priority by the request it is about, as the api's shedder has it: the internal token (auth
    judges it next) or a management route first, then upload completion, then writes, then reads."""
    internal = (_TOKEN in payload and _NO_TOKEN not in payload) or _MANAGEMENT in payload
    declared: domain.Priority | None = "completion" if _COMPLETION in payload else None
    method = "GET" if any(r in payload for r in _READS) else "POST"
    return domain.priority_of(internal=internal, declared=declared, method=method)


class CheckDecider(Protocol):
    async def check_payloads(self, payloads: list[bytes]) -> list[bytes]: ...


class CheckBatcher:
    """`auth.check` messages decided in batches: whatever arrived while the last batch was being decided.

    Under load a batch grows and its cost per request shrinks (one store increment per counter for the batch, no
    task per message); when idle, a batch is one request and waits for nothing.
    """

    def __init__(self, checker: CheckDecider, max_batch: int, respond: Respond, in_flight: int = 4,
                 metrics: Metrics | None = None, shed: QueueShedding | None = None) -> None:
        self.checker = checker
        self.metrics = metrics or Metrics("auth")
        self.max_batch = max_batch
        self.respond = respond
        self.pending: list[tuple[str, bytes, float]] = []  # reply subject, payload, when it arrived
        self.shed = shed
        self.empty_at = time.monotonic()  # when `pending` was last seen empty
        self.slots = in_flight
        self.running: set[asyncio.Task[None]] = set()
        self.starting = False  # a batch task is made and has not yet taken its batch: what arrives now is its

    async def receive(self, msg: Msg) -> None:
        """The subscription's callback: the message is queued for a batch task (never awaits anything)."""
        now = time.monotonic()
        if not self.pending:
            self.empty_at = now
        self.pending.append((msg.reply, msg.data, now - self._in_transit(msg) if self.shed else now))
        if not self.starting and len(self.running) < self.slots:
            self._start()

    def add_many(self, messages: list[tuple[str, bytes]]) -> None:
        now = time.monotonic()
        if not self.pending:
            self.empty_at = now
        self.pending += [(reply, data, now) for reply, data in messages]
        if not self.starting and len(self.running) < self.slots:
            self._start()

    def _start(self) -> None:
        self.starting = True
        task = asyncio.ensure_future(self._run())
        self.running.add(task)
        task.add_done_callback(self.running.discard)

    async def _run(self) -> None:
        me = asyncio.current_task()
        self.starting = False
        try:
            while self.pending:
                batch, self.pending = self.pending[: self.max_batch], self.pending[self.max_batch :]
                if self.shed is not None:
                    batch = await self._shed(batch)
                    if not batch:
                        continue
                try:
                    await self._decide(batch)
                except Exception:
                    log.exception("auth.check batch of %d failed", len(batch))
                    await self._fail(batch)
        finally:
            # leave the running set in the same step that saw nothing pending: a done callback runs a step later,
            # and a message added in between would find every slot taken and wait for the next message to come
            if me is not None:
                self.running.discard(me)

    def _in_transit(self, msg: Msg) -> float:
        """How long the check waited before auth read it (sockets, the server), from the edge's send time."""
        assert self.shed is not None
        sent = msg.headers.get(SENT_AT_HEADER) if msg.headers and self.shed.sender_clock else None
        if sent is None or not sent.isdigit():
            return 0.0
        return min(max(0.0, time.time() - int(sent) / 1000), MAX_TRANSIT)

    async def _shed(self, batch: list[tuple[str, bytes, float]]) -> list[tuple[str, bytes, float]]:
        """The batch without the checks that waited past the queue's timeout, which are answered `overloaded` at
        once (the api answers their requests 503 `overloaded`): a slow auth never turns into callers' timeouts."""
        assert self.shed is not None
        now = time.monotonic()
        timeout = domain.queue_timeout(now - self.empty_at, self.shed.target, self.shed.interval)
        if now - batch[0][2] <= timeout:  # the oldest is in time: so is the rest
            return batch
        kept, refused = [], []
        for entry in batch:
            priority = check_priority(entry[1])
            if domain.sheds_queued(priority, now - entry[2], timeout):
                refused.append(entry[0])
                self.metrics.inc("shed_total", priority=priority)
            else:
                kept.append(entry)
        if refused:
            try:
                await self.respond([(reply, OVERLOADED_REPLY) for reply in refused if reply])
            except Exception as exc:  # the connection is gone: the callers time out, as they would anyway
                log.warning("could not answer shed auth.check requests: %s", exc)
        return kept

    async def _decide(self, batch: list[tuple[str, bytes, float]]) -> None:
        self.metrics.inc("check_batches_total", help="auth.check batches decided (weir_checks_total over this: the"
                         " mean batch)")
        started = time.perf_counter()
        replies = await self.checker.check_payloads([data for _, data, _ in batch])
        self.metrics.observe("check_decision_seconds", time.perf_counter() - started)
        # a request without a reply subject gets nothing, as from any NATS responder
        await self.respond([(reply, body) for (reply, _, _), body in zip(batch, replies, strict=True) if reply])

    async def _fail(self, batch: list[tuple[str, bytes, float]]) -> None:
        """A batch that could not be decided is answered at once, so callers do not wait out their timeout."""
        body = error_reply(503, "unavailable", "auth could not decide this request; retry").model_dump_json().encode()
        try:
            await self.respond([(reply, body) for reply, _, _ in batch if reply])
        except Exception as exc:  # the connection is gone: the callers time out, as they would anyway
            log.warning("could not answer a failed auth.check batch: %s", exc)

    async def drain(self, timeout: float) -> None:
        if self.running:
            await asyncio.wait(list(self.running), timeout=timeout)


def publisher(nc: NATS) -> Respond:
    """A batch's answers, each by `nc.publish` with auth's release in its `Weir-Version` header: nats-py appends
    them to its pending buffer and its flusher writes them to the socket together once the batch task yields."""

    async def respond(answers: list[tuple[str, bytes]]) -> None:
        publish = nc.publish
        for subject, body in answers:
            await publish(subject, body, headers=VERSION_HEADER)

    return respond


async def serve_checks(nc: NATS, batcher: CheckBatcher) -> Subscription:
    """auth's share of `auth.check` (queue group `auth`), fed to `batcher`."""
    return await nc.subscribe(CHECK_SUBJECT, queue=QUEUE_GROUP, cb=batcher.receive)
