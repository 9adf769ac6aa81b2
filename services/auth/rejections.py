"""`credential.rejected` events: written with their batch's decisions; past an address's `auth_failure` limit its
further rejections become one event per window with a count, so that a flood does not flood the bus."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import asyncpg

from services.auth.replies import PendingCheck
from shared.events import CredentialRejected, new_event
from shared.metrics import Metrics
from shared.outbox import enqueue

log = logging.getLogger("weir.auth.check")


@dataclass
class RejectionFolding:
    """Past an address's `auth_failure` limit, its further rejections become one event per window with a count."""

    folded: dict[tuple[str, int], tuple[CredentialRejected, int]] = field(default_factory=dict)

    def fold(self, event: CredentialRejected, window_start: int) -> None:
        key = (event.client_address, window_start)
        first, count = self.folded.get(key, (event, 0))
        self.folded[key] = (first, count + event.count)

    def due(self, now: float, window_seconds: int) -> list[CredentialRejected]:
        """The folded events of windows that have ended."""
        ended = [k for k in self.folded if k[1] + window_seconds <= now]
        out = []
        for k in ended:
            first, count = self.folded.pop(k)
            out.append(first.model_copy(update={"count": count, "reason": f"{first.reason} (folded)"}))
        return out


class RejectionEvents:
    def __init__(self, pool: asyncpg.Pool, metrics: Metrics, window_seconds: int) -> None:
        self.pool = pool
        self.metrics = metrics
        self.window_seconds = window_seconds  # the auth_failure rule's
        self.folding = RejectionFolding()

    def of(self, check: PendingCheck, now: float) -> list[CredentialRejected]:
        """The request's `credential.rejected` events to write now; past the address's limit they are folded."""
        found = check.plan.rejections
        if not found:
            return []
        events = [
            CredentialRejected(credential_kind=r.kind, reason=str(r.reason), client_address=check.facts.address,
                               key_prefix=r.key_prefix, route=check.payload.request.route)
            for r in found
        ]
        self.metrics.inc("credentials_rejected_total", len(events), "rejected credentials")
        if check.past_failure_limit:
            for ev in events:
                self.folding.fold(ev, check.payload.failure_key.window_start(now))
            return []
        return events

    async def flush_due(self, now: float) -> int:
        """Write the folded events of windows ended by `now` (every window, with `now` infinite)."""
        events = self.folding.due(now, self.window_seconds)
        if events:
            await self.emit(events)
        return len(events)

    async def emit(self, events: list[CredentialRejected]) -> None:
        try:
            async with self.pool.acquire() as conn:
                await enqueue(conn, *(new_event(e, source="auth", subject=e.client_address) for e in events))
        except Exception as exc:  # the decision stands; losing a security event is logged, never silent
            log.error("credential.rejected not recorded: %s", exc)
