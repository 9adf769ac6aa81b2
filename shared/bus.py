"""The bus's common ground: a plain nats-py connection, the headers and subjects its messages use, and small waits.

The rest of the bus, by concern: shared/outbox.py (enqueue and the relay), shared/publishers.py (the declared event
publishers), shared/consumer.py (durable consumers: ConsumerSpec, EventConsumer)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import nats
from nats.aio.client import Client as NATS

from shared import natsconn
from shared.contracts import replay_subject
from shared.release import VERSION
from shared.settings import CommonSettings

HDR_MSG_ID = "Nats-Msg-Id"
HDR_REPROCESS = "Weir-Reprocess"
HDR_TYPE = "Weir-Type"
HDR_ERROR = "Weir-Error"
HDR_CONSUMER = "Weir-Consumer"
HDR_ORIGINAL_SUBJECT = "Weir-Original-Subject"
HDR_DELIVERIES = "Weir-Deliveries"
HDR_LEGACY_COPY = "Weir-Legacy-Copy"  # 1: a copy on the bare type of an event also on its account subject (SPEC 11)
# the sender's release (shared/release.py VERSION), on every request, reply and event Weir sends: a reader that cannot
# read a message names both releases. A message without it comes from a release before 1.1.0.
HDR_VERSION = "Weir-Version"
UNKNOWN_VERSION = "unknown"
VERSION_HEADER = {HDR_VERSION: VERSION}  # nats-py's `headers=`: copy it where a publish adds headers of its own
JSON = {"content-type": "application/json"}


def sender_version(headers: Mapping[str, str] | None) -> str:
    """The release that sent a message (its `Weir-Version` header), "unknown" for one without (before 1.1.0)."""
    return (headers or {}).get(HDR_VERSION) or UNKNOWN_VERSION


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


