"""Wiring of the `media` service: one encoding worker: its slots and running ffmpeg jobs."""

from __future__ import annotations

from services.media.settings import MediaSettings
from shared.runtime import ServiceDefinition

SERVICE = ServiceDefinition(
    name="media",
    settings_cls=MediaSettings,
    publishes=("encode.progress", "encode.completed", "encode.failed"),
    description="one encoding worker: its slots and running ffmpeg jobs",
)
