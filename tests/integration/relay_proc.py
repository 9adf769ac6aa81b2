"""A relay in its own process that kills itself (SIGKILL) at a chosen point, as a crash would.

python -m tests.integration.relay_proc DSN NATS_URL SCHEMA after_select|after_publish [table|wal]
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import asyncpg

from shared import db
from shared.events import ALL_TYPES
from shared.messaging import make_broker
from shared.outbox import OutboxRelay
from shared.publishers import EventPublishers
from shared.settings import CommonSettings
from shared.walrelay import SlotStream, WalRelay


class DieAt:
    def __init__(self, point: str) -> None:
        self.point = point

    async def after_select(self, ids: list[str]) -> None:
        if self.point == "after_select":
            os.kill(os.getpid(), signal.SIGKILL)

    async def after_publish(self, ids: list[str]) -> None:
        if self.point == "after_publish":
            os.kill(os.getpid(), signal.SIGKILL)


async def main(dsn: str, nats_url: str, schema: str, point: str, transport: str = "table") -> None:
    settings = CommonSettings(nats_url=nats_url, database_url=dsn)
    broker = make_broker(settings, name="relay-proc")  # as a service's relay: through the broker's publishers
    await broker.connect()
    publishers = EventPublishers(broker, ALL_TYPES, timeout=settings.bus_publish_timeout_seconds)
    await broker.start()
    pool = await db.create_pool(dsn, schema=schema)
    relay = OutboxRelay(pool=pool, publishers=publishers, dsn=dsn, schema=schema, hooks=DieAt(point))
    if transport == "wal":  # the slot's reader: the same points, before it advances the slot
        conn = await asyncpg.connect(dsn)
        wal = WalRelay(dsn=dsn, schema=schema, table=relay, hooks=DieAt(point))
        await wal.catch_up(await SlotStream.open(dsn, wal.slot), conn, 10.0)
    else:
        await relay.drain_once()
    sys.exit("the relay was meant to die before this line")


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:6]))
