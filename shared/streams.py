"""The one declaration of Weir's JetStream streams, applied by `weir streams apply` (and `weir up`).

Services never declare streams on start-up: with independent deploys the last one to start would win.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from nats.js import JetStreamContext, api
from nats.js.errors import APIError, NotFoundError

from shared.contracts import (
    AUTH_STREAM,
    COUNTER_SUBJECTS,
    DLQ_STREAM,
    DLQ_SUBJECTS,
    ENCODE_STREAM,
    EVENTS,
    LIMITS_STREAM,
    RECORDINGS_STREAM,
    REPLAY_STREAM,
    REPLAY_SUBJECTS,
    VIDEOS_STREAM,
    WEBHOOKS_STREAM,
    contract,
    events_on,
)
from shared.publishersubjects import PUBLIC_STREAMS
from shared.settings import CommonSettings


@dataclass(frozen=True)
class StreamSpec:
    name: str
    subjects: tuple[str, ...]
    description: str
    max_age_seconds: int | None = None  # None: the setting `stream_max_age_seconds`
    extra: dict[str, object] = field(default_factory=dict)


def event_stream(name: str, description: str) -> StreamSpec:
    """A stream of the event types shared/contracts.py puts on it. One that holds public events answers direct gets
    (`allow_direct`): a publisher-like identity (an outside team) may read the last event of one of its own subjects
    so (`$JS.API.DIRECT.GET.<stream>.<subject>`, its rights in shared/identities.py `publisher_like`), and without
    it nats-server has no responder for the request. Applied to a stream that exists, it changes in place."""
    return StreamSpec(name, events_on(name), description,
                      extra={"allow_direct": True} if name in PUBLIC_STREAMS else {})


# Event streams by domain: each keeps the event types shared/contracts.py puts on it (one subject per type, so
# that `encode.status`, a core request/reply, is never stored).
STREAMS: tuple[StreamSpec, ...] = (
    event_stream(AUTH_STREAM, "credentials and keys"),
    event_stream(VIDEOS_STREAM, "videos and their uploads"),
    event_stream(RECORDINGS_STREAM, "first-party recordings to encode"),
    event_stream(ENCODE_STREAM, "dispatch and encoding"),
    event_stream(WEBHOOKS_STREAM, "developers' endpoints (one disabled)"),
    StreamSpec(DLQ_STREAM, (DLQ_SUBJECTS,), "parked messages: dlq.<type>, with the error in headers"),
    StreamSpec(REPLAY_STREAM, (REPLAY_SUBJECTS,), "replayed slices: replay.<consumer>.<type>"),
    # auth's request-limit counters (ADR-49 counter stream): limits.<rule>.<key>.<window start>. Windows expire by
    # max_age (twice the hour rules' window), since a counter stream refuses per-message TTLs.
    StreamSpec(
        LIMITS_STREAM,
        (COUNTER_SUBJECTS,),
        "request-limit counters, one subject per rule, key and window",
        max_age_seconds=2 * 3600,
        extra={"allow_msg_counter": True, "allow_direct": True, "max_msgs_per_subject": 1},
    ),
)


def stream_named(name: str) -> StreamSpec:
    return next(spec for spec in STREAMS if spec.name == name)


def stream_for_type(event_type: str) -> StreamSpec:
    """The stream that keeps an event type (all of its subjects)."""
    return stream_named(contract(event_type).stream)


def stream_for_subject(subject: str) -> StreamSpec:
    for spec in STREAMS:
        for pattern in spec.subjects:
            if subject_matches(pattern, subject):
                return spec
    raise LookupError(f"no stream captures {subject!r}")


def subject_matches(pattern: str, subject: str) -> bool:
    """NATS wildcard matching: `*` one token, `>` one or more trailing tokens."""
    p, s = pattern.split("."), subject.split(".")
    for i, tok in enumerate(p):
        if tok == ">":
            return len(s) > i
        if i >= len(s) or (tok != "*" and tok != s[i]):
            return False
    return len(p) == len(s)


_unkept = sorted({e.stream for e in EVENTS} - {spec.name for spec in STREAMS})
if _unkept:
    raise LookupError(f"shared/contracts.py puts events on streams not declared here: {_unkept}")


def stream_config(spec: StreamSpec, settings: CommonSettings) -> api.StreamConfig:
    return api.StreamConfig(
        name=spec.name,
        description=spec.description,
        subjects=list(spec.subjects),
        retention=api.RetentionPolicy.LIMITS,
        storage=api.StorageType.FILE,
        max_age=float(spec.max_age_seconds or settings.stream_max_age_seconds),
        duplicate_window=float(settings.stream_duplicate_window_seconds),
        num_replicas=settings.stream_replicas,
        **spec.extra,  # type: ignore[arg-type]
    )


NO_PEERS_FOR_PLACEMENT = 10005  # JetStream's err_code: a replica's peer is offline, as the meta leader sees it
PLACEMENT_WAIT_S = 20.0  # how long a stream's placement waits for its peers (a cluster forming, a node restarting)


async def apply_streams(
    js: JetStreamContext, settings: CommonSettings, specs: tuple[StreamSpec, ...] = STREAMS
) -> list[str]:
    """Create missing streams and bring existing ones to the declaration; returns what was done. A placement that
    finds a replica's peer offline is tried again for up to PLACEMENT_WAIT_S: in a cluster that has just formed, the
    meta leader may not have heard from every node yet, though each says it is current."""
    done: list[str] = []
    for spec in specs:
        config = stream_config(spec, settings)
        try:
            await js.stream_info(spec.name)
        except NotFoundError:
            await _placed(js.add_stream, config)
            done.append(f"created {spec.name}")
            continue
        await _placed(js.update_stream, config)
        done.append(f"updated {spec.name}")
    return done


async def _placed(call: Callable[[api.StreamConfig], Awaitable[Any]], config: api.StreamConfig) -> None:
    deadline = time.monotonic() + PLACEMENT_WAIT_S
    while True:
        try:
            await call(config)
            return
        except APIError as exc:
            if exc.err_code != NO_PEERS_FOR_PLACEMENT or time.monotonic() > deadline:
                raise
        await asyncio.sleep(0.25)
