"""What the stack stored, read by a test without changing it: the messages of a subject in a JetStream stream
(through an ephemeral consumer that acknowledges nothing), the events a test waits for, and objects in the bucket."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js import api as jsapi

from shared.bus import connect
from shared.events import Envelope, MalformedEvent
from shared.settings import CommonSettings
from shared.storage import s3_client
from tests.waiting import TimedOut, wait_for

FETCH_S = 5.0  # one fetch of stored messages (they are there: no waiting for new ones)
POLL_S = 0.1


async def stored_messages(js: JetStreamContext, stream: str, subject: str, *,
                          fetch_timeout: float = FETCH_S) -> list[Msg]:
    """Every message of `subject` stored in `stream` now, copies included, in stream order."""
    sub = await js.pull_subscribe(subject, stream=stream, config=jsapi.ConsumerConfig(
        ack_policy=jsapi.AckPolicy.NONE, inactive_threshold=30.0, mem_storage=True))
    try:
        pending = (await sub.consumer_info()).num_pending or 0
        found: list[Msg] = []
        while len(found) < pending:
            found += await sub.fetch(min(500, pending - len(found)), timeout=fetch_timeout)
        return found
    finally:
        await sub.unsubscribe()


async def stored_events(js: JetStreamContext, stream: str, subject: str) -> list[tuple[Msg, Envelope]]:
    """Every event of `subject` stored in `stream` now, with its message; a body that is no event (the streams are
    shared across tests, and some store garbage on purpose) is skipped."""
    found = []
    for m in await stored_messages(js, stream, subject):
        try:
            found.append((m, Envelope.from_bytes(m.data)))
        except MalformedEvent:
            continue
    return found


async def events_waited(settings: CommonSettings, stream: str, subject: str, match: Callable[[Envelope], bool], *,
                        expect: int, wait: float) -> list[dict[str, Any]]:
    """The data of each `subject` event in `stream` that `match` picks, once `expect` of them are there, else all there
    are after `wait` s (fewer: how a test shows that no second copy came)."""
    nc = await connect(settings, name="test")
    try:
        async def picked() -> list[dict[str, Any]]:
            return [e.data for _, e in await stored_events(nc.jetstream(), stream, subject) if match(e)]

        try:
            return await wait_for(picked, wait, f"{expect} {subject}", interval=POLL_S,
                                  until=lambda found: len(found) >= expect)
        except TimedOut as e:
            return e.last if isinstance(e.last, list) else []
    finally:
        await nc.close()


async def object_exists(settings: CommonSettings, key: str) -> bool:
    async with s3_client(settings) as s3:
        try:
            await s3.head_object(Bucket=settings.s3_bucket, Key=key)
            return True
        except s3.exceptions.ClientError:
            return False
