"""Wiring of the `auth` service: `auth.check` and the management operations over NATS, the counters, the cache."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from pydantic import ValidationError

from services.auth import manage
from services.auth.checker import SPENT_SUBJECT, Checker
from services.auth.counters import ResilientCounters, counters_from_settings
from services.auth.settings import AuthSettings
from shared.authcheck import CHECK_SUBJECT, MANAGE_PREFIX, QUEUE_GROUP, CheckRequest, ManageError
from shared.events import Envelope, MalformedEvent
from shared.runtime import Runtime, ServiceDefinition

log = logging.getLogger("weir.auth")


def _spawner(rt: Runtime, limit: int) -> Callable[[Callable[[Msg], Awaitable[None]]], Callable[[Msg], Awaitable[None]]]:
    """nats-py runs a subscription's callbacks one at a time: each message gets its own task (bounded) instead."""
    slots = asyncio.Semaphore(limit)
    tasks: set[asyncio.Task[None]] = rt.state.setdefault("tasks", set())

    def wrap(handler: Callable[[Msg], Awaitable[None]]) -> Callable[[Msg], Awaitable[None]]:
        async def run(msg: Msg) -> None:
            try:
                await handler(msg)
            except Exception:
                log.exception("handler failed on %s", msg.subject)
            finally:
                slots.release()

        async def callback(msg: Msg) -> None:
            await slots.acquire()
            task = asyncio.create_task(run(msg))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

        return callback

    return wrap


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
    spawn = _spawner(rt, settings.check_concurrency)

    async def on_check(msg: Msg) -> None:
        try:
            request = CheckRequest.model_validate_json(msg.data)
        except ValidationError as exc:
            error = ManageError(status=400, code="validation_error", detail=str(exc.errors(include_url=False))[:500])
            await msg.respond(json.dumps({"error": error.model_dump()}).encode())
            return
        reply = await checker.check(request)
        await msg.respond(reply.model_dump_json().encode())

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
            checker.cache.forget_key(key_id)

    async def on_spent(msg: Msg) -> None:
        checker.learn_spent(msg.data)  # every instance, its own included (remembering twice changes nothing)

    async def on_reconnect() -> None:
        checker.cache.clear()  # revocations may have passed while disconnected

    subs: list[Subscription] = [
        await nc.subscribe(CHECK_SUBJECT, queue=QUEUE_GROUP, cb=spawn(on_check)),
        await nc.subscribe(f"{MANAGE_PREFIX}.>", queue=QUEUE_GROUP, cb=spawn(on_manage)),
        await nc.subscribe("key.revoked", cb=on_revoked),
        await nc.subscribe(SPENT_SUBJECT, cb=on_spent),
    ]
    nc._reconnected_cb = on_reconnect  # nats-py keeps one callback; auth is its only user here
    rt.state["subs"] = subs


async def stop(rt: Runtime) -> None:
    for sub in rt.state.get("subs", []):
        await sub.unsubscribe()
    tasks = rt.state.get("tasks", set())
    if tasks:
        await asyncio.wait(list(tasks), timeout=rt.settings.shutdown_grace_seconds)
    counters: ResilientCounters | None = rt.state.get("counters")
    if counters is not None:
        await counters.close()


async def fold_rejections(rt: Runtime, stop_event: asyncio.Event) -> None:
    while "checker" not in rt.state and not stop_event.is_set():
        await asyncio.sleep(0.05)
    checker: Checker | None = rt.state.get("checker")
    if checker is not None:
        await checker.run_folding(stop_event)


SERVICE = ServiceDefinition(
    name="auth",
    settings_cls=AuthSettings,
    publishes=("credential.rejected", "key.created", "key.revoked"),
    on_start=start,
    on_stop=stop,
    background=(fold_rejections,),
    description="accounts, users, apps, keys, upload-token signing and every request-limit counter",
)
