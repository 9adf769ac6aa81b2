"""The api's decisions as plain functions: video states, upload rules, listing cursors, the status projection.

No I/O and no clock: time comes in as a parameter.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any, Final, Literal, get_args

from shared.events import (
    DispatchBusy,
    EncodeCompleted,
    EncodeFailed,
    EncodeProgress,
    EncodeStarted,
    Event,
    VideoFailed,
    VideoReady,
)
from shared.videos import (  # ImportState: the videos table's vocabulary, shared with the sweep
    BEFORE_PROCESSING,
    GONE,
    IMPORT_ACTIVE,
    NO_FILE_YET,
    ImportState,
    ShownOutputState,
    VideoStatus,
)

METADATA_MAX_BYTES: Final = 8 * 1024
PART_NUMBER_MAX: Final = 10_000
PART_SIZE_MIN: Final = 5 * 1024 * 1024  # S3's minimum for every part but the last
OBJECT_SIZE_MAX: Final = 5 * 1024**4  # S3's largest object (5 TiB): a file said to be larger cannot be stored
PAGE_MAX: Final = 100


class UploadRefusal(StrEnum):
    GONE = "gone"  # retired or deleted: 409
    HAS_FILE = "has_file"  # the file is recorded already: 409
    NOT_OPEN = "not_open"  # parts or complete with no open upload: 409


def initiate_refusal(status: VideoStatus, file_recorded: bool) -> UploadRefusal | None:
    """May a multipart upload be opened (or the open one returned) for a video in this state?"""
    if status in GONE:
        return UploadRefusal.GONE
    if file_recorded or status not in NO_FILE_YET:
        return UploadRefusal.HAS_FILE
    return None


def upload_refusal(status: VideoStatus, upload_id: str | None) -> UploadRefusal | None:
    """May parts be signed for, or the upload completed, in this state?"""
    if status in GONE:
        return UploadRefusal.GONE
    if upload_id is None:
        return UploadRefusal.NOT_OPEN
    return None


def storable_text_problem(value: Any) -> str | None:
    """Why a JSON value cannot be stored as PostgreSQL text/jsonb (NUL characters, lone surrogates, the NaN and
    Infinity that Python's JSON parser takes but JSON has not), or None."""
    try:
        encoded = json.dumps(value, ensure_ascii=False, allow_nan=False)
        encoded.encode("utf-8")
    except UnicodeEncodeError:
        return "text must be valid Unicode (no lone surrogates)"
    except ValueError:
        return "numbers must be finite: NaN and Infinity (or a number too large for a double) are not JSON"
    if "\\u0000" in encoded or "\x00" in encoded:
        return "text must not contain NUL characters"
    return None


def metadata_too_large(metadata: Any) -> bool:
    """SPEC: metadata is JSON of at most 8 KiB (measured as compact UTF-8 JSON)."""
    if metadata is None:
        return False
    return len(json.dumps(metadata, separators=(",", ":"), ensure_ascii=False).encode()) > METADATA_MAX_BYTES


IDEMPOTENCY_KEY_MAX: Final = 255


def idempotency_key_problem(key: str) -> str | None:
    """Why an `Idempotency-Key` cannot be one (the route answers 400), or None: 1 to 255 printable ASCII characters,
    no space (a UUID, or an id of the caller's own request)."""
    if not 1 <= len(key) <= IDEMPOTENCY_KEY_MAX:
        return f"Idempotency-Key must be 1 to {IDEMPOTENCY_KEY_MAX} characters"
    if not all(0x21 <= ord(c) <= 0x7E for c in key):
        return "Idempotency-Key must be printable ASCII without spaces"
    return None


def request_fingerprint(asked: Mapping[str, Any]) -> str:
    """What a request asked for, as a digest: the same key sent with another request is refused, not replayed."""
    canonical = json.dumps(asked, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


def object_key(app_id: str, video_id: str) -> str:
    return f"sources/{app_id}/{video_id}"


# --------------------------------------------------------------------------------------------- cursors


@dataclass(frozen=True)
class Cursor:
    """Where a page ended: the last video's (created_at, id); the next page starts strictly after it."""

    created_at: datetime
    id: str


def encode_cursor(cursor: Cursor) -> str:
    raw = json.dumps([cursor.created_at.isoformat(), cursor.id]).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


ListedStatus = Literal["created", "uploading", "uploaded", "processing", "ready", "failed"]
"""The statuses a listing may be filtered by: a live video's (retired and deleted ones are never listed)."""
assert set(get_args(ListedStatus)) == {str(s) for s in VideoStatus} - set(GONE)


def unlisted_parts(stored: Iterable[int], listed: Iterable[int]) -> list[int]:
    """The stored parts a completion leaves out, by number: S3 would assemble the file without them, cutting it, so
    a completion that leaves any out is refused (the upload stays open to complete again with every part)."""
    return sorted(set(stored) - set(listed))


def decode_cursor(text: str) -> Cursor | None:
    """None for anything that is not a cursor this api made (the route answers 400)."""
    try:
        raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
        created, vid = json.loads(raw)
        when = datetime.fromisoformat(created)
        if not isinstance(vid, str) or when.tzinfo is None:
            return None
        return Cursor(when, str(uuid.UUID(vid)))  # a video id, as the database reads it (not any string)
    except (ValueError, TypeError, binascii.Error, json.JSONDecodeError):
        return None


# --------------------------------------------------------------------------------- status projection


@dataclass(frozen=True)
class Projection:
    """What the api shows of processing, kept from `encode.*` and `dispatch.busy` events."""

    status: VideoStatus
    processing: dict[str, Any] | None
    renditions: tuple[dict[str, Any], ...]
    failure: tuple[str, str] | None
    artwork: dict[str, Any] | None = None  # the poster and storyboard (shared.media.playback.Artwork), when made


EncodeEvent = (
    Event[EncodeStarted] | Event[EncodeProgress] | Event[EncodeCompleted] | Event[EncodeFailed] | Event[DispatchBusy]
)
"""What the status projection reads: encode's events about a video (progress changes nothing shown)."""


OUTPUT_EVENT_AT: Final = "event_at"
"""Kept with each output of the projection, never shown: when the event that set its state happened."""
_STATE_RANK: Final[dict[str, int]] = {
    ShownOutputState.ENCODING: 0, ShownOutputState.FAILED: 1, ShownOutputState.DONE: 2}


def _output_after(entry: dict[str, Any] | None, height: int, state: ShownOutputState, worker: str | None,
                  at: datetime, *, started: bool) -> dict[str, Any]:
    """An output after one event about it, whatever order its events come in: the state and worker of the newest
    (a tie goes to the further state), `started_at` the newest start. Several api instances share the durable and
    a replay comes late, so events of one video may be applied out of order; the projection still ends the same."""
    after = dict(entry or {"height": height})
    if started:
        before = after.get("started_at")
        if before is None or at > datetime.fromisoformat(before):
            after["started_at"] = at.isoformat()
    seen = after.get(OUTPUT_EVENT_AT)  # none: a new output, or one an earlier release kept (it did not keep times)
    rank = _STATE_RANK.get(state, 0)
    if seen is None or (at, rank) >= (datetime.fromisoformat(seen), _STATE_RANK.get(str(after.get("state")), 0)):
        after.update({"state": state, "worker": worker, OUTPUT_EVENT_AT: at.isoformat()})
    return after


def project(current: Projection, event: EncodeEvent) -> Projection:
    """The video's shown state after one encode event; events about a gone video change nothing. The result does
    not depend on the order the video's events are applied in (`_output_after`)."""
    if current.status in GONE:
        return current
    processing = dict(current.processing or {"deadline_at": None, "busy_at": None, "outputs": []})
    outputs = {o["height"]: dict(o) for o in processing.get("outputs", [])}
    status, renditions, failure, artwork = current.status, list(current.renditions), current.failure, current.artwork
    data, at = event.data, event.time
    if isinstance(data, EncodeStarted):
        outputs[data.output] = _output_after(outputs.get(data.output), data.output, ShownOutputState.ENCODING,
                                             data.worker, at, started=True)
        if status in BEFORE_PROCESSING:
            status = VideoStatus.PROCESSING
    elif isinstance(data, EncodeCompleted):
        outputs[data.output] = _output_after(outputs.get(data.output), data.output, ShownOutputState.DONE,
                                             data.worker, at, started=False)
        renditions = [r for r in renditions if r["height"] != data.output]
        rendition: dict[str, Any] = {"height": data.output, "object_key": data.object_key, "size": data.size}
        if data.hls is not None:  # its HLS media playlist (v4), which the master playlist lists
            rendition["hls"] = data.hls.model_dump(mode="json")
        renditions.append(rendition)
        if data.artwork is not None:  # one output's event carries the video's poster and storyboard
            artwork = data.artwork.model_dump(mode="json")
        renditions.sort(key=lambda r: r["height"])
        # encode says when the last output is done (`outputs_remaining`, from the encode service's own count)
        if data.outputs_remaining == 0:
            status = VideoStatus.READY
    elif isinstance(data, EncodeFailed):
        if data.output is None:
            status = VideoStatus.FAILED
            failure = (data.reason, data.message)
        else:
            outputs[data.output] = _output_after(outputs.get(data.output), data.output, ShownOutputState.FAILED,
                                                 data.worker, at, started=False)
    elif isinstance(data, DispatchBusy):
        before = processing.get("busy_at")
        if before is None or data.busy_at > datetime.fromisoformat(before):
            processing["busy_at"] = data.busy_at.isoformat()
    processing["outputs"] = sorted(outputs.values(), key=lambda o: o["height"])
    return Projection(status, processing, tuple(renditions), failure, artwork)


def outcome(video_id: str, app_id: str, account_id: str, before: Projection, after: Projection
            ) -> VideoReady | VideoFailed | None:
    """What the api announces of a projection's change: `video.ready` or `video.failed` when the video arrives at
    that status (once per arrival: a replayed or repeated event changes nothing, so it announces nothing)."""
    if after.status == before.status:
        return None
    if after.status == VideoStatus.READY:
        shown = sorted((r for r in after.renditions if r.get("hls")), key=lambda r: r["height"])
        top = shown[-1]["hls"] if shown else None
        return VideoReady(
            video_id=video_id, app_id=app_id, account_id=account_id,
            outputs=sorted(int(r["height"]) for r in after.renditions),
            duration_seconds=max((float(r["hls"]["duration"]) for r in shown), default=None),
            max_width=top["width"] if top else None, max_height=top["height"] if top else None)
    if after.status == VideoStatus.FAILED:
        reason, message = after.failure or ("encode_error", "")
        return VideoFailed(video_id=video_id, app_id=app_id, account_id=account_id, reason=reason, message=message)
    return None


def shown_processing(processing: dict[str, Any] | None) -> dict[str, Any] | None:
    """The projection's processing as the API shows it: without what the projection keeps for itself."""
    if processing is None:
        return None
    outputs = [{k: v for k, v in o.items() if k != OUTPUT_EVENT_AT} for o in processing.get("outputs", [])]
    return {**processing, "outputs": outputs}


def rebuild_base(status: VideoStatus) -> Projection | None:
    """Where a rebuild of the status projection starts a video: as it was before encode's first event (its upload
    states are the api's own, not encode's). None: a gone video, which no event changes (`project`)."""
    if status in GONE:
        return None
    return Projection(status if status in BEFORE_PROCESSING else VideoStatus.UPLOADED, None, (), None, None)


def rebuilt(base: Projection, events: list[EncodeEvent]) -> Projection:
    """The projection of a video from its base and its handled events, in stream order."""
    for event in events:
        base = project(base, event)
    return base


# ------------------------------------------------------------------------------------- imports from a URL


class FetchFailure(StrEnum):
    """Why an attempt to read the URL failed, shown as `import.error.code`."""

    ADDRESS_REFUSED = "address_refused"  # the name resolved to an address Weir may not connect to (SSRF rules)
    DNS_FAILED = "dns_failed"
    CONNECT_FAILED = "connect_failed"
    TIMEOUT = "timeout"  # no byte within the read timeout, or the attempt outlasted its time
    PROTOCOL_ERROR = "protocol_error"  # no HTTP answer, or one cut off mid-body
    HTTP_STATUS = "http_status"  # an answer other than 200
    TOO_LARGE = "too_large"  # more than WEIR_IMPORT_MAX_BYTES, said or sent
    EMPTY = "empty"  # a 200 with no bytes
    BAD_REDIRECT = "bad_redirect"  # a redirect without Location, or to a URL that is refused
    TOO_MANY_REDIRECTS = "too_many_redirects"
    STORAGE = "storage"  # storage did not take a part (Weir's side: always retried)


_ALWAYS_RETRIED: Final = frozenset({FetchFailure.DNS_FAILED, FetchFailure.CONNECT_FAILED, FetchFailure.TIMEOUT,
                                    FetchFailure.PROTOCOL_ERROR, FetchFailure.STORAGE})
RETRIED_STATUSES: Final = frozenset({408, 425, 429})  # and every 5xx: the server may answer later


def import_retried(failure: FetchFailure, status: int | None = None) -> bool:
    """Is a failed attempt worth another? What the network or a server's trouble caused, yes; what the URL itself
    says (a 404, a 403 of an expired presigned URL, a file too large, a refused address), no: the same URL would
    fail the same way."""
    if failure is FetchFailure.HTTP_STATUS:
        return status is not None and (status in RETRIED_STATUSES or status >= 500)
    return failure in _ALWAYS_RETRIED


def import_retry_delay(attempts: int, *, max_attempts: int, base_seconds: float, spread: float,
                       retry_after: float | None = None) -> float | None:
    """Seconds until the next attempt after `attempts` failed ones worth retrying, or None: give up. Exponential,
    4x a time from `base_seconds` (10 s, 40 s, 160 s, 640 s with the defaults: all within a quarter hour, far
    inside the sweep's day), spread by ±20 % (`spread` in [0, 1), one random draw: imports that failed together
    do not come back together); a server's `Retry-After` is waited out when it asks for longer, up to 4x the
    backoff."""
    if attempts >= max_attempts:
        return None
    backoff = base_seconds * 4.0 ** (attempts - 1) * (0.8 + 0.4 * spread)
    if retry_after is not None and retry_after > backoff:
        return min(retry_after, 4 * backoff)
    return backoff


class ImportRefusal(StrEnum):
    GONE = "gone"  # retired or deleted
    HAS_FILE = "has_file"  # the file is recorded, or the video failed: 409
    UPLOADING = "uploading"  # an upload through the upload routes is open: 409
    IMPORTING = "importing"  # an import is queued or running: 409 (unless the same URL: answered as it is)


def import_refusal(status: VideoStatus, file_recorded: bool, upload_id: str | None,
                   state: ImportState | None) -> ImportRefusal | None:
    """May an import start for a video in this state? Only one way in at a time: a video that takes parts through
    the upload routes takes no import, and one being imported opens no upload (`upload_blocked_by_import`)."""
    if status in GONE:
        return ImportRefusal.GONE
    if file_recorded or status not in NO_FILE_YET:
        return ImportRefusal.HAS_FILE
    if state in IMPORT_ACTIVE:
        return ImportRefusal.IMPORTING
    if upload_id is not None:
        return ImportRefusal.UPLOADING
    return None


def upload_blocked_by_import(state: ImportState | None) -> bool:
    """The upload routes refuse (409) a video whose file is being imported: two writers of one object."""
    return state in IMPORT_ACTIVE


def shown_import_url(url: str) -> str:
    """The URL as `import.url` shows it: without its query (a presigned URL's signature is a credential, as
    Secrets never go in answers after the request that carried them) and fragment."""
    return url.split("#", 1)[0].split("?", 1)[0]
