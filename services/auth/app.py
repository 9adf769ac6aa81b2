"""Wiring of the `auth` service: accounts, users, apps, keys, upload-token signing and every request-limit counter."""

from __future__ import annotations

from services.auth.settings import AuthSettings
from shared.runtime import ServiceDefinition

SERVICE = ServiceDefinition(
    name="auth",
    settings_cls=AuthSettings,
    publishes=("credential.rejected", "key.created", "key.revoked"),
    description="accounts, users, apps, keys, upload-token signing and every request-limit counter",
)
