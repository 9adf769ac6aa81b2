"""Every part of the view read at once, each within its timeout and never raising."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from datetime import UTC, datetime

from shared.settings import CommonSettings
from weir.status.bus import read_bus
from weir.status.database import read_database
from weir.status.limits import read_limits
from weir.status.model import Snapshot, Unavailable
from weir.status.services import read_services
from weir.status.shedding import read_shedding
from weir.status.throttled import read_throttled


async def read_snapshot(settings: CommonSettings, services: Mapping[str, str] | Unavailable, *,
                        heartbeat_timeout_seconds: float, webhook_late_after_seconds: float,
                        timeout: float, throttled_top: int = 10) -> Snapshot:
    """Every part at once; each read waits at most about `timeout` s and never raises. A webhook delivery that may go
    and has waited longer than `webhook_late_after_seconds` says that delivering falls behind. Who is throttled is
    asked with `settings.internal_token` (not read without one); `throttled_top` of the most refused are shown."""
    checked_at = datetime.now(UTC)
    addresses: Mapping[str, str] = {} if isinstance(services, Unavailable) else services
    ready, limits, shedding, throttled, bus, database = await asyncio.gather(
        read_services(addresses, timeout),
        read_limits(addresses, timeout),
        read_shedding(addresses, timeout),
        read_throttled(addresses, timeout, settings.internal_token.get_secret_value()),
        read_bus(settings, timeout),
        read_database(settings.database_url, heartbeat_timeout_seconds, timeout, webhook_late_after_seconds),
    )
    return Snapshot(
        checked_at=checked_at, services=services if isinstance(services, Unavailable) else ready,
        streams=bus.streams, consumers=bus.consumers, dlq=bus.dlq, outbox=database.outbox, farm=database.farm,
        limits=services if isinstance(services, Unavailable) else limits, sweep=database.sweep,
        shedding=services if isinstance(services, Unavailable) else shedding, webhooks=database.webhooks,
        throttled=services if isinstance(services, Unavailable) and throttled is not None else throttled,
        throttled_top=throttled_top,
    )
