"""The webhooks service's decisions as plain functions (SPEC 13): when a failed delivery is tried again, what an
attempt's outcome means for the delivery and its endpoint, which deliveries may go now (per-video order), which
endpoints an event goes to, and which secrets sign.

No I/O and no clock: `now` and the random draw of the jitter come in as parameters.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from enum import StrEnum

from shared.contracts import PUBLIC_EVENTS

from .settings import WebhookSettings

# ------------------------------------------------------------------------------------------------ the retry schedule


@dataclass(frozen=True)
class RetryPolicy:
    """SPEC 13's schedule: the wait after each failed attempt, the jitter around it, and the window it stops at."""

    intervals: tuple[timedelta, ...]
    jitter_share: float
    window: timedelta

    def __post_init__(self) -> None:
        if not self.intervals or any(i <= timedelta(0) for i in self.intervals):
            raise ValueError("retry intervals must be a non-empty list of positive waits")
        if not 0 <= self.jitter_share < 1:
            raise ValueError("the jitter share must be in [0, 1)")  # 1 could draw a wait of 0

    @classmethod
    def from_settings(cls, settings: WebhookSettings) -> RetryPolicy:
        return cls(intervals=tuple(timedelta(seconds=s) for s in settings.webhook_retry_intervals_seconds),
                   jitter_share=settings.webhook_retry_jitter_share,
                   window=timedelta(seconds=settings.webhook_retry_window_seconds))

    def interval_after(self, attempt: int) -> timedelta:
        """The wait after failed attempt `attempt` (1-based); past the list, its last interval again."""
        if attempt < 1:
            raise ValueError("attempts count from 1")
        return self.intervals[min(attempt, len(self.intervals)) - 1]


@dataclass(frozen=True)
class GiveUp:
    """The retry window is over: the delivery failed for good (it stays in the log, and can be replayed)."""


def next_attempt(policy: RetryPolicy, *, attempt: int, first_failure: datetime, now: datetime,
                 draw: float) -> datetime | GiveUp:
    """After failed attempt number `attempt` (made at `now`; the delivery's first failure at `first_failure`): when
    the next attempt is, or GiveUp.

    The wait is the policy's interval for this attempt, moved by up to `jitter_share` of itself either way (`draw`,
    uniform in [0, 1), picks where). It is never before `now`; a wait that would end past the window's end is cut to
    the window's end, so the last attempt is made right at it, and an attempt that fails at or past the end is the
    last one.
    """
    if not 0 <= draw < 1:
        raise ValueError("draw must be in [0, 1)")
    end = first_failure + policy.window
    if now >= end:
        return GiveUp()
    wait = policy.interval_after(attempt) * (1 + policy.jitter_share * (2 * draw - 1))
    return min(now + max(wait, timedelta(0)), end)


# ------------------------------------------------------------------------------ what an attempt's outcome means


class AttemptError(StrEnum):
    """Why an attempt got no HTTP status."""

    TIMEOUT = "timeout"  # no whole answer within the delivery timeout (a hanging endpoint)
    CONNECT_FAILED = "connect_failed"  # refused, reset, unreachable, TLS handshake or certificate failed
    DNS_FAILED = "dns_failed"  # the name did not resolve
    ADDRESS_REFUSED = "address_refused"  # the name resolved to an address SPEC 13 refuses (ssrf.py)
    PROTOCOL_ERROR = "protocol_error"  # the endpoint answered something that is not HTTP


@dataclass(frozen=True)
class AttemptResult:
    """One attempt as the adapter saw it: an HTTP status, or the error that stopped it."""

    status: int | None = None
    error: AttemptError | None = None

    def __post_init__(self) -> None:
        if (self.status is None) == (self.error is None):
            raise ValueError("an attempt has a status or an error, not both")


class Outcome(StrEnum):
    DELIVERED = "delivered"  # 2xx
    GONE = "gone"  # 410: the developer says this endpoint is gone; it is disabled at once
    FAILED = "failed"  # anything else: retried within the window


def judge_attempt(result: AttemptResult) -> Outcome:
    """2xx delivered; 410 gone; every other status (3xx too: no redirect is followed, so a redirect is not a
    delivery), a timeout, a failed connection or name, a refused address is a failure to retry."""
    if result.status is not None and 200 <= result.status <= 299:
        return Outcome.DELIVERED
    if result.status == 410:
        return Outcome.GONE
    return Outcome.FAILED


class DeliveryState(StrEnum):
    PENDING = "pending"  # waiting for its (next) attempt
    DELIVERED = "delivered"
    FAILED = "failed"  # given up: the window ended, or the endpoint was disabled

    @property
    def finished(self) -> bool:
        return self is not DeliveryState.PENDING


class DisableReason(StrEnum):
    GONE = "gone"  # the endpoint answered 410
    FAILING = "failing"  # every delivery failed for the disable-after period


@dataclass(frozen=True)
class AttemptDecision:
    """What one attempt changes. `disable`, when set, is the caller's to carry out with a `webhook.disabled` event
    (reason included) in the same transaction; the domain publishes nothing."""

    state: DeliveryState
    next_attempt_at: datetime | None  # when PENDING
    first_failure: datetime | None  # the delivery's first failed attempt (kept while PENDING)
    endpoint_failing_since: datetime | None  # the endpoint's first failure since its last success (None: healthy)
    disable: DisableReason | None = None


def attempt_decision(result: AttemptResult, policy: RetryPolicy, *, attempt: int, first_failure: datetime | None,
                     endpoint_failing_since: datetime | None, disable_after: timedelta, now: datetime,
                     draw: float) -> AttemptDecision:
    """The delivery's and the endpoint's next state after attempt number `attempt`, made at `now`.

    A success makes the endpoint healthy again; a 410 disables it at once; a failure schedules the next attempt or
    gives up, and disables the endpoint when it has been failing, without a success in between, for `disable_after`.
    A delivery whose endpoint is disabled is given up (a replay can send it again once the endpoint is enabled).
    """
    outcome = judge_attempt(result)
    if outcome is Outcome.DELIVERED:
        return AttemptDecision(DeliveryState.DELIVERED, None, first_failure, endpoint_failing_since=None)
    failing_since = endpoint_failing_since or now
    if outcome is Outcome.GONE:
        return AttemptDecision(DeliveryState.FAILED, None, first_failure or now, failing_since, DisableReason.GONE)
    first = first_failure or now
    if now - failing_since >= disable_after:
        return AttemptDecision(DeliveryState.FAILED, None, first, failing_since, DisableReason.FAILING)
    after = next_attempt(policy, attempt=attempt, first_failure=first, now=now, draw=draw)
    if isinstance(after, GiveUp):
        return AttemptDecision(DeliveryState.FAILED, None, first, failing_since)
    return AttemptDecision(DeliveryState.PENDING, after, first, failing_since)


# ------------------------------------------------------------------------------------------------- per-video order


@dataclass(frozen=True)
class PendingDelivery:
    """One delivery of one event to one endpoint, as the order rule needs it.

    `occurred_at` is the event's envelope time: a video's events come from several streams (api, encode, sweep), whose
    sequence numbers cannot be compared, so the order is (time, event id); the ids are UUIDv7, time-ordered too.
    """

    event_id: str
    video_id: str | None
    occurred_at: datetime
    state: DeliveryState
    due_at: datetime  # when its next attempt may be made

    @property
    def order(self) -> tuple[datetime, str]:
        return (self.occurred_at, self.event_id)


def deliverable(deliveries: Iterable[PendingDelivery], now: datetime) -> list[PendingDelivery]:
    """Of one endpoint's deliveries, those to attempt now, oldest first: for each video only its earliest unfinished
    delivery, and only once it is due (a later event of the video waits until the earlier one is delivered or given
    up, even if the later one is due first); each event without a video goes on its own."""
    return sorted((d for d in _heads(deliveries) if d.due_at <= now), key=lambda d: d.order)


def next_due(deliveries: Iterable[PendingDelivery], now: datetime) -> datetime | None:
    """When `deliverable` next has a delivery it has not now: the earliest future due time among the heads (each
    video's earliest unfinished delivery, and those without a video). None: nothing waits on time."""
    return min((d.due_at for d in _heads(deliveries) if d.due_at > now), default=None)


CAUSED_BY_SOURCE: frozenset[str] = frozenset(
    {"encode.started", "encode.progress", "encode.completed", "encode.failed"})
"""Events that follow from the video's source arriving (`upload.completed`, or a team's recording): they come on
another stream (ENCODE, not VIDEOS), read by another consumer that may be ahead."""


def first_due(event_type: str, *, source_seen: bool, now: datetime, hold: timedelta,
              settle: timedelta = timedelta(0)) -> datetime:
    """When a new delivery may first be attempted: after `settle`, except for an event caused by the video's source
    while that source's event is not received yet: it waits until the source's event comes (which makes it due then)
    or `hold` ends, so that a developer never gets `encode.started` before the `upload.completed` that caused it. A
    video whose source is a team's recording (not a public event) never has it: its events go after the hold.

    `settle` is for several instances: each reads part of a stream, so an earlier event of a video may be received
    by another instance a moment later; waiting that moment lets it take its place first (one instance: 0)."""
    if event_type in CAUSED_BY_SOURCE and not source_seen:
        return now + max(hold, settle)
    return now + settle


GATED: datetime = datetime(9999, 1, 1, tzinfo=UTC)
"""A gated delivery's due time while it waits for the durable's ack floor (its own kept in `gated_due_at`): as the
head of its video it holds back the video's later deliveries, as any delivery not due yet does."""


def gate_released(seq: int, *, floor: int | None, gated_due_at: datetime, now: datetime, longest: timedelta) -> bool:
    """Whether a delivery of the event at stream sequence `seq` may stop waiting: the durable that read it has
    acknowledged every message up to it (`floor`, its ack floor: each earlier event, whichever instance read it, is
    recorded with its deliveries), or it has waited `longest` past its due time (an earlier message that keeps
    failing, or a durable gone, holds no endpoint back for ever). `floor` None: not known now."""
    return (floor is not None and floor >= seq) or now - gated_due_at >= longest


def _heads(deliveries: Iterable[PendingDelivery]) -> list[PendingDelivery]:
    heads: dict[str, PendingDelivery] = {}
    alone: list[PendingDelivery] = []
    for d in deliveries:
        if d.state.finished:
            continue
        if d.video_id is None:
            alone.append(d)
        elif d.video_id not in heads or d.order < heads[d.video_id].order:
            heads[d.video_id] = d
    return [*alone, *heads.values()]


# ------------------------------------------------------------------------------------------------ subscriptions

WEBHOOK_DISABLED = "webhook.disabled"  # published by this service; to be declared in shared/events with the service

SUBSCRIBABLE: frozenset[str] = frozenset(PUBLIC_EVENTS | {WEBHOOK_DISABLED})
"""The event types an endpoint may name: the public events (SPEC 12, those an app's developer may read) and the
service's own. Credential and key events stay internal."""

ALL_EVENTS = "*"
WILDCARD_SUFFIX = ".*"


class InvalidSubscription(ValueError):
    """An endpoint's `events` list names something no event type matches; `entry` is the offending item."""

    def __init__(self, entry: str, reason: str) -> None:
        super().__init__(f"{entry!r}: {reason}")
        self.entry = entry
        self.reason = reason


def validate_subscription(events: Sequence[str], known: frozenset[str] = SUBSCRIBABLE) -> tuple[str, ...]:
    """An endpoint's `events` list, checked and normalised (sorted, without repeats).

    Each entry is an exact type (`video.created`), `*` (every type, including those added later), or a prefix
    wildcard `<prefix>.*` (`video.*`, `encode.*`: every type under that prefix, including later ones). A type or
    prefix that matches none of `known` is refused, so a typo fails at once instead of never delivering; so is an
    empty list (say `*` to receive everything).
    """
    if not events:
        raise InvalidSubscription("", "name at least one event type, or * for all")
    for entry in events:
        if entry == ALL_EVENTS:
            continue
        if entry.endswith(WILDCARD_SUFFIX):
            prefix = entry[: -len(WILDCARD_SUFFIX)]
            if not prefix or "*" in prefix or not any(t.startswith(prefix + ".") for t in known):
                raise InvalidSubscription(entry, "no event type has this prefix")
        elif "*" in entry:
            raise InvalidSubscription(entry, "a wildcard is only `*` or `<prefix>.*`")
        elif entry not in known:
            raise InvalidSubscription(entry, "not an event type an endpoint can receive")
    return tuple(sorted(set(events)))


def subscribed(events: Iterable[str], event_type: str) -> bool:
    """Whether an endpoint with this (validated) `events` list receives `event_type`."""
    for entry in events:
        if entry in (ALL_EVENTS, event_type):
            return True
        if entry.endswith(WILDCARD_SUFFIX) and event_type.startswith(entry[:-1]):  # keeps the dot: video. not videos
            return True
    return False


@dataclass(frozen=True)
class Endpoint:
    id: str
    app_id: str
    events: tuple[str, ...]
    enabled: bool = True


def endpoints_for(event_type: str, app_id: str, endpoints: Iterable[Endpoint]) -> list[str]:
    """The ids of the enabled endpoints of the event's app that subscribe to its type."""
    return [e.id for e in endpoints if e.enabled and e.app_id == app_id and subscribed(e.events, event_type)]


# ---------------------------------------------------------------------------------------------- secret rotation


@dataclass(frozen=True)
class EndpointSecrets:
    """An endpoint's signing secrets: the current one, and those rotated out that still sign until their time."""

    current: str
    retiring: tuple[tuple[str, datetime], ...] = field(default=())  # (secret, signs until), newest first


def rotate_secret(secrets: EndpointSecrets, new: str, *, now: datetime, overlap: timedelta) -> EndpointSecrets:
    """`new` becomes current; the old current signs beside it for `overlap`. Secrets rotated out earlier keep their
    own end (a second rotation within the overlap does not cut short the receivers still on the first secret);
    those past their end are dropped."""
    still = tuple((s, until) for s, until in secrets.retiring if until > now)
    return EndpointSecrets(current=new, retiring=((secrets.current, now + overlap), *still))


def signing_secrets(secrets: EndpointSecrets, now: datetime) -> tuple[str, ...]:
    """The secrets a delivery made at `now` is signed with: the current first, then each retiring one before its
    end (Standard Webhooks: the receiver accepts the message if any signature matches)."""
    return (secrets.current, *(s for s, until in secrets.retiring if until > now))
