"""The terminal view of a snapshot: one table per part; an unreadable part is one red line with its reason."""

from __future__ import annotations

from datetime import UTC

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from weir.status.model import InstanceRelease, Readiness, Snapshot, Unavailable
from weir.status.throttled import throttled_view
from weir.status.verdict import document_unavailable, exit_code, not_ready, warnings


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _na(reason: str) -> Text:
    return Text(f"unavailable: {reason}", style="red")


def _release(r: Readiness) -> tuple[Text, str]:
    """The version and short commit columns of an instance."""
    if isinstance(r.release, InstanceRelease):
        return (Text(r.release.label, "" if r.release.version else "yellow"),
                (r.release.commit or "")[:12] + ("+dirty" if r.release.dirty else ""))
    if isinstance(r.release, Unavailable):
        return _na(r.release.reason), ""
    return Text("-"), ""


def render(s: Snapshot) -> RenderableType:
    """The terminal view: one table per part; an unreadable part is one red line with its reason."""
    parts: list[RenderableType] = []
    code = exit_code(s)
    gaps = document_unavailable(s)
    waiting = not_ready(s)
    summary = "everything answered and is ready" if code == 0 else ", ".join(
        ([f"not ready: {', '.join(waiting)}"] if waiting else [])
        + ([f"{len(gaps)} figure(s) unavailable"] if gaps else [])
        + (["no service addresses"] if not isinstance(s.services, Unavailable) and not s.services else []))
    parts.append(Text(f"weir status at {s.checked_at.astimezone(UTC):%Y-%m-%d %H:%M:%S} UTC: {summary}",
                      style="bold green" if code == 0 else "bold red"))
    parts += [Text(f"warning: {w}", style="yellow") for w in warnings(s)]

    if isinstance(s.services, Unavailable):
        parts.append(Text.assemble("services: ", _na(s.services.reason)))
    else:
        table = Table("service", "ready", "version", "commit", "url", "detail", title="services",
                      title_justify="left")
        for name, r in s.services.items():
            table.add_row(name, Text("ready", "green") if r.ready else Text("NOT READY", "red"), *_release(r),
                          r.url, r.reason or "")
        parts.append(table)

    if isinstance(s.streams, Unavailable):
        parts.append(Text.assemble("streams: ", _na(s.streams.reason)))
    else:
        table = Table("stream", "messages", "consumers", title="streams", title_justify="left")
        for name, st in s.streams.items():
            if isinstance(st, Unavailable):
                table.add_row(name, _na(st.reason), "")
            else:
                table.add_row(name, str(st.messages), str(st.consumers))
        parts.append(table)

    if isinstance(s.consumers, Unavailable):
        parts.append(Text.assemble("consumers: ", _na(s.consumers.reason)))
    else:
        table = Table("stream", "consumer", "pending", "ack pending", "redelivered", title="consumers",
                      title_justify="left")
        for stream, listed in s.consumers.items():
            if isinstance(listed, Unavailable):
                table.add_row(stream, _na(listed.reason), "", "", "")
                continue
            for c in listed:
                table.add_row(c.stream, c.name, str(c.pending), str(c.ack_pending),
                              Text(str(c.redelivered), "yellow" if c.redelivered else ""))
        parts.append(table)

    if isinstance(s.outbox, Unavailable):
        parts.append(Text.assemble("outbox: ", _na(s.outbox.reason)))
    else:
        table = Table("service", "unsent", "oldest unsent", title="outbox", title_justify="left")
        for name, b in s.outbox.items():
            if isinstance(b, Unavailable):
                table.add_row(name, _na(b.reason), "")
            else:
                table.add_row(name, Text(str(b.unsent), "yellow" if b.unsent else ""), _age(b.oldest_seconds))
        parts.append(table)

    if isinstance(s.dlq, Unavailable):
        parts.append(Text.assemble("dlq: ", _na(s.dlq.reason)))
    elif not s.dlq:
        parts.append(Text("dlq: empty"))
    else:
        table = Table("event type", "parked", title="dlq", title_justify="left")
        for event_type, n in s.dlq.items():
            table.add_row(event_type, Text(str(n), "yellow"))
        parts.append(table)

    if isinstance(s.farm, Unavailable):
        parts.append(Text.assemble("farm: ", _na(s.farm.reason)))
    else:
        farm = s.farm
        table = Table("worker", "instance", "slots", "busy", "last heartbeat", title=(
            f"farm: {len(farm.workers)} worker(s), {farm.busy} of {farm.slots} slot(s) busy"
            + (f", {len(farm.leaving)} leaving" if farm.leaving else "")), title_justify="left")
        for w in (*farm.workers, *farm.leaving):
            table.add_row(w.name + (" (leaving)" if w.leaving else ""), w.instance[:12], str(w.slots), str(w.busy),
                          f"{w.seen_seconds_ago:.1f} s ago")
        parts.append(table)

    if isinstance(s.limits, Unavailable):
        parts.append(Text.assemble("limits store: ", _na(s.limits.reason)))
    else:
        line = Text("limits store: ")
        for i, (name, mode) in enumerate(s.limits.items()):
            line.append(", " if i else "")
            if isinstance(mode, Unavailable):
                line.append(f"{name} ")
                line.append_text(_na(mode.reason))
            else:
                line.append(f"{name} {mode}", style="green" if mode == "shared" else "yellow")
        parts.append(line)

    if isinstance(s.shedding, Unavailable):
        parts.append(Text.assemble("shedding: ", _na(s.shedding.reason)))
    else:
        line = Text("shedding (503 overloaded since start): ")
        for i, (name, shed) in enumerate(s.shedding.items()):
            line.append("; " if i else "")
            if isinstance(shed, Unavailable):
                line.append(f"{name} ")
                line.append_text(_na(shed.reason))
                continue
            by = ", ".join(f"{p} {n}" for p, n in shed.shed.items() if n) or "none"
            line.append(f"{name} {by}", style="yellow" if shed.total else "green")
            if shed.limit is not None:
                line.append(f" (limit {shed.limit:.0f}, {shed.in_flight or 0:.0f} in flight, "
                            f"{shed.waiting or 0:.0f} waiting)")
            if shed.auth_overloaded:
                line.append(f", {shed.auth_overloaded} shed by auth")
        parts.append(line)

    parts.append(_throttled(s))

    if isinstance(s.sweep, Unavailable):
        parts.append(Text.assemble("sweep: ", _na(s.sweep.reason)))
    elif s.sweep is None:
        parts.append(Text("sweep: no run yet"))
    else:
        run = s.sweep
        retired = sum(int(n) for n in (run.get("retired") or {}).values())
        parts.append(Text(
            f"sweep: last run {run.get('started_at')} ({run.get('trigger')}"
            f"{', dry run' if run.get('dry_run') else ''}): {run.get('outcome')}, examined {run.get('examined')}, "
            f"retired {retired}, errors {run.get('errors')}"))

    if isinstance(s.webhooks, Unavailable):
        parts.append(Text.assemble("webhooks: ", _na(s.webhooks.reason)))
    elif s.webhooks is not None:
        hooks = s.webhooks
        line = Text(f"webhooks: endpoints {hooks.enabled} enabled ({hooks.failing} failing), "
                    f"{hooks.disabled} disabled; deliveries pending {hooks.pending} "
                    f"(oldest {_age(hooks.oldest_pending_seconds)}), ")
        line.append(f"{hooks.due} may go now (oldest waiting {_age(hooks.oldest_due_seconds)})",
                    style="yellow" if hooks.falling_behind else "")
        line.append(f", failed in the last hour {hooks.failed_last_hour}",
                    style="yellow" if hooks.failed_last_hour else "")
        parts.append(line)

    return Group(*parts)


def _throttled(s: Snapshot) -> RenderableType:
    """Who is throttled: the callers refused 429 most lately, every auth instance's together (ids and key prefixes,
    or the address when no account is known)."""
    if s.throttled is None:
        return Text("throttled: not read (auth's /throttled needs Weir's internal token: WEIR_INTERNAL_TOKEN)")
    if isinstance(s.throttled, Unavailable):
        return Text.assemble("throttled: ", _na(s.throttled.reason))
    unread = Text()
    for name, report in s.throttled.items():
        if isinstance(report, Unavailable):
            unread.append(f"{chr(10) if unread else ''}throttled: {name} ")
            unread.append_text(_na(report.reason))
    view = throttled_view(s)
    if view is None:
        return unread
    span = view.window_seconds * view.windows
    title = f"throttled (429) in the last {_age(span)}, most refused first"
    if not view.top:
        return Group(Text(f"{title}: nobody"), unread) if unread else Text(f"{title}: nobody", style="green")
    table = Table("caller", "rule", "account", "app", "key prefix", "address", "refused", title=title,
                  title_justify="left")
    for c in view.top:
        table.add_row(Text(c.caller, "red" if c.caller == "internal" else ""), c.rule, c.account_id or "-",
                      c.app_id or "-", c.key_prefix or "-", c.address or "-",
                      f"{c.refused}" + (f" (up to {c.error} over)" if c.error else ""))
    return Group(table, unread) if unread else table
