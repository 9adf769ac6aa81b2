"""The `--json` document and the exit code: a figure that could not be read is null and listed under `unavailable`
with the reason; the exit code is 0 only when nothing is unavailable and every service is ready. A stack running
several releases is a warning (`warnings`), not a failure: it is what a rollout or an independent deploy looks like."""

from __future__ import annotations

import math
from typing import Any, TypeVar

from shared.release import ReleaseError, parse_version
from weir.status.limits import limits_mode
from weir.status.model import InstanceRelease, Snapshot, Unavailable, WebhookDeliveries
from weir.status.throttled import internal_refusals, throttled_view

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
        name: {"ready": r.ready, "url": r.url, "status": r.status, "checks": r.checks, "reason": r.reason,
               **_release_fields(r.release)}
        for name, r in services.items()
    }
    doc["versions"] = versions_running(s)

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

    shedding = part(s.shedding)
    doc["shedding"] = None if shedding is None else {
        name: None if isinstance(shed, Unavailable) else {
            "shed": shed.shed, "limit": _round(shed.limit), "in_flight": shed.in_flight, "waiting": shed.waiting,
            "auth_overloaded": shed.auth_overloaded}
        for name, shed in shedding.items()}

    view = throttled_view(s)
    doc["throttled"] = None if view is None else {
        "window_seconds": view.window_seconds, "windows": view.windows,
        "top": [c.model_dump() for c in view.top],
        "instances": view.instances,
    }

    doc["sweep"] = None if isinstance(s.sweep, Unavailable) else {"last_run": s.sweep}

    hooks = part(s.webhooks)
    doc["webhooks"] = None if hooks is None else {
        "endpoints": {"enabled": hooks.enabled, "disabled": hooks.disabled, "failing": hooks.failing},
        "deliveries": {"pending": hooks.pending, "oldest_pending_seconds": _round(hooks.oldest_pending_seconds),
                       "due": hooks.due, "oldest_due_seconds": _round(hooks.oldest_due_seconds),
                       "failed_last_hour": hooks.failed_last_hour},
        "late_after_seconds": hooks.late_after_seconds, "falling_behind": hooks.falling_behind,
    }

    doc["unavailable"] = document_unavailable(s)
    doc["warnings"] = warnings(s)
    doc["ok"] = exit_code(s) == 0
    return doc


def _release_fields(release: InstanceRelease | Unavailable | None) -> dict[str, str | bool | None]:
    """A service's `version` (a release, or NO_VERSION_ROUTE for one older than `/version`), `commit`, `dirty` (it
    runs changes not in that commit; None: not known), and `version_reason` when its /version could not be read."""
    if isinstance(release, InstanceRelease):
        return {"version": release.label, "commit": release.commit, "dirty": release.dirty, "version_reason": None}
    return {"version": None, "commit": None, "dirty": None,
            "version_reason": release.reason if isinstance(release, Unavailable) else None}


def _version_order(label: str) -> tuple[int, tuple[int, int, int], str]:
    """Oldest first: an instance without /version, then releases by number, then anything unparsable."""
    try:
        return 1, parse_version(label), label
    except ReleaseError:
        return (0 if not label[:1].isdigit() else 2), (0, 0, 0), label


def versions_running(s: Snapshot) -> dict[str, list[str]]:
    """Which instances run which release (only instances whose release was read), oldest release first."""
    if isinstance(s.services, Unavailable):
        return {}
    found: dict[str, list[str]] = {}
    for name, r in s.services.items():
        if isinstance(r.release, InstanceRelease):
            found.setdefault(r.release.label, []).append(name)
    return {label: sorted(found[label]) for label in sorted(found, key=_version_order)}


def warnings(s: Snapshot) -> list[str]:
    """What deserves a look without being a failure: several releases running at once, or one release from several
    commits (a rollout in progress, or an independent deploy left half done); webhook deliveries that may go waiting
    longer than a working deliverer lets them (a backlog growing faster than it is sent, or no deliverer); Weir's own
    internal traffic refused 429 (the post-mortem's lesson)."""
    found: list[str] = []
    hooks = s.webhooks
    if isinstance(hooks, WebhookDeliveries) and hooks.falling_behind:
        found.append(f"webhooks: {hooks.due} deliveries to endpoints that are not failing may go now, the oldest "
                     f"waiting {hooks.oldest_due_seconds:.0f} s (more than {hooks.late_after_seconds:g} s): "
                     "delivering falls behind")
    internal = internal_refusals(s)
    if internal:
        found.append("Weir's own internal traffic was refused 429 lately ("
                     + ", ".join(f"{n} by rule {rule}" for rule, n in internal.items())
                     + "): a bug report about the limits, not the limiter working")
    running = versions_running(s)
    if len(running) > 1:
        found.append(f"the stack runs {len(running)} versions: "
                     + "; ".join(f"{label} ({', '.join(names)})" for label, names in running.items()))
    if isinstance(s.services, Unavailable):
        return found
    commits: dict[str, dict[str, list[str]]] = {}
    for name, r in s.services.items():
        if isinstance(r.release, InstanceRelease) and r.release.version and r.release.commit:
            commits.setdefault(r.release.version, {}).setdefault(r.release.commit, []).append(name)
    for version, by_commit in commits.items():
        if len(by_commit) > 1:
            found.append(f"version {version} runs from {len(by_commit)} commits: "
                         + "; ".join(f"{c[:12]} ({', '.join(sorted(n))})" for c, n in sorted(by_commit.items())))
    return found


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

    for name in ("services", "streams", "consumers", "dlq", "outbox", "farm", "limits", "shedding", "throttled",
                 "sweep", "webhooks"):
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
