"""Wiring of the `encode` service: per-video processing state: outputs, deadlines, busy_at, restarts."""

from __future__ import annotations

from services.encode.settings import EncodeSettings
from shared.runtime import ServiceDefinition

SERVICE = ServiceDefinition(
    name="encode",
    settings_cls=EncodeSettings,
    publishes=("dispatch.busy", "encode.started", "encode.completed", "encode.failed"),
    description="per-video processing state: outputs, deadlines, busy_at, restarts",
)
