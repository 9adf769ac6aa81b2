"""The bus's common ground: a plain nats-py connection, the headers and subjects its messages use, and small waits.

The rest of the bus, by concern: shared/outbox.py (enqueue and the relay), shared/publishers.py (the declared event
publishers), shared/consumer.py (durable consumers: ConsumerSpec, EventConsumer)."""

from __future__ import annotations

import asyncio
from typing import Any

import nats
from nats.aio.client import Client as NATS

from shared import natsconn
from shared.contracts import replay_subject
from shared.headers import *  # noqa: F403  (re-exported: the bus's users import the headers from here)
from shared.settings import CommonSettings


async def connect(settings: CommonSettings, *, name: str, **kwargs: Any) -> NATS:
    """A plain nats-py connection, for tests and benchmarks that play a server's part; services use their broker's
    connection, and tools `shared.messaging.tool_broker`."""
    servers = [s.strip() for s in settings.nats_url.split(",") if s.strip()]
    options: dict[str, Any] = {"name": f"weir-{name}", "max_reconnect_attempts": -1, "reconnect_time_wait": 0.5,
                               **natsconn.connect_options(settings, name)}
    nc: NATS = await nats.connect(servers=servers, **(options | kwargs))
    try:
        natsconn.require_tls(settings, nc)
    except natsconn.BusConfigError:
        await nc.close()
        raise
    return nc


REPLAY_ADDRESS = replay_subject("{consumer}", "{event_type}")  # the replay publisher's subject, in AsyncAPI terms


async def subscriptions_in_place(nc: NATS) -> None:
    """Returns once the server has every subscription this connection made so far: nats-py may write the first
    flush's PING ahead of a SUB still waiting for its flusher task; the second PING goes after it."""
    await nc.flush()
    await nc.flush()


async def wait_any(stop: asyncio.Event, wake: asyncio.Event | None, timeout: float) -> None:
    waiters = [asyncio.ensure_future(stop.wait())]
    if wake is not None:
        waiters.append(asyncio.ensure_future(wake.wait()))
    try:
        await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()


