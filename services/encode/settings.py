from __future__ import annotations

from pydantic import Field

from shared.settings import CommonSettings


class EncodeSettings(CommonSettings):
    processing_deadline_seconds: float = Field(10800, gt=0, description="processing deadline after processing starts")
    dispatch_retry_seconds: float = Field(20, gt=0, description="interval between dispatch rounds")
    stuck_restart_seconds: float = Field(21600, gt=0, description="encoding time after which an output is restarted")
    media_heartbeat_seconds: float = Field(5, gt=0, description="interval of worker heartbeats")
    media_heartbeat_timeout_seconds: float = Field(
        15, gt=0, description="a worker silent this long is dead; its outputs go back to pending"
    )
    dispatch_answer_timeout_ms: int = Field(1000, gt=0, description="how long a round waits for a worker's answer")
    dispatch_concurrency: int = Field(8, ge=1, description="videos whose rounds run at once in one instance")
    output_max_failures: int = Field(3, ge=1, description="failed encodes of one output before the video fails")
    status_max_videos: int = Field(100, ge=1, description="most videos one encode.status.v2 request may ask about "
                                   "(the api asks a listing page in one); a request for more is refused")
    probe_url_ttl_seconds: int = Field(600, gt=0, description="lifetime of the URL a source is probed through")
    recording_owner_wait_seconds: float = Field(
        30, gt=0, description="how long a team's developer-class recording of a video whose account encode does not "
        "know yet waits for it (video.created is read by another durable) before it is refused `unknown_video`")
    delete_batch_size: int = Field(1000, ge=1, le=1000, description="objects removed per storage request when a "
                                   "deleted video's files go (a listing, then one DeleteObjects, per batch)")
