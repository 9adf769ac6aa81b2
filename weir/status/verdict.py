"""The `--json` document and the exit code: a figure that could not be read is null and listed under `unavailable`
with the reason; the exit code is 0 only when nothing is unavailable and every service is ready."""

from __future__ import annotations

import math
from typing import Any, TypeVar

from weir.status.limits import limits_mode
from weir.status.model import Snapshot, Unavailable

T = TypeVar("T")


def _round(value: float | None) -> float | None:
    return None if value is None or math.isnan(value) else round(value, 3)


def document(s: Snapshot) -> dict[str, Any]:
    """The `--json` document. A figure that could not be read is null, and `unavailable` says why, by its path
    (`outbox.media`, `streams.LIMITS`, `farm`); `ok` is what the exit code says."""

    def part(value: T | Unavailable) -> T | None:
        return None if isinstance(value, Unavailable) else value

    doc: dict[str, Any] = {"checked_at": s.checked_at.isoformat()}

    services = part(s.services)
    doc["services"] = None if services is None else {
        name: {"ready": r.ready, "url": r.url, "status": r.status, "checks": r.checks, "reason": r.reason}
        for name, r in services.items()
    }

    streams = part(s.streams)
    if streams is not None:
        doc["streams"] = []
        for name, st in streams.items():
            got = part(st)
            doc["streams"].append({"name": name, "messages": got.messages if got else None,
                                   "bytes": got.bytes if got else None, "consumers": got.consumers if got else None})
    else:
        doc["streams"] = None

    consumers = part(s.consumers)
    if consumers is not None:
        doc["consumers"] = []
        for listed in consumers.values():
            for c in part(listed) or []:
                doc["consumers"].append({"stream": c.stream, "name": c.name, "pending": c.pending,
                                         "ack_pending": c.ack_pending, "redelivered": c.redelivered,
                                         "waiting": c.waiting})
    else:
        doc["consumers"] = None

    outbox = part(s.outbox)
    if outbox is not None:
        backlogs = {name: part(b) for name, b in outbox.items()}
        doc["outbox"] = {name: b.unsent if b else None for name, b in backlogs.items()}
        doc["outbox_oldest_unsent_seconds"] = {name: _round(b.oldest_seconds) if b else None
                                               for name, b in backlogs.items()}
    else:
        doc["outbox"] = doc["outbox_oldest_unsent_seconds"] = None

    doc["dlq"] = part(s.dlq)

    farm = part(s.farm)
    doc["farm"] = None if farm is None else {
        "workers": len(farm.workers), "slots": farm.slots, "busy": farm.busy, "leaving": len(farm.leaving),
        "heartbeat_timeout_seconds": farm.heartbeat_timeout_seconds,
        "detail": [{"name": w.name, "instance": w.instance, "slots": w.slots, "busy": w.busy,
                    "seen_seconds_ago": _round(w.seen_seconds_ago), "leaving": w.leaving}
                   for w in (*farm.workers, *farm.leaving)],
    }

    limits = part(s.limits)
    if limits is not None:
        instances = {name: part(m) for name, m in limits.items()}
        modes = {name: m for name, m in instances.items() if m is not None}
        # one instance that cannot be read leaves the stack's mode unknown
        doc["limits"] = {"mode": limits_mode(modes.values()) if len(modes) == len(instances) else None,
                         "instances": instances}
    else:
        doc["limits"] = None

    doc["sweep"] = None if isinstance(s.sweep, Unavailable) else {"last_run": s.sweep}

    doc["unavailable"] = document_unavailable(s)
    doc["ok"] = exit_code(s) == 0
    return doc


def not_ready(s: Snapshot) -> list[str]:
    """The services that are not ready (an empty list when the services could not be listed at all)."""
    if isinstance(s.services, Unavailable):
        return []
    return [name for name, r in s.services.items() if not r.ready]


def document_unavailable(s: Snapshot) -> dict[str, str]:
    """Every figure that could not be read, by its path, with why."""
    found: dict[str, str] = {}

    def visit(path: str, value: object) -> None:
        if isinstance(value, Unavailable):
            found[path] = value.reason
        elif isinstance(value, dict) and path != "sweep":
            for key, inner in value.items():
                visit(f"{path}.{key}", inner)

    for name in ("services", "streams", "consumers", "dlq", "outbox", "farm", "limits", "sweep"):
        value = getattr(s, name)
        if name == "services" and not isinstance(value, Unavailable):
            continue  # a service that does not answer is not ready, not unavailable
        visit(name, value)
    return found


def exit_code(s: Snapshot) -> int:
    """0 when every figure was read and every service is ready (at least one was asked); 1 otherwise. A DLQ that
    holds messages, a backlog or the limits store on local windows are figures read, not failures."""
    if document_unavailable(s) or not_ready(s) or isinstance(s.services, Unavailable) or not s.services:
        return 1
    return 0
