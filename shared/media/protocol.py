"""The messages between `encode` and the `media` workers, and encode's `encode.status` (v1 and v2): core NATS
request/reply.

Why not JetStream: an offer wants an answer now (`accepted`, `busy`, or none: `unreachable`), and a stored offer
delivered later would be work queued without being accepted; heartbeats and cancels repeat, so a lost one costs
nothing; a result is kept by the worker until encode acknowledges it after its commit. These subjects stay outside
every stream's subjects, or JetStream would store the requests. Every message is read tolerantly: unknown fields
are ignored, and an unknown job class, outcome or state reads as the fallback `shared/videos.py` names.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from shared.contracts import (
    ENCODE_STATUS_SUBJECT,
    ENCODE_STATUS_V2_SUBJECT,
    FARM_CANCEL_PREFIX,
    FARM_HEARTBEAT_SUBJECT,
    FARM_OFFER_PREFIX,
    FARM_RESULT_SUBJECT,
)
from shared.media.playback import Artwork, HlsRendition
from shared.tolerant import Fallback
from shared.videos import TolerantJobClass, TolerantProcessingState, TolerantShownOutputState, known_or

OFFER_PREFIX = FARM_OFFER_PREFIX  # farm.offer.<worker instance>: request, answered accepted or busy at once
CANCEL_PREFIX = FARM_CANCEL_PREFIX  # farm.cancel.<worker instance>: stop these jobs, encode does not want them
HEARTBEAT_SUBJECT = FARM_HEARTBEAT_SUBJECT  # every worker, every media_heartbeat_seconds; every encode instance listens
RESULT_SUBJECT = FARM_RESULT_SUBJECT  # request from a worker, answered by one encode instance after its commit
STATUS_SUBJECT = ENCODE_STATUS_SUBJECT  # request from the api (GET /v1/videos/{id}): the processing state
ENCODE_QUEUE = "encode"  # encode's queue group for results and status requests
# how the per-worker subjects appear in the AsyncAPI documents: `{instance}` is the worker's instance id
OFFER_PATTERN = f"{OFFER_PREFIX}.{{instance}}"
CANCEL_PATTERN = f"{CANCEL_PREFIX}.{{instance}}"
# encode.status v2, a breaking change served beside v1 (STATUS_SUBJECT, one video per request, kept for the api of
# release 1.0.0): many videos per request (a page of GET /v1/videos in one), the replies in a list. v1 goes once no
# release in service calls it (the contracts check shows who still does).
STATUS_V2_SUBJECT = ENCODE_STATUS_V2_SUBJECT

Height = Annotated[int, Field(gt=0)]


def offer_subject(instance: str) -> str:
    return f"{OFFER_PREFIX}.{instance}"


def cancel_subject(instance: str) -> str:
    return f"{CANCEL_PREFIX}.{instance}"


def rendition_key(video_id: str, height: int, attempt: int) -> str:
    """Where an output's file is stored: one key per attempt, so that a late, ignored attempt overwrites nothing."""
    return f"renditions/{video_id}/{height}p-{attempt}.mp4"


class Outcome(StrEnum):
    COMPLETED = "completed"
    FAILED = "failed"
    HANDED_BACK = "handed_back"  # the worker stopped before finishing: offered again, no failure counted


def read_outcome(value: Any) -> Any:
    """An unknown outcome from a newer worker counts as failed: retried up to output_max_failures, never lost."""
    return known_or(value, frozenset(Outcome), Outcome.FAILED)


class Message(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")


class JobKey(Message):
    """One offer of one output: the attempt number grows with every offer of that output."""

    video_id: str
    output: Height
    attempt: int = Field(ge=1)


class Offer(JobKey):
    job_class: TolerantJobClass
    object_key: str
    source_height: Height | None = None
    # the video's account (since 1.1.0; None from an older encode, or a video opened before it knew): the worker's
    # encode.progress events go on `encode.progress.<account_id>` (SPEC 12)
    account_id: str | None = None
    # make the video's poster and storyboard in this job too (since 1.1.0; an older worker
    # ignores it and the video has none): encode asks it of one output per video, its lowest
    artwork: bool = False


class OfferAnswer(Message):
    accepted: bool
    worker: str
    instance: str
    reason: str | None = None  # why busy


class RunningJob(JobKey):
    job_class: TolerantJobClass
    started_at: datetime


class Heartbeat(Message):
    worker: str  # the name operators know (media-1)
    instance: str  # this process: a restarted worker is a new instance, and the old one's jobs are gone
    slots: int = Field(ge=1)
    running: list[RunningJob] = Field(default_factory=list)
    leaving: bool = False  # SIGTERM: takes no more offers
    sent_at: datetime


class Cancel(Message):
    """Stop these jobs: the worker kills their ffmpeg, frees their slots, removes what they wrote to storage, and
    reports no result of them. Safe to repeat: encode sends it again while a heartbeat lists a job it does not want."""

    jobs: list[JobKey]
    reason: str | None = None  # why, for the worker's log: "deleted", "failed", "stuck_restarted", "not_wanted"


class OutputResult(JobKey):
    worker: str
    instance: str
    outcome: Annotated[Outcome, BeforeValidator(read_outcome), Fallback(Outcome.FAILED)]
    object_key: str | None = None
    size: int | None = None
    reason: str | None = None
    message: str | None = None
    finished_at: datetime
    hls: HlsRendition | None = None  # completed: the output's HLS media playlist (none from an older worker)
    artwork: Artwork | None = None  # completed, and the offer asked for artwork


class ResultAck(Message):
    recorded: bool  # encode committed what it does with the result (applied, or ignored as stale)
    applied: bool


class StatusRequest(Message):
    """encode.status (v1): one video's processing state."""

    video_id: str


class OutputStatus(Message):
    height: int
    state: TolerantShownOutputState
    worker: str | None = None
    started_at: datetime | None = None
    restarts: int = 0


class ProcessingStatus(Message):
    video_id: str
    found: bool
    status: TolerantProcessingState = None  # None: not found, or a state this release does not know
    deadline_at: datetime | None = None
    busy_at: datetime | None = None
    outputs: list[OutputStatus] = Field(default_factory=list)
    failure_reason: str | None = None
    failure_message: str | None = None
    restarted: list[int] = Field(default_factory=list)  # outputs the stuck rule restarted on this request


class StatusesRequest(Message):
    """encode.status.v2: the processing states of several videos in one request (at most encode's
    `status_max_videos`; more are refused with an error reply)."""

    video_ids: list[str]


class ProcessingStatuses(Message):
    """The reply of encode.status.v2: one ProcessingStatus per distinct video asked (`found=False` for a video encode
    does not know), in the order asked."""

    videos: list[ProcessingStatus]
