"""The headers Weir's messages carry, and the sender's release among them: importable without a NATS client (the
operator's commands that only name them, e.g. `weir dlq`, start in a fraction of the time; shared/bus.py re-exports
them)."""

from __future__ import annotations

from collections.abc import Mapping

from shared.release import VERSION

__all__ = [
    "HDR_CONSUMER", "HDR_DELIVERIES", "HDR_ERROR", "HDR_LEGACY_COPY", "HDR_MSG_ID", "HDR_ORIGINAL_SUBJECT",
    "HDR_REPROCESS", "HDR_TYPE", "HDR_VERSION", "JSON", "UNKNOWN_VERSION", "VERSION_HEADER", "sender_version",
]

HDR_MSG_ID = "Nats-Msg-Id"
HDR_REPROCESS = "Weir-Reprocess"
HDR_TYPE = "Weir-Type"
HDR_ERROR = "Weir-Error"
HDR_CONSUMER = "Weir-Consumer"
HDR_ORIGINAL_SUBJECT = "Weir-Original-Subject"
HDR_DELIVERIES = "Weir-Deliveries"
HDR_LEGACY_COPY = "Weir-Legacy-Copy"  # 1: a copy on the bare type of an event also on its account subject (SPEC 11)
# the sender's release (shared/release.py VERSION), on every request, reply and event Weir sends: a reader that cannot
# read a message names both releases. A message without it comes from a release before 1.1.0.
HDR_VERSION = "Weir-Version"
UNKNOWN_VERSION = "unknown"
VERSION_HEADER = {HDR_VERSION: VERSION}  # nats-py's `headers=`: copy it where a publish adds headers of its own
JSON = {"content-type": "application/json"}


def sender_version(headers: Mapping[str, str] | None) -> str:
    """The release that sent a message (its `Weir-Version` header), "unknown" for one without (before 1.1.0)."""
    return (headers or {}).get(HDR_VERSION) or UNKNOWN_VERSION
