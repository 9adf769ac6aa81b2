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
from typing import Protocol

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from shared.authcheck import CHECK_SUBJECT, QUEUE_GROUP
from shared.bus import VERSION_HEADER
from shared.messaging import error_reply
from shared.metrics import Metrics

log = logging.getLogger("weir.auth.check")

Respond = Callable[[list[tuple[str, bytes]]], Awaitable[None]]  # [(reply subject, body)], sent together


class CheckDecider(Protocol):
    async def check_payloads(self, payloads: list[bytes]) -> list[bytes]: ...


class CheckBatcher:
    """`auth.check` messages decided in batches: whatever arrived while the last batch was being decided.

    Under load a batch grows and its cost per request shrinks (one store increment per counter for the batch, no
    task per message); when idle, a batch is one request and waits for nothing.
    """

    def __init__(self, checker: CheckDecider, max_batch: int, respond: Respond, in_flight: int = 4,
                 metrics: Metrics | None = None) -> None:
        self.checker = checker
        self.metrics = metrics or Metrics("auth")
        self.max_batch = max_batch
        self.respond = respond
        self.pending: list[tuple[str, bytes]] = []
        self.slots = in_flight
        self.running: set[asyncio.Task[None]] = set()
        self.starting = False  # a batch task is made and has not yet taken its batch: what arrives now is its

    async def receive(self, msg: Msg) -> None:
        """The subscription's callback: the message is queued for a batch task (never awaits anything)."""
        self.pending.append((msg.reply, msg.data))
        if not self.starting and len(self.running) < self.slots:
            self._start()

    def add_many(self, messages: list[tuple[str, bytes]]) -> None:
        self.pending += messages
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

    async def _decide(self, batch: list[tuple[str, bytes]]) -> None:
        self.metrics.inc("check_batches_total", help="auth.check batches decided (weir_checks_total over this: the"
                         " mean batch)")
        started = time.perf_counter()
        replies = await self.checker.check_payloads([data for _, data in batch])
        self.metrics.observe("check_decision_seconds", time.perf_counter() - started)
        # a request without a reply subject gets nothing, as from any NATS responder
        await self.respond([(reply, body) for (reply, _), body in zip(batch, replies, strict=True) if reply])

    async def _fail(self, batch: list[tuple[str, bytes]]) -> None:
        """A batch that could not be decided is answered at once, so callers do not wait out their timeout."""
        body = error_reply(503, "unavailable", "auth could not decide this request; retry").model_dump_json().encode()
        try:
            await self.respond([(reply, body) for reply, _ in batch if reply])
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
