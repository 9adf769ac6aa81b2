from __future__ import annotations

import os

from pydantic import Field, model_validator

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
    media_hls: bool = Field(True, description="package each rendition as HLS (CMAF) and make the video's poster and "
                            "storyboard; false: the MP4 renditions alone (a baseline, or a farm that serves none)")
    media_ladder_nice: int = Field(10, ge=0, le=19, description="niceness of the ffmpeg of every job but the one "
                                   "that makes the video's first playable rendition (its lowest output, which also "
                                   "makes the artwork): on a worker running several outputs at once, the lowest gets "
                                   "the CPU first, so playback starts sooner and the whole ladder takes as long "
                                   "(0: all alike)")
    media_keyframe_seconds: float = Field(2.0, gt=0, description="a keyframe every this many seconds of video, at the "
                                          "same times in every rendition (segments align across the ladder)")
    media_hls_segment_seconds: float = Field(4.0, gt=0, description="HLS segment duration; a multiple of "
                                             "media_keyframe_seconds, so each segment starts on a keyframe")
    media_upload_concurrency: int = Field(8, ge=1, description="HLS files of one job uploaded at once")
    media_poster_seconds: float = Field(1.0, ge=0, description="time of the poster frame (kept inside the video)")
    media_poster_max_height: int = Field(720, ge=2, description="the poster is the source's size, at most this tall")
    media_storyboard_tile_width: int = Field(160, ge=16, description="width of a storyboard tile, pixels")
    media_storyboard_max_tiles: int = Field(100, ge=1, description="most tiles of a storyboard: their interval grows "
                                            "(in keyframe intervals) with the video's duration")
    media_storyboard_columns: int = Field(10, ge=1, description="tiles per row of the storyboard sprite")
    media_jpeg_quality: int = Field(5, ge=2, le=31, description="ffmpeg -q:v of the poster and sprite (2 best)")

    @model_validator(mode="after")
    def _segments_start_on_keyframes(self) -> MediaSettings:
        ratio = self.media_hls_segment_seconds / self.media_keyframe_seconds
        if ratio < 1 - 1e-9 or abs(ratio - round(ratio)) > 1e-6:
            raise ValueError("media_hls_segment_seconds must be a multiple of media_keyframe_seconds")
        return self
