from __future__ import annotations

from pydantic import Field

from shared.settings import CommonSettings


class EncodeSettings(CommonSettings):
    processing_deadline_seconds: int = Field(10800, description="processing deadline after processing starts")
    dispatch_retry_seconds: float = Field(20, description="interval between dispatch rounds")
    stuck_restart_seconds: int = Field(21600, description="encoding time after which an output is restarted")
    media_heartbeat_seconds: float = Field(5, description="interval of worker heartbeats")
    dispatch_answer_timeout_ms: int = Field(1000, description="how long a round waits for a worker's answer")
