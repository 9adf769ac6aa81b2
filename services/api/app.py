"""Wiring of the `api` service: the public HTTP API; video rows and their upload state."""

from __future__ import annotations

from services.api.settings import ApiSettings
from shared.runtime import ServiceDefinition

SERVICE = ServiceDefinition(
    name="api",
    settings_cls=ApiSettings,
    publishes=("upload.completed", "video.created", "video.deleted"),
    description="the public HTTP API; video rows and their upload state",
)
