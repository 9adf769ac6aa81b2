"""The one declaration of Weir's JetStream streams, applied by `weir streams apply` (and `weir up`).

Services never declare streams on start-up: with independent deploys the last one to start would win.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nats.js import JetStreamContext, api
from nats.js.errors import NotFoundError

from shared.settings import CommonSettings


@dataclass(frozen=True)
class StreamSpec:
    name: str
    subjects: tuple[str, ...]
    description: str
    max_age_seconds: int | None = None  # None: the setting `stream_max_age_seconds`
    extra: dict[str, object] = field(default_factory=dict)


# Event streams by domain; the NATS subject of an event is its type.
STREAMS: tuple[StreamSpec, ...] = (
    StreamSpec("AUTH", ("credential.rejected", "key.created", "key.revoked"), "credentials and keys"),
    StreamSpec(
        "VIDEOS",
        ("video.created", "video.deleted", "video.retired", "upload.completed"),
        "videos and their uploads",
    ),
    StreamSpec("RECORDINGS", ("recording.completed",), "first-party recordings to encode"),
    # the event types one by one, not `encode.>`: `encode.status` is a core request/reply that must not be stored
    StreamSpec(
        "ENCODE",
        ("dispatch.busy", "encode.started", "encode.progress", "encode.completed", "encode.failed"),
        "dispatch and encoding",
    ),
    StreamSpec("DLQ", ("dlq.>",), "parked messages: dlq.<type>, with the error in headers"),
    StreamSpec("REPLAY", ("replay.>",), "replayed slices: replay.<consumer>.<type>"),
    # auth's request-limit counters (ADR-49 counter stream): limits.<rule>.<key>.<window start>. Windows expire by
    # max_age (twice the hour rules' window), since a counter stream refuses per-message TTLs.
    StreamSpec(
        "LIMITS",
        ("limits.>",),
        "request-limit counters, one subject per rule, key and window",
        max_age_seconds=2 * 3600,
        extra={"allow_msg_counter": True, "allow_direct": True, "max_msgs_per_subject": 1},
    ),
)


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


async def apply_streams(
    js: JetStreamContext, settings: CommonSettings, specs: tuple[StreamSpec, ...] = STREAMS
) -> list[str]:
    """Create missing streams and bring existing ones to the declaration; returns what was done."""
    done: list[str] = []
    for spec in specs:
        config = stream_config(spec, settings)
        try:
            await js.stream_info(spec.name)
        except NotFoundError:
            await js.add_stream(config)
            done.append(f"created {spec.name}")
            continue
        await js.update_stream(config)
        done.append(f"updated {spec.name}")
    return done
