"""`natsconn.publish_many` (auth's answers to a batch of auth.check requests, one write for the batch) on the real
nats-server: every message arrives, in order, byte for byte; what nats-py's `publish` refuses it refuses, before
anything of the batch is sent; a closed connection refuses."""

from __future__ import annotations

import asyncio

import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import BadSubjectError, ConnectionClosedError, MaxPayloadError

from shared.bus import connect, subscriptions_in_place
from shared.natsconn import publish_many
from shared.settings import CommonSettings

PAYLOADS = [b"", b"x", b"line\r\nPUB fake 1\r\n", bytes(range(256)), b"{}" * 5000]


async def heard_on(nc: NATS, prefix: str) -> tuple[list[Msg], asyncio.Event]:
    got: list[Msg] = []
    done = asyncio.Event()

    async def keep(msg: Msg) -> None:
        got.append(msg)
        if len(got) == len(PAYLOADS):
            done.set()

    await nc.subscribe(f"{prefix}.>", cb=keep)
    await subscriptions_in_place(nc)
    return got, done


async def test_every_message_arrives_in_order_byte_for_byte(nc: NATS) -> None:
    got, done = await heard_on(nc, "pm.order")  # the connection hears what it publishes (no_echo is off)
    before = nc.stats["out_msgs"]
    await publish_many(nc, [(f"pm.order.{i}", p) for i, p in enumerate(PAYLOADS)])
    async with asyncio.timeout(5):
        await done.wait()
    assert [(m.subject, m.data) for m in got] == [(f"pm.order.{i}", p) for i, p in enumerate(PAYLOADS)]
    assert nc.stats["out_msgs"] - before == len(PAYLOADS)
    await publish_many(nc, [])  # nothing to send: nothing sent, no error


@pytest.mark.parametrize(("subject", "payload", "error"), [
    ("pm.bad subject", b"x", BadSubjectError),
    ("pm.bad\r\nPUB x 0", b"x", BadSubjectError),
    ("", b"x", BadSubjectError),
    ("pm.big.1", None, MaxPayloadError),
])
async def test_a_refused_message_refuses_the_batch_before_anything_is_sent(
        nc: NATS, subject: str, payload: bytes | None, error: type[Exception]) -> None:
    got, _ = await heard_on(nc, "pm")
    body = payload if payload is not None else b"x" * (nc.max_payload + 1)
    with pytest.raises(error):
        await publish_many(nc, [("pm.first", b"ok"), (subject, body), ("pm.last", b"ok")])
    await subscriptions_in_place(nc)  # a round trip: anything sent would have arrived by now
    assert got == []


async def test_a_closed_connection_refuses(prepared: CommonSettings) -> None:
    closed = await connect(prepared, name="test")
    await closed.close()
    with pytest.raises(ConnectionClosedError):
        await publish_many(closed, [("pm.closed", b"x")])
