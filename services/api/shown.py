"""A video as the api shows it (SPEC 4, 14), declared for the OpenAPI document: what `Videos.shape` writes.

The routes answer the dicts `Videos.shape` builds and name these models only in `responses=` (never as
`response_model`), so the document describes the bytes without filtering them. Required: what every answer carries;
every object takes members a newer release adds (`extra="allow"`). tests/integration/test_api.py and the
mixed-version test validate real answers against the document.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import SkipJsonSchema

from services.api.playback import PlaybackPolicy
from shared.videos import TolerantShownOutputState, VideoStatus


class Shown(BaseModel):
    """Part of an answer: a client reads the members it knows and ignores the ones a newer release adds."""

    model_config = ConfigDict(extra="allow")


class PlaybackShown(Shown):
    """`playback` of a video: its policy and absolute URLs (null until there is something there). A signed video's
    URLs play with `?token=<playback token>` added."""

    policy: PlaybackPolicy
    hls: str | None = Field(description="the HLS master playlist")
    thumbnail: str | None = Field(description="the poster (`?time=&width=` for another frame)")
    storyboard: str | None = Field(description="the storyboard WebVTT (cues point at tiles of one sprite)")
    embed: str | None = Field(None, description="a player page for an `<iframe>` (options `autoplay=1`, `muted=1`, "
                              "`loop=1`, `start=`, `captions=<language>`); null while `hls` is (shown since release "
                              "1.1.0)")
    mp4: str | None = Field(None, description="a stable URL of the highest MP4 (`lowest.mp4` or `<p>p.mp4`, e.g. "
                            "`720p.mp4`, beside it; `?download=1` to save it): a redirect to storage, under the same "
                            "rules as `hls`; null until one is stored (shown since release 1.1.0)")


class FileShown(Shown):
    """The uploaded file, once complete recorded it."""

    size: int = Field(description="bytes")
    content_type: str


class RenditionShown(Shown):
    """One MP4 rendition stored so far."""

    height: int = Field(description="the rendition's p: its shorter side in pixels (its height when landscape or "
                        "square, its width when portrait)")
    url: str = Field(description="a presigned GET URL of the MP4 (it expires)")
    size: int = Field(description="bytes")


class OutputShown(Shown):
    """One output of the encoding: encode's own state when it answered, else the api's projection of its events
    (which may not know the worker or the start yet)."""

    height: int = Field(description="the rendition's p: its shorter side in pixels (its height when landscape or "
                        "square, its width when portrait)")
    state: TolerantShownOutputState = Field(description="a state this release does not know reads as `pending`")
    worker: str | None = None
    started_at: datetime | None = None


class ProcessingShown(Shown):
    deadline_at: datetime | None
    busy_at: datetime | None = Field(description="when the farm was last too busy to take the video's work")
    outputs: list[OutputShown]


class FailureShown(Shown):
    reason: str = Field(description="e.g. `unsupported_file`")
    message: str


class CaptionShown(Shown):
    """One caption track (WebVTT; a SubRip file is turned into WebVTT when uploaded)."""

    language: str = Field(description="its BCP 47 tag, in canonical case (`en`, `pt-BR`, `es-419`)")
    name: str = Field(description="what players show viewers (unique among the video's tracks)")
    closed_captions: bool = Field(description="for viewers who do not hear the sound: speech and the sounds (SDH)")
    size: int = Field(description="bytes of the WebVTT file")
    cues: int
    created_at: datetime
    updated_at: datetime = Field(description="when its file was last replaced")
    url: str = Field(description="the WebVTT file (a signed video's needs `?token=<playback token>` added)")


class Captions(Shown):
    captions: list[CaptionShown] = Field(description="in the order they were first uploaded")


class ImportErrorShown(Shown):
    code: str = Field(description="`address_refused`, `dns_failed`, `connect_failed`, `timeout`, `protocol_error`, "
                      "`http_status`, `too_large`, `empty`, `bad_redirect`, `too_many_redirects`, `storage`, "
                      "`unsupported_file`, `interrupted` (a newer release may add others)")
    message: str
    attempt: int
    at: datetime
    status: int | None = Field(None, description="the URL's HTTP status, for `http_status`")


class ImportShown(Shown):
    """The video's import from a URL (`POST /v1/videos/{id}/import`)."""

    url: str = Field(description="the URL, without its query (a presigned URL's signature is a credential)")
    state: str = Field(description="`queued` (waiting for an attempt: the first, or the next after a failure worth "
                       "retrying), `fetching`, `completed`, `failed` (the video failed: `failure` says why), "
                       "`cancelled` (the video was deleted or retired)")
    attempts: int
    bytes: int | None = Field(description="read so far while `fetching` (recorded with each part stored); the file's "
                              "size once `completed`")
    error: ImportErrorShown | None = Field(description="the last failed attempt's, also while retrying")
    next_attempt_at: datetime | None = Field(description="while `queued`: not before then")
    started_at: datetime | None
    finished_at: datetime | None


class VideoShown(Shown):
    """A video as `GET /v1/videos/{id}` shows it. `playback` is shown since release 1.1.0 (an api of 1.0.0 shows
    none)."""

    id: str
    status: VideoStatus
    name: str
    metadata: dict[str, Any] | None
    created_at: datetime
    file: FileShown | None = Field(description="null until the upload is complete")
    renditions: list[RenditionShown] = Field(description="by height, each as soon as it is stored")
    processing: ProcessingShown | None = Field(description="encode's work on it; null until encode told any")
    failure: FailureShown | None
    playback: PlaybackShown | SkipJsonSchema[None] = None
    captions: list[CaptionShown] | SkipJsonSchema[None] = Field(None, description="its caption tracks (shown since "
                                                                "release 1.1.0)")
    import_: ImportShown | None = Field(None, alias="import", description="its import from a URL, null when none "
                                        "(shown since release 1.1.0)")


class VideoCreatedShown(VideoShown):
    """`POST /v1/videos`: the video and an upload token for its upload (a browser's, or the server's own)."""

    upload_token: str
    upload_token_expires_at: datetime


class VideoPage(Shown):
    """A page of the app's live videos, newest first."""

    videos: list[VideoShown]
    next_cursor: str | None = Field(description="`?cursor=` of the next page; null on the last one")


def video_answer(status: int, model: type[BaseModel], description: str) -> dict[int | str, dict[str, Any]]:
    """`responses=` of a route answering a video (or its page) as `Videos.shape` writes it."""
    return {status: {"model": model, "description": description}}
