"""Wiring of the `auth` service: `auth.check` and the management operations over NATS, the counters, the cache."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from services.auth import manage
from services.auth.checker import SPENT_SUBJECT, Checker
from services.auth.counters import ResilientCounters, counters_from_settings
from services.auth.settings import AuthSettings
from shared.authcheck import CHECK_SUBJECT, MANAGE_PREFIX, QUEUE_GROUP, ManageError
from shared.bus import subscriptions_in_place
from shared.events import Envelope, MalformedEvent
from shared.natswire import WireConnection, open_wire, state_metric
from shared.runtime import Runtime, ServiceDefinition, task_per_message

log = logging.getLogger("weir.auth")


Respond = Callable[[bytes, bytes], Awaitable[None] | None]  # (reply subject, body)


class CheckBatcher:
    """`auth.check` messages are decided in batches: whatever arrived while the last batch was being decided.

    Under load a batch grows, and its cost per request shrinks (one store increment per counter for the batch, no
    task per message); when idle, a batch is one request and waits for nothing. Messages come as (reply subject,
    payload) pairs, all that one read of the connection brought at once (`add_many`, from shared/natswire.py), or
    one nats-py message at a time (`add`, where the lean connection cannot be used); `respond` sends an answer.
    """

    def __init__(self, checker: Checker, max_batch: int, respond: Respond, in_flight: int = 4) -> None:
        self.checker = checker
        self.max_batch = max_batch
        self.respond = respond
        self.pending: list[tuple[bytes, bytes]] = []
        self.slots = in_flight
        self.running: set[asyncio.Task[None]] = set()

    def add_many(self, messages: list[tuple[bytes, bytes]]) -> None:
        self.pending += messages
        if len(self.running) < self.slots:
            task = asyncio.ensure_future(self._run())
            self.running.add(task)
            task.add_done_callback(self.running.discard)

    async def add(self, msg: Msg) -> None:
        self.add_many([((msg.reply or "").encode(), msg.data)])

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

    async def _decide(self, batch: list[tuple[bytes, bytes]]) -> None:
        replies = await self.checker.check_payloads([data for _, data in batch])
        for (reply, _), body in zip(batch, replies, strict=True):
            if reply:  # the lean connection's respond returns None: no coroutine per answer on this path
                sent = self.respond(reply, body)
                if sent is not None:
                    await sent

    async def _send(self, reply: bytes, body: bytes) -> None:
        if reply:  # a request without a reply subject gets nothing, as with nats-py
            sent = self.respond(reply, body)
            if sent is not None:
                await sent

    async def _fail(self, batch: list[tuple[bytes, bytes]]) -> None:
        """A batch that could not be decided is answered at once, so callers do not wait out their timeout."""
        error = ManageError(status=503, code="unavailable", detail="auth could not decide this request; retry")
        body = json.dumps({"error": error.model_dump()}).encode()
        for reply, _ in batch:
            with contextlib.suppress(Exception):
                await self._send(reply, body)

    async def drain(self, timeout: float) -> None:
        if self.running:
            await asyncio.wait(list(self.running), timeout=timeout)


async def start(rt: Runtime) -> None:
    settings = rt.settings
    assert isinstance(settings, AuthSettings)
    nc, _, pool = rt.require()
    counters = counters_from_settings(nc, settings, metrics=rt.metrics)
    async def broadcast(payload: bytes) -> None:
        await nc.publish(SPENT_SUBJECT, payload)

    checker = Checker(settings, pool, counters, metrics=rt.metrics, counter_mode=lambda: counters.mode,
                      broadcast=broadcast)
    rt.state.update(checker=checker, counters=counters)
    spawn = task_per_message(rt, settings.check_concurrency)

    # auth.check over the lean connection where it can serve (one read's messages in one batch, no task steps
    # per message); otherwise over nats-py like everything else
    name = f"{rt.definition.name}.check"
    wire = await open_wire(settings.nats_url, name=name, enabled=settings.nats_lean_check,
                           on_state=state_metric(rt.metrics, name))
    if wire is not None and not wire.is_connected:  # nats-py is connected (start needs it): serve over it
        await wire.close()
        wire = None
    if wire is not None:
        batcher = CheckBatcher(checker, settings.check_concurrency, respond=wire.publish)
    else:
        batcher = CheckBatcher(checker, settings.check_concurrency,
                               respond=lambda reply, body: nc.publish(reply.decode(), body))
    rt.state.update(batcher=batcher, wire=wire)

    async def on_manage(msg: Msg) -> None:
        op = msg.subject[len(MANAGE_PREFIX) + 1 :]
        await msg.respond(json.dumps(await manage.handle(checker, op, msg.data)).encode())

    async def on_revoked(msg: Msg) -> None:
        # every instance hears every revocation (no queue group): the cached key is gone at once
        try:
            key_id = Envelope.from_bytes(msg.data).data.get("key_id")
        except MalformedEvent:
            return
        if isinstance(key_id, str):
            checker.forget_key(key_id)

    async def on_spent(msg: Msg) -> None:
        checker.learn_spent(msg.data)  # every instance, its own included (remembering twice changes nothing)

    async def on_reconnect() -> None:
        checker.forget_all()  # revocations may have passed while disconnected

    subs: list[Subscription] = [
        await nc.subscribe(f"{MANAGE_PREFIX}.>", queue=QUEUE_GROUP, cb=spawn(on_manage)),
        await nc.subscribe("key.revoked", cb=on_revoked),
        await nc.subscribe(SPENT_SUBJECT, cb=on_spent),
    ]
    nc._reconnected_cb = on_reconnect  # nats-py keeps one callback; auth is its only user here
    if wire is not None:
        rt.state["wire_sid"] = wire.subscribe(CHECK_SUBJECT, batcher.add_many, queue=QUEUE_GROUP)
        await wire.flush()
    else:
        subs.append(await nc.subscribe(CHECK_SUBJECT, queue=QUEUE_GROUP, cb=batcher.add))
    rt.state["subs"] = subs
    await subscriptions_in_place(nc)  # the server has them before /readyz says ready


async def stop(rt: Runtime) -> None:
    wire: WireConnection | None = rt.state.get("wire")
    if wire is not None and "wire_sid" in rt.state:
        wire.unsubscribe(rt.state["wire_sid"])
    for sub in rt.state.get("subs", []):
        await sub.unsubscribe()
    batcher: CheckBatcher | None = rt.state.get("batcher")
    if batcher is not None:
        await batcher.drain(rt.settings.shutdown_grace_seconds)
    if wire is not None:
        await wire.close()  # after the drain: its answers go out on it
    tasks = rt.state.get("tasks", set())
    if tasks:
        await asyncio.wait(list(tasks), timeout=rt.settings.shutdown_grace_seconds)
    checker: Checker | None = rt.state.get("checker")
    if checker is not None:
        try:
            await asyncio.wait_for(checker.close(), timeout=rt.settings.shutdown_grace_seconds)
        except Exception as exc:  # what was not given back stays counted: over, never under
            log.warning("leased counts not given back at shutdown: %s", exc)
    counters: ResilientCounters | None = rt.state.get("counters")
    if counters is not None:
        await counters.close()


async def _checker(rt: Runtime, stop_event: asyncio.Event) -> Checker | None:
    while "checker" not in rt.state and not stop_event.is_set():
        await asyncio.sleep(0.05)
    checker: Checker | None = rt.state.get("checker")
    return checker


async def fold_rejections(rt: Runtime, stop_event: asyncio.Event) -> None:
    checker = await _checker(rt, stop_event)
    if checker is not None:
        await checker.run_folding(stop_event)


async def give_back_idle_leases(rt: Runtime, stop_event: asyncio.Event) -> None:
    checker = await _checker(rt, stop_event)
    if checker is not None:
        await checker.leases.run(stop_event)


SERVICE = ServiceDefinition(
    name="auth",
    settings_cls=AuthSettings,
    publishes=("credential.rejected", "key.created", "key.revoked"),
    on_start=start,
    on_stop=stop,
    background=(fold_rejections, give_back_idle_leases),
    description="accounts, users, apps, keys, upload-token signing and every request-limit counter",
)
