"""The messages between `encode` and the `media` workers, and encode's processing status: core NATS, not events.

Why core NATS request/reply here and JetStream events elsewhere:
- A dispatch offer wants an answer now, from that worker (`accepted` or `busy`), or the certainty that none came
  (`unreachable`); a stored offer delivered later would be work queued without being accepted, which a worker must
  never do. An answer lost on the way leaves the offer *in doubt*, which encode resolves with the heartbeats.
- Heartbeats and cancellations repeat: losing one costs nothing, the next carries the same facts (a heartbeat that
  still lists a job encode does not want, say of a deleted video, gets the cancel again).
- A per-output result must not be lost, even when encode is down when the worker finishes. The worker first records
  it in its own table (the step that frees the slot), then delivers it to encode by request/reply until encode
  acknowledges it after its commit; any worker delivers any undelivered result, so a worker that dies after
  recording its result loses nothing. Encode applies a result once, keyed by the offer's attempt, so a delivery
  repeated after a lost acknowledgement changes nothing. (As an event on `encode.>` the result would reach the api's
  projection before encode decided whether to accept it, and could not say how many outputs remain.)

Each side declares these subjects on its FastStream broker (subscribers with the request model as their input,
publishers with their message model), so every service's AsyncAPI document lists them; a request that does not
validate is answered `{"error": {status, code, detail}}` at once (`shared.messaging.ErrorReplies`), which the caller
reads as a refusal, never as busy.

Every subject here is outside the subjects of every stream: a core request on a stream's subject would be stored by
JetStream, answered with a PubAck that races the real reply, and delivered to that stream's consumers as a malformed
event. That is why the ENCODE stream lists its event types one by one instead of `encode.>`, and `encode.status`
stays a plain request/reply.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

OFFER_PREFIX = "farm.offer"  # farm.offer.<worker instance>: request, answered accepted or busy at once
CANCEL_PREFIX = "farm.cancel"  # farm.cancel.<worker instance>: stop these jobs, encode does not want them
HEARTBEAT_SUBJECT = "farm.heartbeat"  # every worker, every media_heartbeat_seconds; every encode instance listens
RESULT_SUBJECT = "farm.result"  # request from a worker, answered by one encode instance after its commit
STATUS_SUBJECT = "encode.status"  # request from the api (GET /v1/videos/{id}): the processing state
ENCODE_QUEUE = "encode"  # encode's queue group for results and status requests
# how the per-worker subjects appear in the AsyncAPI documents: `{instance}` is the worker's instance id
OFFER_PATTERN = f"{OFFER_PREFIX}.{{instance}}"
CANCEL_PATTERN = f"{CANCEL_PREFIX}.{{instance}}"

JobClass = Literal["developer", "first_party"]
Outcome = Literal["completed", "failed", "handed_back"]
Height = Annotated[int, Field(gt=0)]


def offer_subject(instance: str) -> str:
    return f"{OFFER_PREFIX}.{instance}"


def cancel_subject(instance: str) -> str:
    return f"{CANCEL_PREFIX}.{instance}"


def rendition_key(video_id: str, height: int, attempt: int) -> str:
    """Where an output's file is stored: one key per attempt, so that a late, ignored attempt overwrites nothing."""
    return f"renditions/{video_id}/{height}p-{attempt}.mp4"


class Message(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")


class JobKey(Message):
    """One offer of one output: the attempt number grows with every offer of that output."""

    video_id: str
    output: Height
    attempt: int = Field(ge=1)


class Offer(JobKey):
    job_class: JobClass
    object_key: str
    source_height: Height | None = None


class OfferAnswer(Message):
    accepted: bool
    worker: str
    instance: str
    reason: str | None = None  # why busy


class RunningJob(JobKey):
    job_class: JobClass
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
    outcome: Outcome
    object_key: str | None = None
    size: int | None = None
    reason: str | None = None
    message: str | None = None
    finished_at: datetime


class ResultAck(Message):
    recorded: bool  # encode committed what it does with the result (applied, or ignored as stale)
    applied: bool


class StatusRequest(Message):
    video_id: str


class OutputStatus(Message):
    height: int
    state: Literal["pending", "encoding", "done", "cancelled"]  # cancelled: the video was deleted
    worker: str | None = None
    started_at: datetime | None = None
    restarts: int = 0


class ProcessingStatus(Message):
    video_id: str
    found: bool
    status: Literal["processing", "ready", "failed", "deleted"] | None = None
    deadline_at: datetime | None = None
    busy_at: datetime | None = None
    outputs: list[OutputStatus] = Field(default_factory=list)
    failure_reason: str | None = None
    failure_message: str | None = None
    restarted: list[int] = Field(default_factory=list)  # outputs the stuck rule restarted on this request
