"""The event catalog: the envelope, a payload model per event type, and their schema snapshots (SPEC 7).

Publish: `new_event(UploadCompleted(...), source="api", subject=video_id).to_bytes()` on the subject
`UploadCompleted.event_type`, with the envelope's `id` as `Nats-Msg-Id`.
Consume: a handler takes `Event[UploadCompleted]` (the envelope with its data typed; `shared/bus.py` runs it), or
reads any event untyped with `Envelope.from_bytes(msg.data).parsed_as(UploadCompleted)`. An event whose data fails
its model is parked on `dlq_subject(type)`.
"""

from shared.contracts import DLQ_PREFIX, dlq_subject
from shared.events.base import EventData, MalformedEvent, UnknownEventType, UtcDatetime
from shared.events.catalog import (
    ALL_TYPES,
    CATALOG,
    KEY_PREFIX_MAX_LENGTH,
    CredentialKind,
    CredentialRejected,
    DispatchBusy,
    EncodeCompleted,
    EncodeFailed,
    EncodeProgress,
    EncodeStarted,
    KeyCreated,
    KeyKind,
    KeyRevoked,
    RecordingCompleted,
    RetireReason,
    UploadCompleted,
    VideoCaptionsChanged,
    VideoCreated,
    VideoDeleted,
    VideoFailed,
    VideoReady,
    VideoRetired,
    WebhookDisabled,
    model_for,
)
from shared.events.compat import (
    DEFAULT_SCHEMAS_DIR,
    SnapshotRefused,
    check_catalog,
    differences,
    incompatibilities,
    render_schema,
    schema_of,
    snapshot_path,
    write_snapshots,
)
from shared.events.envelope import SCHEMA_VERSION_KEY, Envelope, Event, event_models, event_union, new_event

__all__ = [
    "ALL_TYPES",
    "CATALOG",
    "DEFAULT_SCHEMAS_DIR",
    "DLQ_PREFIX",
    "KEY_PREFIX_MAX_LENGTH",
    "SCHEMA_VERSION_KEY",
    "CredentialKind",
    "CredentialRejected",
    "DispatchBusy",
    "EncodeCompleted",
    "EncodeFailed",
    "EncodeProgress",
    "EncodeStarted",
    "Envelope",
    "Event",
    "EventData",
    "KeyCreated",
    "KeyKind",
    "KeyRevoked",
    "MalformedEvent",
    "RecordingCompleted",
    "RetireReason",
    "SnapshotRefused",
    "UnknownEventType",
    "UploadCompleted",
    "UtcDatetime",
    "VideoCaptionsChanged",
    "VideoCreated",
    "VideoDeleted",
    "VideoFailed",
    "VideoReady",
    "VideoRetired",
    "WebhookDisabled",
    "check_catalog",
    "differences",
    "dlq_subject",
    "event_models",
    "event_union",
    "incompatibilities",
    "model_for",
    "new_event",
    "render_schema",
    "schema_of",
    "snapshot_path",
    "write_snapshots",
]
