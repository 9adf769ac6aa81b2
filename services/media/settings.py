from __future__ import annotations

import os

from pydantic import Field

from shared.settings import CommonSettings


def _default_slots() -> int:
    return max(1, (os.cpu_count() or 1) // 2)


class MediaSettings(CommonSettings):
    media_slots: int = Field(default_factory=_default_slots, ge=1, description="encoding slots (half the cores)")
    media_heartbeat_seconds: float = Field(5, gt=0, description="interval of worker heartbeats")
    media_worker_id: str = Field("", description="worker name (default: host and pid)")
    media_x264_preset: str = Field("veryfast", pattern=r"^[a-z]+$", description="libx264 preset of renditions")
    media_x264_crf: int = Field(23, ge=0, le=51, description="libx264 constant rate factor of renditions")
    media_audio_bitrate_kbps: int = Field(128, ge=8, description="AAC bitrate of renditions")
    media_progress_seconds: float = Field(1.0, gt=0, description="least interval between encode.progress events")
    media_read_rate: float = Field(
        0.0, ge=0, description="read sources at most this many times real time (0: unlimited; tests hold slots)"
    )
    media_drain_seconds: float = Field(
        5.0, ge=0, description="on SIGTERM, time running jobs get to finish before they are handed back"
    )
    media_result_retry_seconds: float = Field(1.0, gt=0, description="interval of retries to deliver results")
    media_source_url_ttl_seconds: int = Field(6 * 3600, description="lifetime of the source URL ffmpeg reads")
    media_work_dir: str = Field("", description="directory for renditions being written (default: the temp dir)")
