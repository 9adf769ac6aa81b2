"""Replay: re-deliver a time slice of a stream to one consumer (or to every consumer of that subject).

An ephemeral consumer reads from `since` to `until` (or the stream's last message when the replay began); each
message is republished on `replay.<consumer>.<type>`, which the target consumer reads beside its main stream, through
a FastStream publisher, counted delivered once JetStream acknowledges it. The inbox keeps handled events handled
unless `reprocess`. A copy keeps its original `traceparent`; its handler (and, when tracing, a `replay <type>` span
here) starts a new span linked to that trace.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

import uuid6
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError
from opentelemetry.trace import Link, Span, SpanKind

from shared import tracing
from shared.bus import HDR_LEGACY_COPY, HDR_ORIGINAL_SUBJECT, HDR_REPROCESS, HDR_TYPE, HDR_VERSION, sender_version
from shared.contracts import (
    REPLAY_STREAM,
    ContractError,
    contract,
    events_on,
    origin_of,
    replay_durable,
    replay_subject,
)
from shared.publishers import EventPublishers, Outgoing
from shared.streamread import stream_batches


class ReplayError(Exception):
    pass


HandledCount = Callable[[str, list[str]], Awaitable[int | None]]
"""`handled(consumer, event ids)`: how many of these the consumer has handled (None: it cannot be told)."""


@dataclass
class ReplayReport:
    replay_id: str
    stream: str
    subject: str
    since: datetime
    until: datetime | None
    consumers: list[str]
    matched: int = 0
    delivered: dict[str, int] = field(default_factory=dict)
    first_seq: int | None = None
    last_seq: int | None = None
    dry_run: bool = False
    handled: dict[str, int] = field(default_factory=dict)  # dry run: of the slice, what each consumer handled
    no_replays: list[str] = field(default_factory=list)  # readers of the subject that take no replays (skipped)
    unknown: list[str] = field(default_factory=list)  # dry run: consumers whose handled events could not be told

    def would_apply(self, consumer: str, reprocess: bool = False) -> int | None:
        """Of the slice, what the consumer would apply (None: its inbox could not be asked)."""
        if consumer in self.unknown:
            return None
        return self.matched if reprocess else self.matched - self.handled.get(consumer, 0)


async def consumers_for(js: JetStreamContext, stream: str, subject: str) -> list[str]:
    """Durable consumers of `stream` whose filter takes `subject` (replay consumers excluded)."""
    names: list[str] = []
    for info in await js.consumers_info(stream):
        cfg = info.config
        if not cfg.durable_name:
            continue
        filters = cfg.filter_subjects or ([cfg.filter_subject] if cfg.filter_subject else [">"])
        wanted = slice_subjects(subject)
        if any(subjects_overlap(f, s) for f in filters for s in wanted):
            names.append(cfg.durable_name)
    return sorted(names)


def subjects_overlap(a: str, b: str) -> bool:
    """Whether some subject matches both NATS patterns: `video.created.*` (every account's) and a team's `*.*.<id>`
    share `video.created.<id>`, though neither pattern contains the other."""
    ta, tb = a.split("."), b.split(".")
    for i in range(min(len(ta), len(tb))):
        x, y = ta[i], tb[i]
        if x == ">" or y == ">":
            return True  # the other has a token here, and `>` takes it and the rest
        if x != y and "*" not in (x, y):
            return False
    return len(ta) == len(tb)


async def takes_replays(js: JetStreamContext, consumer: str) -> bool:
    """Whether the consumer reads its replay subject (its `<name>_replay` durable exists): a copy for a consumer
    without one (an operator-made publisher's durable) would wait in REPLAY for nobody."""
    try:
        await js.consumer_info(REPLAY_STREAM, replay_durable(consumer))
    except NotFoundError:
        return False
    return True


def check_slice(stream: str, subject: str, since: datetime, until: datetime | None) -> None:
    """A slice that cannot select anything is a mistake, said before anything is read: a subject no event contract
    has, an event type kept on another stream, an end before the start."""
    if until is not None and _ns(until) < _ns(since):
        raise ReplayError(f"--until ({until.isoformat()}) is before --since ({since.isoformat()})")
    found = origin_of(subject)
    if found is None:
        on = events_on(stream)
        raise ReplayError(f"{subject!r} is no event type nor an event's subject"
                          + (f" (the subjects on {stream}: {', '.join(on)})" if on else ""))
    kept_on = contract(found[0]).stream
    if kept_on != stream:
        raise ReplayError(f"{found[0]} events are on stream {kept_on}, not {stream}")


def slice_subjects(subject: str) -> list[str]:
    """What `--subject` selects: an event type means all of its subjects (every account's, and the bare type of
    the release before); anything else (`video.created.<account>`: one account's) as given."""
    try:
        return list(contract(subject).subjects)
    except ContractError:
        return [subject]


def _ns(dt: datetime) -> datetime:
    return dt if dt.tzinfo else dt.replace(tzinfo=UTC)


async def replay(
    publishers: EventPublishers,
    *,
    stream: str,
    subject: str,
    since: datetime,
    until: datetime | None = None,
    to: list[str] | None = None,
    dry_run: bool = False,
    reprocess: bool = False,
    progress: Callable[[int, int], None] | None = None,
    fetch_batch: int = 256,
    handled: HandledCount | None = None,
) -> ReplayReport:
    """Replay the slice through `publishers` (made with `replay=True`, on a connected broker). A dry run with
    `handled` counts, per target consumer, the events of the slice it has handled already (its inbox)."""
    js = publishers.broker.connection.jetstream()
    since, until = _ns(since), (_ns(until) if until else None)
    try:
        info = await js.stream_info(stream)
    except NotFoundError as exc:
        raise ReplayError(f"no stream {stream!r}") from exc
    check_slice(stream, subject, since, until)
    known = await consumers_for(js, stream, subject)
    taking = [c for c in known if await takes_replays(js, c)]
    if to:
        unknown = [c for c in to if c not in {i.config.durable_name for i in await js.consumers_info(stream)}]
        if unknown:
            raise ReplayError(f"no consumer {', '.join(unknown)} on stream {stream}")
        for c in to:
            if c not in known:
                raise ReplayError(f"{c} does not read {subject} (its readers on {stream}: "
                                  f"{', '.join(taking) or 'none'})")
            if c not in taking:
                raise ReplayError(f"{c} takes no replays (no {replay_durable(c)} on {REPLAY_STREAM}): a copy would "
                                  "wait for nobody")
        targets = list(to)
    else:
        targets = taking
    if not targets and not dry_run:
        raise ReplayError(f"no consumer of {subject!r} on stream {stream} takes replays")
    report = ReplayReport(
        replay_id=str(uuid6.uuid7()), stream=stream, subject=subject, since=since, until=until,
        consumers=targets, dry_run=dry_run, delivered={t: 0 for t in targets},
        no_replays=[c for c in known if c not in taking and not to],
    )
    last_seq = info.state.last_seq
    if info.state.messages == 0:
        return report

    # the slice ends where the stream ended when the replay began: a live stream does not extend it
    filters = slice_subjects(subject)
    seen = 0
    async for msgs, total in stream_batches(js, stream, filters, last_seq=last_seq, since=since, batch=fetch_batch):
        copies: list[tuple[str, Outgoing]] = []
        ids: list[str] = []
        done = False
        for msg in msgs:
            meta = msg.metadata
            seen += 1
            if until is not None and _ns(meta.timestamp) > until:
                done = True
                break
            report.matched += 1
            report.first_seq = report.first_seq or meta.sequence.stream
            report.last_seq = meta.sequence.stream
            if msg.headers and msg.headers.get(HDR_LEGACY_COPY) == "1":
                report.matched -= 1  # the event itself is in the slice, on its account subject
                continue
            if dry_run:
                event_id = _event_id(msg.data)
                if event_id is not None:
                    ids.append(event_id)
                continue
            found = origin_of(msg.subject)
            event_type = found[0] if found is not None else msg.subject
            headers = {HDR_TYPE: event_type, HDR_REPROCESS: "1" if reprocess else "0",
                       HDR_ORIGINAL_SUBJECT: msg.subject,  # who published it (a team's account, its name)
                       HDR_VERSION: sender_version(msg.headers)}  # the release that wrote it, not replay's
            copies += [
                (target, Outgoing(replay_subject(target, event_type), msg.data,
                                  f"replay-{report.replay_id}-{target}-{meta.sequence.stream}", headers,
                                  span=_copy_span(msg.data, event_type, target, report.replay_id)))
                for target in targets
            ]
        await _deliver(publishers, copies, report)
        if dry_run and handled is not None:
            await _count_handled(handled, targets, ids, report)
        if progress:
            progress(seen, total)
        if done:
            break
    return report


async def _count_handled(handled: HandledCount, targets: list[str], ids: list[str], report: ReplayReport) -> None:
    for target in targets:
        if target in report.unknown:
            continue
        found = await handled(target, ids) if ids else 0
        if found is None:
            report.unknown.append(target)
        else:
            report.handled[target] = report.handled.get(target, 0) + found


def _event_id(data: bytes) -> str | None:
    try:
        envelope = json.loads(data)
    except ValueError:
        return None
    found = envelope.get("id") if isinstance(envelope, dict) else None
    return found if isinstance(found, str) else None


async def _deliver(publishers: EventPublishers, copies: list[tuple[str, Outgoing]], report: ReplayReport) -> None:
    """Publish one fetched batch's copies in order; each counts delivered once JetStream acknowledged it. A copy it
    did not take (no REPLAY stream, no PubAck in time) ends the replay, saying how far it got."""
    if not copies:
        return
    spans = [copy.span for _, copy in copies if copy.span is not None]
    try:
        results = await publishers.publish_in_order([copy for _, copy in copies])
    except BaseException:
        for span in spans:
            span.end()
        raise
    failed: tuple[Outgoing, BaseException] | None = None
    for (target, copy), result in zip(copies, results, strict=True):
        if isinstance(result, BaseException):
            failed = failed or (copy, result)
            if copy.span is not None:
                tracing.failed(copy.span, result)
        else:
            report.delivered[target] += 1
    for span in spans:
        span.end()
    if failed is not None:
        copy, error = failed
        raise ReplayError(f"JetStream did not take the copy on {copy.subject} ({error!r}); delivered: "
                          + ", ".join(f"{n} to {c}" for c, n in report.delivered.items())) from error


def _copy_span(data: bytes, event_type: str, target: str, replay_id: str) -> Span | None:
    """With tracing on: the span a copy is published under, linked to the trace of the work that wrote the event."""
    if not tracing.enabled():
        return None
    try:
        envelope = json.loads(data)
    except ValueError:
        envelope = {}
    traceparent = envelope.get("traceparent") if isinstance(envelope, dict) else None
    subject = envelope.get("subject") if isinstance(envelope, dict) else None
    original = tracing.span_context_of(traceparent if isinstance(traceparent, str) else None)
    return tracing.start_span(
        f"replay {event_type}", video_id=tracing.video_id_of(event_type, subject) if isinstance(subject, str) else None,
        attributes={"weir.replay_id": replay_id, "messaging.consumer.group.name": target},
        links=[Link(original, {tracing.REPLAYED_FROM: str(traceparent)})] if original else None,
        kind=SpanKind.PRODUCER,
    )
