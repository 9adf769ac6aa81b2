"""The event catalog: one model per event type (SPEC section 7), and the registry by type.

To evolve an event: add an optional field (`X | None = None`), raise its `version`, and run
`weir events snapshot`. Never remove, rename or retype a field; `tests/unit/test_catalog.py` fails if you do.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated, ClassVar, Literal

from pydantic import Field, StringConstraints

from shared.events.base import ByteCount, EntityId, EventData, Height, UnknownEventType, UtcDatetime
from shared.media.playback import Artwork, HlsRendition
from shared.tolerant import unknown_as

CredentialKind = Literal["secret_key", "publishable_key", "upload_token", "internal_token", "account_token"]
KeyKind = Literal["secret", "publishable"]
RetireReason = Literal["stale_file", "never_uploaded"]

# Read tolerantly (SPEC 11): a value a newer release adds reads as the fallback, never refusing the event.
ReadCredentialKind = Annotated[CredentialKind, unknown_as("secret_key")]  # unknown: the most sensitive kind
ReadKeyKind = Annotated[KeyKind, unknown_as("secret")]  # unknown: the kind never to expose
ReadRetireReason = Annotated[RetireReason, unknown_as("stale_file")]  # unknown: a retirement that removed a file
DisabledReason = Literal["gone", "failing"]
ReadDisabledReason = Annotated[DisabledReason, unknown_as("failing")]  # unknown: disabled, for a reason to look into

KEY_PREFIX_MAX_LENGTH = 12
"""Long enough to tell keys apart in a log, far too short to be a usable secret."""


# --- auth -------------------------------------------------------------------------------------------------


class CredentialRejected(EventData):
    """A request's credential was refused. Rejections may be folded: `count` of them in one window."""

    event_type: ClassVar[str] = "credential.rejected"
    version: ClassVar[int] = 1

    credential_kind: ReadCredentialKind
    reason: str
    client_address: str
    key_prefix: Annotated[str, StringConstraints(max_length=KEY_PREFIX_MAX_LENGTH)] | None = Field(
        default=None, description="The first characters of the presented key, never the secret itself."
    )
    route: str
    count: int = Field(default=1, ge=1, description="How many rejections this event stands for.")


class KeyCreated(EventData):
    """An API key was created."""

    event_type: ClassVar[str] = "key.created"
    version: ClassVar[int] = 1

    key_id: EntityId
    app_id: EntityId
    account_id: EntityId
    kind: ReadKeyKind


class KeyRevoked(EventData):
    """An API key was revoked; requests presenting it are refused from now on."""

    event_type: ClassVar[str] = "key.revoked"
    version: ClassVar[int] = 1

    key_id: EntityId
    app_id: EntityId
    account_id: EntityId
    kind: ReadKeyKind


# --- api --------------------------------------------------------------------------------------------------


class VideoCreated(EventData):
    """A video was created; its file is not uploaded yet."""

    event_type: ClassVar[str] = "video.created"
    version: ClassVar[int] = 1

    video_id: EntityId
    app_id: EntityId
    account_id: EntityId


class VideoDeleted(EventData):
    """A video was deleted by its developer."""

    event_type: ClassVar[str] = "video.deleted"
    version: ClassVar[int] = 1

    video_id: EntityId
    app_id: EntityId
    account_id: EntityId


class UploadCompleted(EventData):
    """A developer's upload was assembled in storage; the video is ready to encode (a `developer` job)."""

    event_type: ClassVar[str] = "upload.completed"
    version: ClassVar[int] = 2  # 2: source_width

    video_id: EntityId
    app_id: EntityId
    account_id: EntityId
    key_id: EntityId = Field(description="The key whose request completed the upload.")
    object_key: EntityId = Field(description="Where the source file is in object storage.")
    size: ByteCount
    content_type: str
    source_height: Height | None = Field(description="The source's height in pixels, or null if not known.")
    source_width: Height | None = Field(None, description="The source's width in pixels as shown (after rotation), or "
                                        "null if not known (or sent by release 1.0.0): with source_height, "
                                        "the shorter side gives the rendition ladder (a portrait video's p is its "
                                        "width).")


class VideoReady(EventData):
    """A video is ready: every output of its ladder is encoded and playable (what `GET /v1/videos/{id}` shows as
    `ready`). Announced once per arrival at ready, by the api from encode's events; its encode.* events tell the way."""

    event_type: ClassVar[str] = "video.ready"
    version: ClassVar[int] = 1

    video_id: EntityId
    app_id: EntityId
    account_id: EntityId
    outputs: list[Height] = Field(description="The renditions stored, by their p (their shorter side), ascending.")
    duration_seconds: float | None = Field(default=None, ge=0, description="How long it plays, from its HLS "
                                           "renditions (null when none has HLS).")
    max_width: Height | None = Field(default=None, description="The largest rendition's width as shown (null: not "
                                     "measured).")
    max_height: Height | None = Field(default=None, description="The largest rendition's height as shown.")


class VideoFailed(EventData):
    """A video failed for good: its file is not a video (`unsupported_file`, refused when its upload completed), its
    import from a URL failed (`import_failed`: the URL refused it, or every attempt failed), or its encoding failed
    (`deadline`, `farm_unreachable`, `encode_error`, `unreadable_source`; encode.failed tells more). Announced once
    per arrival at failed, by the api."""

    event_type: ClassVar[str] = "video.failed"
    version: ClassVar[int] = 1

    video_id: EntityId
    app_id: EntityId
    account_id: EntityId
    reason: str = Field(description="Machine-readable: `unsupported_file`, `import_failed`, `deadline`, "
                        "`farm_unreachable`, `encode_error`, `unreadable_source`; a later release may add others.")
    message: str = Field(description="For people, as `GET /v1/videos/{id}` shows it in `failure.message`.")


class VideoCaptionsChanged(EventData):
    """A video's caption tracks changed: one added, its file replaced, or removed (`PUT`/`DELETE
    /v1/videos/{id}/captions/{language}`). Players offer the tracks from their next master playlist."""

    event_type: ClassVar[str] = "video.captions_changed"
    version: ClassVar[int] = 1

    video_id: EntityId
    app_id: EntityId
    account_id: EntityId
    language: EntityId = Field(description="The BCP 47 tag of the track that changed, in canonical case (`pt-BR`).")
    change: str = Field(description="`added`, `replaced` (its file or name) or `deleted`; a later release may add "
                        "others.")
    languages: list[str] = Field(description="The video's tracks after the change, in the order they were first "
                                 "uploaded.")


# --- first-party publishers --------------------------------------------------------------------------------


class RecordingCompleted(EventData):
    """A first-party recording is in storage and ready to encode (a `first_party` job)."""

    event_type: ClassVar[str] = "recording.completed"
    version: ClassVar[int] = 2  # 2: source_width

    recording_id: EntityId
    object_key: EntityId
    size: ByteCount
    source_height: Height | None = None
    source_width: Height | None = Field(None, description="The recording's width in pixels as shown, if known: with "
                                        "source_height, the shorter side gives the rendition ladder.")


class PublisherRejected(EventData):
    """encode refused or could not read an event a team published: on `publisher.<name>.rejected`, which only that
    team may read (SPEC 12). The event itself is parked on the dead-letter queue as well."""

    event_type: ClassVar[str] = "publisher.rejected"
    version: ClassVar[int] = 1

    publisher: str = Field(description="The team's identity (the name in its subjects).")
    event_id: str | None = Field(description="The refused event's id, or null when it had no readable one.")
    event_type_refused: str = Field(description="The type of the refused event, e.g. `recording.completed`.")
    subject: str = Field(description="The subject it was published on.")
    reason: str = Field(description="Why, for people; `code` for programs.")
    code: str = Field(description="e.g. `not_your_video`, `object_outside_prefix`, `has_source`, `malformed`.")


# --- encode and media ---------------------------------------------------------------------------------------


class DispatchBusy(EventData):
    """A dispatch round in which every answer was busy: the deadline restarts (SPEC section 6)."""

    event_type: ClassVar[str] = "dispatch.busy"
    version: ClassVar[int] = 1

    video_id: EntityId
    outputs_offered: list[Height] = Field(description="Heights of the outputs offered in the round.")
    workers_answered: list[str] = Field(description="The workers that answered busy.")
    busy_at: UtcDatetime


class EncodeStarted(EventData):
    """A worker accepted one output of a video and started encoding it."""

    event_type: ClassVar[str] = "encode.started"
    version: ClassVar[int] = 2

    video_id: EntityId
    output: Height
    worker: str
    account_id: EntityId | None = Field(
        default=None, description="The video's account (since v2): its subject is `encode.started.<account_id>`.")


class EncodeProgress(EventData):
    """How far a worker is with one output."""

    event_type: ClassVar[str] = "encode.progress"
    version: ClassVar[int] = 2

    video_id: EntityId
    output: Height
    worker: str
    progress: float = Field(ge=0.0, le=1.0, description="Fraction done, from 0 to 1.")
    account_id: EntityId | None = Field(
        default=None, description="The video's account (since v2): its subject is `encode.progress.<account_id>`.")


class EncodeCompleted(EventData):
    """One output of a video is encoded and stored."""

    event_type: ClassVar[str] = "encode.completed"
    version: ClassVar[int] = 4

    video_id: EntityId
    output: Height
    worker: str
    object_key: EntityId
    size: ByteCount
    outputs_remaining: int | None = Field(
        default=None, description="Outputs of the video not encoded yet; 0 when this was the last (since v2)."
    )
    account_id: EntityId | None = Field(
        default=None, description="The video's account (since v3): its subject is `encode.completed.<account_id>`.")
    hls: HlsRendition | None = Field(
        default=None, description="The output's HLS media playlist (since v4; null from a worker that makes none).")
    artwork: Artwork | None = Field(
        default=None, description="The video's poster and storyboard, made with this output (since v4; one output of "
                                  "each video carries it).")


class EncodeFailed(EventData):
    """One output, or the whole video, failed to encode."""

    event_type: ClassVar[str] = "encode.failed"
    version: ClassVar[int] = 2

    video_id: EntityId
    output: Height | None = Field(description="The output that failed, or null when the whole video failed.")
    worker: str | None = Field(description="The worker that failed it, or null when no worker did.")
    reason: str = Field(description="Machine-readable, e.g. `deadline` or `farm_unreachable`.")
    message: str = Field(description="For people, e.g. `Processing took too long`.")
    account_id: EntityId | None = Field(
        default=None, description="The video's account (since v2): its subject is `encode.failed.<account_id>`.")


# --- sweep ------------------------------------------------------------------------------------------------


class VideoRetired(EventData):
    """The sweep retired a video and removed its stored bytes."""

    event_type: ClassVar[str] = "video.retired"
    version: ClassVar[int] = 2

    video_id: EntityId
    reason: ReadRetireReason
    bytes_removed: ByteCount
    account_id: EntityId | None = Field(
        default=None, description="The video's account (since v2): its subject is `video.retired.<account_id>`.")


# --- webhooks ---------------------------------------------------------------------------------------------


class WebhookDisabled(EventData):
    """The webhooks service disabled a developer's endpoint: it answered 410, or failed every delivery for the
    disable-after period (SPEC 13). Deliveries stop until the developer turns it back on."""

    event_type: ClassVar[str] = "webhook.disabled"
    version: ClassVar[int] = 1

    endpoint_id: EntityId
    app_id: EntityId
    account_id: EntityId
    reason: ReadDisabledReason
    failing_since: UtcDatetime | None = Field(default=None, description="its first failure since its last success")


# --- the registry -----------------------------------------------------------------------------------------


def _registry(models: Iterable[type[EventData]]) -> dict[str, type[EventData]]:
    catalog: dict[str, type[EventData]] = {}
    for model in models:
        if model.event_type in catalog:
            raise ValueError(f"event type {model.event_type!r} is defined twice in the catalog")
        if model.version < 1:
            raise ValueError(f"{model.__name__}.version must be at least 1")
        catalog[model.event_type] = model
    return catalog


CATALOG: dict[str, type[EventData]] = _registry(
    [
        CredentialRejected,
        KeyCreated,
        KeyRevoked,
        VideoCreated,
        VideoDeleted,
        UploadCompleted,
        VideoReady,
        VideoFailed,
        VideoCaptionsChanged,
        RecordingCompleted,
        PublisherRejected,
        DispatchBusy,
        EncodeStarted,
        EncodeProgress,
        EncodeCompleted,
        EncodeFailed,
        VideoRetired,
        WebhookDisabled,
    ]
)
"""The current model of every event type, by type. The NATS subject of an event is its type."""

ALL_TYPES: tuple[str, ...] = tuple(CATALOG)


def model_for(type: str) -> type[EventData]:
    """The current model of an event type; raises `UnknownEventType` (a `MalformedEvent`) if there is none."""
    try:
        return CATALOG[type]
    except KeyError:
        raise UnknownEventType(f"unknown event type {type!r}") from None
