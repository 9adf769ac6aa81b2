"""What a finished output carries for playback (SPEC 14): its HLS media playlist and, for one job of each video, the
poster and storyboard. Made by a media worker, carried in its result to encode and in `encode.completed` to the api.

Read tolerantly like every message between services (unknown fields ignored). Storage keys are per attempt, under
the video's own prefix (`renditions/<video>/`), so a late, ignored attempt overwrites nothing and a deleted video's
files go with one listing.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

RENDITIONS_PREFIX = "renditions"


def video_prefix(video_id: str) -> str:
    """Every file encoding makes of a video is under this prefix (MP4 renditions, HLS, poster, storyboard)."""
    return f"{RENDITIONS_PREFIX}/{video_id}/"


def hls_prefix(video_id: str, height: int, attempt: int) -> str:
    """One attempt's HLS files: `index.m3u8` (the media playlist), `init.mp4` and the `.m4s` segments."""
    return f"{video_prefix(video_id)}{height}p-{attempt}/"


def artwork_prefix(video_id: str, attempt: int) -> str:
    """One attempt's poster, sprite and storyboard WebVTT."""
    return f"{video_prefix(video_id)}artwork-{attempt}/"


class Carried(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")


class HlsRendition(Carried):
    """One output's HLS media playlist and what the master playlist says of it, measured on the files written."""

    playlist_key: str = Field(min_length=1, description="Storage key of the media playlist (index.m3u8); its URIs "
                                                       "(init.mp4, the segments) are relative to it.")
    bandwidth: int = Field(gt=0, description="Peak segment bit rate, bits/s (the master's BANDWIDTH).")
    average_bandwidth: int = Field(gt=0, description="Whole-rendition bit rate, bits/s (AVERAGE-BANDWIDTH).")
    codecs: str = Field(min_length=1, description='RFC 6381 codecs of the streams, e.g. "avc1.64001f,mp4a.40.2".')
    width: int = Field(gt=0)
    height: int = Field(gt=0)
    frame_rate: float | None = Field(default=None, gt=0)
    segments: int = Field(ge=1, description="How many media segments.")
    duration: float = Field(ge=0, description="Seconds, the sum of the segments' durations.")


class Artwork(Carried):
    """A video's poster and storyboard: one sprite of tiles and a WebVTT file mapping times to tiles."""

    poster_key: str = Field(min_length=1)
    poster_time: float = Field(ge=0, description="Seconds into the video the poster shows.")
    poster_width: int = Field(gt=0)
    poster_height: int = Field(gt=0)
    sprite_key: str = Field(min_length=1)
    storyboard_key: str = Field(min_length=1, description="The WebVTT file; its cue URIs name the sprite by its "
                                                         "file name with a #xywh= fragment.")
    tile_width: int = Field(gt=0)
    tile_height: int = Field(gt=0)
    tiles: int = Field(ge=1)
    interval: float = Field(gt=0, description="Seconds between tiles.")
    duration: float = Field(ge=0, description="Seconds of video the storyboard covers.")
