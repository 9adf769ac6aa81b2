"""The event catalog: the envelope, a payload model per event type, and their schema snapshots (SPEC 7).

Publish: `new_event(UploadCompleted(...), source="api", subject=video_id).to_bytes()` on the subject
`UploadCompleted.event_type`, with the envelope's `id` as `Nats-Msg-Id`.
Consume: `Envelope.from_bytes(msg.data).parsed_as(UploadCompleted)`; on `MalformedEvent`, park the message on
`dlq_subject(type)`.
"""

from shared.events.base import EventData, MalformedEvent, UnknownEventType, UtcDatetime
from shared.events.catalog import (
    ALL_TYPES,
    CATALOG,
    DLQ_PREFIX,
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
    VideoCreated,
    VideoDeleted,
    VideoRetired,
    dlq_subject,
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
from shared.events.envelope import Envelope, new_event

__all__ = [
    "ALL_TYPES",
    "CATALOG",
    "DEFAULT_SCHEMAS_DIR",
    "DLQ_PREFIX",
    "KEY_PREFIX_MAX_LENGTH",
    "CredentialKind",
    "CredentialRejected",
    "DispatchBusy",
    "EncodeCompleted",
    "EncodeFailed",
    "EncodeProgress",
    "EncodeStarted",
    "Envelope",
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
    "VideoCreated",
    "VideoDeleted",
    "VideoRetired",
    "check_catalog",
    "differences",
    "dlq_subject",
    "incompatibilities",
    "model_for",
    "new_event",
    "render_schema",
    "schema_of",
    "snapshot_path",
    "write_snapshots",
]
