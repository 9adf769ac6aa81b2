"""Wiring of the `sweep` service: sweep runs and their ledger; retires uploads that never received a file."""

from __future__ import annotations

from services.sweep.settings import SweepSettings
from shared.runtime import ServiceDefinition

SERVICE = ServiceDefinition(
    name="sweep",
    settings_cls=SweepSettings,
    publishes=("video.retired",),
    description="sweep runs and their ledger; retires uploads that never received a file",
)
