"""`auth.check` in batches: the one subject auth serves without FastStream's per-message pipeline.

FastStream keeps the subscriber: its handler in services/auth/app.py is the contract (CheckRequest -> CheckReply in
the AsyncAPI document, and what TestNatsBroker runs), and the broker starts and stops it with every other one.
`serve_in_batches` replaces only the subscription it opens at start: on the broker's own connection, nats-py's
reader hands each message to a `CheckBatcher` as it parses it (`natsconn.deliver_inline`), which decides whatever
arrived meanwhile as one batch.

Why (bench/RESULTS.md, issue 12; 2026-12-01, 2 cores, nothing else running): FastStream's per-message pipeline
cannot carry auth.check. One instance decided 19,500-23,000 checks/s with the seam and 1,500-2,100/s on the
FastStream subscriber (max_workers=256; a bare FastStream echo does 5,300/s with max_workers=1), and the api's guarded
GET kept 0.71-0.86 of its fixed-identity baseline's throughput with the seam against 0.42 without.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from faststream.nats.subscriber.usecases import CoreSubscriber
from nats.aio.msg import Msg

from shared import natsconn
from shared.messaging import error_reply
from shared.metrics import Metrics

log = logging.getLogger("weir.auth.check")

Respond = Callable[[list[tuple[str, bytes]]], Awaitable[None]]  # [(reply subject, body)], sent together


class Decides(Protocol):
    async def check_payloads(self, payloads: list[bytes]) -> list[bytes]: ...


class CheckBatcher:
    """`auth.check` messages are decided in batches: whatever arrived while the last batch was being decided.

    Under load a batch grows, and its cost per request shrinks (one store increment per counter for the batch, no
    task per message); when idle, a batch is one request and waits for nothing. `respond` sends a batch's answers
    (natsconn.publish_many: one write for the batch)
    """

    def __init__(self, checker: Decides, max_batch: int, respond: Respond, in_flight: int = 4,
                 metrics: Metrics | None = None) -> None:
        self.checker = checker
        self.metrics = metrics or Metrics("auth")
        self.max_batch = max_batch
        self.respond = respond
        self.pending: list[tuple[str, bytes]] = []
        self.slots = in_flight
        self.running: set[asyncio.Task[None]] = set()

    def add(self, msg: Msg) -> None:
        """A message as the subscription delivers it (each one, as nats-py parses it): queued; a batch task picks
        it up."""
        self.pending.append((msg.reply, msg.data))
        if len(self.running) < self.slots:
            self._start()

    def add_many(self, messages: list[tuple[str, bytes]]) -> None:
        self.pending += messages
        if len(self.running) < self.slots:
            self._start()

    def _start(self) -> None:
        task = asyncio.ensure_future(self._run())
        self.running.add(task)
        task.add_done_callback(self.running.discard)

    async def _run(self) -> None:
        me = asyncio.current_task()
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


def serve_in_batches(subscriber: Any, batcher: CheckBatcher) -> None:
    """The subscriber's subscription, made at the broker's start, feeds `batcher` instead of FastStream's pipeline.

    FastStream's hook for making a subscriber's subscription (`_create_subscription`) is replaced on this one
    subscriber; its stop (unsubscribe, with the broker's graceful stop) is FastStream's own."""
    assert isinstance(subscriber, CoreSubscriber), "auth.check is a core NATS subscriber"

    async def subscribe() -> None:
        if subscriber.subscription is None:
            subscriber.subscription = natsconn.deliver_inline(
                await subscriber.connection.subscribe(subscriber.subject.broker_address, queue=subscriber.queue),
                batcher.add)

    subscriber._create_subscription = subscribe  # type: ignore[method-assign]
