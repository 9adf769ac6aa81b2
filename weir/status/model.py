"""What `weir status` read, as plain data: each part is its value, or Unavailable with the reason it could not
be read."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from shared.release import FIRST_WITH_VERSION_ROUTE

if TYPE_CHECKING:
    from services.auth.throttled import ThrottledReport

# how an instance that has no `GET /version` (404: a release before the route) is shown
NO_VERSION_ROUTE = f"before {FIRST_WITH_VERSION_ROUTE} (no /version)"


@dataclass(frozen=True)
class Unavailable:
    """A figure that could not be read, and why (a service down, the database unreachable, a missing stream)."""

    reason: str


@dataclass(frozen=True)
class InstanceRelease:
    """The release an instance runs, from its `GET /version`; version None: it has no such route (404), so it runs a
    release before FIRST_WITH_VERSION_ROUTE."""

    version: str | None
    commit: str | None = None
    service: str | None = None  # the name it gives itself
    dirty: bool | None = None  # it runs changes not in its commit (None: not known, or a release without the field)

    @property
    def label(self) -> str:
        return self.version or NO_VERSION_ROUTE


@dataclass(frozen=True)
class Readiness:
    url: str
    ready: bool
    status: int | None = None  # the HTTP status of /readyz; None when it did not answer
    checks: dict[str, str] = field(default_factory=dict)
    reason: str | None = None  # why it is not ready
    release: InstanceRelease | Unavailable | None = None  # its /version; None: not asked


@dataclass(frozen=True)
class StreamState:
    name: str
    messages: int
    bytes: int
    consumers: int


@dataclass(frozen=True)
class ConsumerState:
    stream: str
    name: str
    pending: int  # in the stream and not yet delivered to the consumer
    ack_pending: int  # delivered, not yet acknowledged
    redelivered: int  # delivered more than once and not yet acknowledged
    waiting: int  # pull requests waiting for messages


@dataclass(frozen=True)
class Backlog:
    unsent: int
    oldest_seconds: float | None  # age of the oldest unsent row; None when nothing waits


@dataclass(frozen=True)
class WorkerRow:
    """One worker as encode's table knows it: its last heartbeat's slots, and the outputs encoding on it."""

    name: str
    instance: str
    slots: int
    busy: int
    seen_seconds_ago: float
    leaving: bool


@dataclass(frozen=True)
class Farm:
    workers: tuple[WorkerRow, ...]  # live: heard within the heartbeat timeout and not leaving
    leaving: tuple[WorkerRow, ...]  # heard within the timeout, taking no more offers (SIGTERM)
    heartbeat_timeout_seconds: float

    @property
    def slots(self) -> int:
        return sum(w.slots for w in self.workers)

    @property
    def busy(self) -> int:
        return sum(w.busy for w in self.workers)


@dataclass(frozen=True)
class Shedding:
    """An api or auth instance's shedding: refusals by priority since it started; the api's limit and load now."""

    shed: dict[str, int]
    limit: float | None = None
    in_flight: float | None = None
    waiting: float | None = None
    auth_overloaded: int | None = None  # the api's requests answered 503 because auth shed their check

    @property
    def total(self) -> int:
        return sum(self.shed.values())


@dataclass(frozen=True)
class WebhookDeliveries:
    """The webhooks service's endpoints and deliveries (its schema). `due`: pending deliveries that may go now (not
    waiting for a retry, not in flight) to enabled endpoints that are not failing, which a working deliverer sends
    within `late_after_seconds`; the oldest of them waiting longer says that delivering falls behind."""

    enabled: int
    disabled: int
    failing: int  # enabled, and failing since their last success
    pending: int
    oldest_pending_seconds: float | None
    due: int
    oldest_due_seconds: float | None
    failed_last_hour: int  # deliveries given up in the last hour (their retry window over, or the endpoint disabled)
    late_after_seconds: float

    @property
    def falling_behind(self) -> bool:
        return self.oldest_due_seconds is not None and self.oldest_due_seconds > self.late_after_seconds


@dataclass(frozen=True)
class Snapshot:
    """Everything `weir status` read at `checked_at`; each part is its value or Unavailable."""

    checked_at: datetime
    services: dict[str, Readiness] | Unavailable
    streams: dict[str, StreamState | Unavailable] | Unavailable
    consumers: dict[str, list[ConsumerState] | Unavailable] | Unavailable  # by stream
    dlq: dict[str, int] | Unavailable
    outbox: dict[str, Backlog | Unavailable] | Unavailable  # by service
    farm: Farm | Unavailable
    limits: dict[str, str | Unavailable] | Unavailable  # mode by auth instance
    sweep: dict[str, Any] | Unavailable | None  # the last run (services/sweep/trigger.py report_to_json), or None
    shedding: dict[str, Shedding | Unavailable] | Unavailable  # by api and auth instance
    webhooks: WebhookDeliveries | Unavailable | None = None  # None: not read
    # who is throttled, by auth instance (services/auth/throttled.py); None: not read (no internal token to ask with)
    throttled: dict[str, ThrottledReport | Unavailable] | Unavailable | None = None
    throttled_top: int = 10  # how many of the most refused callers are shown


def reason_of(exc: BaseException) -> str:
    """An error as one short line: its type, and its message when it has one."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    name = type(exc).__name__
    return (f"{name}: {text}" if text else name)[:300]
