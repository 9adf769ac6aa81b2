from __future__ import annotations

import os

from pydantic import Field

from shared.settings import CommonSettings


def _default_slots() -> int:
    return max(1, (os.cpu_count() or 1) // 2)


class MediaSettings(CommonSettings):
    media_slots: int = Field(default_factory=_default_slots, ge=1, description="encoding slots (half the cores)")
    media_heartbeat_seconds: float = Field(5, description="interval of worker heartbeats")
    media_worker_id: str = Field("", description="worker name (default: host and pid)")
