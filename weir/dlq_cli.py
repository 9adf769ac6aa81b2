"""`weir dlq list|show|redrive|purge`: the dead-letter queue (SPEC 7), as the operator identity. A parked message's
state comes from its consumer's inbox (weir/inboxes.py): `handled` once the consumer has handled its event since
(re-driven or replayed), which `redrive` then removes from the DLQ."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.table import Table

from weir.deadletters import DeadLetterSettings, Parked, State, redact_body, redact_headers, redact_text, selected

dlq_app = typer.Typer(no_args_is_help=True, help="The dead-letter queue: what consumers parked, and why.")
console = Console()

def _event_type(value: str | None) -> str | None:
    """`--type` names `dlq.<type>`: one that no envelope can have (a space, a wildcard) is said at once."""
    from shared.events.envelope import EVENT_TYPE_PATTERN

    if value is not None and not re.fullmatch(EVENT_TYPE_PATTERN, value):
        raise typer.BadParameter(f"{value!r} is no event type (like upload.completed: lowercase dot-separated words)")
    return value


TypeOption = Annotated[str | None, typer.Option("--type", help="one event type (e.g. upload.completed)",
                                                callback=_event_type)]
SinceOption = Annotated[str | None, typer.Option(help="parked at or after this time (ISO 8601, UTC unless given)")]
InboxOption = Annotated[list[str] | None, typer.Option(
    "--inbox-schema", metavar="CONSUMER=SCHEMA", help="where a consumer's inbox is, when it is not a declared "
    "consumer in its service's schema (once per consumer)")]


@dataclass(frozen=True)
class Entry:
    parked: Parked
    state: str


def _settings() -> Any:
    from weir.cli import _settings as cli_settings  # the addresses and the operator's seed, as every command

    return cli_settings()


def _since(value: str | None) -> datetime | None:
    from weir.cli import _parse_time

    return _parse_time(value) if value is not None else None


T = TypeVar("T")


class Refused(Exception):
    """A request that cannot be carried out as given: said in one line, exit 1."""


def _run(go: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """`go()` on its own loop: no NATS (the broker fails fast) or a refusal ends the command in one line, exit 1."""
    from weir.cli import _run_tool

    try:
        return _run_tool(_settings(), go)  # type: ignore[no-any-return]
    except Refused as exc:
        console.print(f"[red]{exc}[/red]", soft_wrap=True)
        raise typer.Exit(1) from exc


@contextlib.asynccontextmanager
async def _operator() -> AsyncIterator[Any]:
    from shared.messaging import tool_broker

    async with tool_broker(_settings(), "dlq", fail_fast=True) as broker:  # no NATS: say so, never retry for ever
        yield broker.connection.jetstream()


@contextlib.asynccontextmanager
async def _database(warn: Callable[[str], None]) -> AsyncIterator[Any]:
    """A connection for the inboxes, or None (with a warning) when the database cannot be reached."""
    import asyncpg

    try:
        conn = await asyncpg.connect(_settings().database_url, timeout=5)
    except (OSError, asyncpg.PostgresError, TimeoutError) as exc:
        warn(f"the inboxes cannot be read ({type(exc).__name__}): states unknown")
        yield None
        return
    try:
        yield conn
    finally:
        await conn.close()


async def _states(conn: Any, parked: Iterable[Parked], overrides: dict[str, str]) -> dict[int, str]:
    """Each message's state by its consumer's inbox (one query per consumer)."""
    from weir.inboxes import InboxUnknown, handled, inbox_schema

    by_consumer: dict[str, list[Parked]] = defaultdict(list)
    states: dict[int, str] = {}
    for p in parked:
        states[p.seq] = State.UNKNOWN
        if p.consumer and p.event_id:
            by_consumer[p.consumer].append(p)
    if conn is None:
        return states
    for consumer, items in by_consumer.items():
        try:
            schema = inbox_schema(consumer, overrides)
        except InboxUnknown:
            continue
        done = await handled(conn, schema, consumer, [p.event_id for p in items if p.event_id])
        for p in items:
            states[p.seq] = State.HANDLED if p.event_id in done else State.PARKED
    return states


@contextlib.asynccontextmanager
async def inbox_reader(wanted: bool, overrides: dict[str, str]) -> AsyncIterator[Any]:
    """`replay`'s `handled(consumer, ids)` on the inboxes (None when not `wanted`); a consumer whose inbox cannot be
    read counts as unknown."""
    from weir.inboxes import InboxUnknown, handled, inbox_schema

    if not wanted:
        yield None
        return
    async with _database(_warn) as conn:
        async def count(consumer: str, ids: list[str]) -> int | None:
            if conn is None:
                return None
            try:
                return len(await handled(conn, inbox_schema(consumer, overrides), consumer, ids))
            except InboxUnknown as exc:
                _warn(str(exc))
                return None

        yield count


def _overrides(pairs: list[str] | None) -> dict[str, str]:
    from weir.inboxes import parse_overrides

    try:
        return parse_overrides(pairs or [])
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--inbox-schema") from exc


def _warn(line: str) -> None:
    console.print(f"[yellow]{line}[/yellow]", soft_wrap=True)


@dlq_app.command("list")
def dlq_list(
    event_type: TypeOption = None,
    since: SinceOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="one JSON document")] = False,
    inbox_schema: InboxOption = None,
) -> None:
    """The parked messages, oldest first: id (its DLQ sequence), when, type, consumer, deliveries, state (parked;
    handled: its consumer has handled the event since, and `redrive` removes it; unknown) and why, shortened."""
    settings = DeadLetterSettings()
    overrides = _overrides(inbox_schema)
    start = _since(since)

    async def go() -> list[Entry]:
        from weir.dlqbus import parked_messages

        async with _operator() as js:
            found = [p async for p in parked_messages(js, event_type=event_type, since=start,
                                                      batch=settings.fetch_batch)]
        async with _database(_warn) as conn:
            states = await _states(conn, found, overrides)
        return [Entry(p, states[p.seq]) for p in found]

    entries = _run(go)
    if as_json:
        print(json.dumps([{"id": e.parked.seq, "time": e.parked.time.isoformat(), "type": e.parked.event_type,
                           "consumer": e.parked.consumer, "deliveries": e.parked.deliveries, "state": e.state,
                           "event_id": e.parked.event_id, "reason": redact_text(e.parked.reason)}
                          for e in entries], indent=2))
        return
    table = Table("id", "parked at", "type", "consumer", "deliveries", "state", "event", "reason")
    for e in entries:
        reason = redact_text(e.parked.reason)
        width = settings.reason_width
        table.add_row(str(e.parked.seq), e.parked.time.isoformat(timespec="seconds"), e.parked.event_type,
                      e.parked.consumer or "", str(e.parked.deliveries or ""), e.state, e.parked.event_id or "",
                      reason if len(reason) <= width else reason[: width - 1] + "…")
    console.print(table)
    states = Counter(e.state for e in entries)
    console.print(f"{len(entries)} parked" + (f" ({', '.join(f'{n} {s}' for s, n in states.items())})"
                                              if entries else ""))


@dlq_app.command("show")
def dlq_show(
    message_id: Annotated[int, typer.Argument(metavar="ID", min=1, help="the id `weir dlq list` shows")],
    inbox_schema: InboxOption = None,
) -> None:
    """One parked message: its headers, the reason in full, its state and its body, with anything credential-like
    masked (keys and tokens down to their 12-character prefix). Exit code 1 when there is no such message."""
    overrides = _overrides(inbox_schema)

    async def go() -> Entry | None:
        from weir.dlqbus import parked_message

        async with _operator() as js:
            parked = await parked_message(js, message_id)
        if parked is None:
            return None
        async with _database(_warn) as conn:
            states = await _states(conn, [parked], overrides)
        return Entry(parked, states[parked.seq])

    entry = _run(go)
    if entry is None:
        console.print(f"[red]no parked message {message_id}[/red]")
        raise typer.Exit(1)
    p = entry.parked
    print(f"id: {p.seq}\nsubject: {p.subject}\nparked at: {p.time.isoformat()}\nconsumer: {p.consumer or '-'}\n"
          f"deliveries: {p.deliveries if p.deliveries is not None else '-'}\nstate: {entry.state}\n"
          f"reason: {redact_text(p.reason)}\nheaders:")
    for name, value in sorted(redact_headers(p.headers).items()):
        print(f"  {name}: {value}")
    print("body:")
    print(redact_body(p.data))


def _same_event(p: Parked) -> tuple[str | None, str, bytes]:
    """What makes two DLQ entries one parked event: a consumer parks the very body it received, on `dlq.<type>`."""
    return p.consumer, p.subject, p.data


@dataclass
class Copy:
    """One re-driven event: the DLQ entries it stands for (the same event parked more than once), its REPLAY
    sequence, and what became of it."""

    originals: list[Parked]
    replay_seq: int
    outcome: str | None = None  # State.HANDLED, State.PARKED (again), State.UNKNOWN; None: not seen within the wait
    again: list[Parked] = field(default_factory=list)  # its new DLQ entries, oldest first

    @property
    def first(self) -> Parked:
        return self.originals[0]


async def _follow(js: Any, conn: Any, copies: list[Copy], overrides: dict[str, str], settings: DeadLetterSettings,
                  after_seq: int) -> None:
    """Wait until every copy is accounted for, or WEIR_DLQ_REDRIVE_WAIT_SECONDS have passed: handled (its inbox),
    or parked again (a DLQ entry after `after_seq`; or acked by its replay durable without being handled: a park the
    DLQ's duplicate window dropped, its original entry standing for it)."""
    from weir.dlqbus import parked_messages, settled_through

    loop = asyncio.get_running_loop()
    deadline = loop.time() + settings.redrive_wait_seconds
    next_seq = after_seq + 1
    while True:
        waiting = [c for c in copies if c.outcome is None]
        if not waiting:
            return
        # the ack floors first: a consumer acks a copy after its inbox commit or its park, so both reads below are
        # final for what the floor has passed
        floors = {name: await settled_through(js, name) for name in {str(c.first.consumer) for c in waiting}}
        states = await _states(conn, [c.first for c in waiting], overrides)
        by_event = {_same_event(c.first): c for c in waiting}
        async for p in parked_messages(js, from_seq=next_seq, batch=settings.fetch_batch):
            next_seq = p.seq + 1
            if (found := by_event.get(_same_event(p))) is not None:
                found.again.append(p)
        for c in waiting:
            if states[c.first.seq] == State.HANDLED:
                c.outcome = State.HANDLED
            elif c.again:
                c.outcome = State.PARKED
            elif c.replay_seq <= floors[str(c.first.consumer)]:  # no inbox to ask: handled or parked, unknown
                c.outcome = State.PARKED if conn is not None else State.UNKNOWN
        if all(c.outcome is not None for c in waiting) or loop.time() >= deadline:
            return
        await asyncio.sleep(settings.poll_seconds)


@dlq_app.command("redrive")
def dlq_redrive(
    event_type: TypeOption = None,
    since: SinceOption = None,
    to: Annotated[str | None, typer.Option(help="only what this consumer parked (each message goes back to the "
                                           "consumer that parked it)")] = None,
    dry_run: Annotated[bool, typer.Option(help="say what would be re-driven, send nothing")] = False,
    inbox_schema: InboxOption = None,
) -> None:
    """Send parked events back to the consumer that parked them, on its replay subject (`replay.<consumer>.<type>`,
    read by its `<consumer>_replay` durable; its inbox keeps a second delivery from changing anything), then wait
    up to WEIR_DLQ_REDRIVE_WAIT_SECONDS, or until each copy is handled or parked again, and remove from the DLQ what
    was handled (and what its consumer had handled already). A copy parked again takes its original's place: the
    DLQ keeps one entry per failing event (the same event parked more than once is re-driven once, and its entries
    become one). What is handled later shows `handled`.

    Exit code 0 when everything selected was handled, 1 when some is still parked or could not be sent."""
    settings = DeadLetterSettings()
    overrides = _overrides(inbox_schema)
    start = _since(since)

    async def go() -> int:
        from shared.contracts import CONSUMERS
        from shared.replay import takes_replays
        from weir.dlqbus import (
            last_parked_seq,
            new_run_id,
            parked_messages,
            redrive,
            remove,
            replay_readers,
        )

        cli = _settings()
        async with _operator() as js, _database(_warn) as conn:
            if to is not None:
                known = {c.name for c in CONSUMERS} | await replay_readers(js)
                if to not in known:
                    raise Refused(f"--to: no consumer {to!r} (known: {', '.join(sorted(known))})")
            chosen = [p async for p in parked_messages(js, event_type=event_type, since=start,
                                                       batch=settings.fetch_batch)
                      if selected(p, event_type=event_type, since=start, consumer=to)]
            states = await _states(conn, chosen, overrides)
            readers = {c: await takes_replays(js, c) for c in {p.consumer for p in chosen if p.consumer}}
            already = [p for p in chosen if states[p.seq] == State.HANDLED]
            skipped = [p for p in chosen if not p.consumer or not readers.get(p.consumer)]
            sendable = [p for p in chosen if p not in already and p not in skipped]
            for p in skipped:
                _warn(f"{p.seq}: " + (f"consumer {p.consumer} has no replay durable" if p.consumer
                                      else "no consumer named: not re-driven"))
            events: dict[tuple[str | None, str, bytes], list[Parked]] = defaultdict(list)
            for p in sendable:
                events[_same_event(p)].append(p)
            duplicates = len(sendable) - len(events)
            by_consumer = Counter(str(key[0]) for key in events)
            verb = "would re-drive" if dry_run else "re-driving"
            console.print(f"{len(chosen)} parked selected; {verb} {len(events)}"
                          + (f" ({', '.join(f'{n} to {c}' for c, n in sorted(by_consumer.items()))})"
                             if events else "")
                          + f"; {len(already)} handled already" + ("" if dry_run else ", removed")
                          + (f"; {duplicates} duplicate entr{'y' if duplicates == 1 else 'ies'} of them"
                             if duplicates else ""))
            if dry_run:
                return 0
            run_id = new_run_id()
            after_seq = await last_parked_seq(js)  # what is parked after this is a copy parked again
            copies: list[Copy] = []
            unsent = 0
            for originals in events.values():
                p = originals[0]
                try:
                    seq = await redrive(js, p, str(p.consumer), run_id, timeout=cli.bus_publish_timeout_seconds)
                except Exception as exc:  # JetStream did not take it: it stays parked, the rest goes on
                    _warn(f"{p.seq}: not re-driven ({type(exc).__name__}: {exc})")
                    unsent += len(originals)
                    continue
                copies.append(Copy(originals, seq))
            await _follow(js, conn, copies, overrides, settings, after_seq)

            async def removed(entries: Iterable[Parked]) -> list[int]:
                return [p.seq for p in entries if await remove(js, p.seq)]

            handled = await removed(already)
            replaced: list[int] = []
            for c in copies:
                if c.outcome == State.HANDLED:
                    handled += await removed([*c.originals, *c.again])
                elif c.again:  # parked again: its newest entry, with this delivery's reason, stands for the event
                    replaced += await removed([*c.originals, *c.again[:-1]])
                else:  # parked again within the duplicate window, or not seen yet: its first entry stands for it
                    replaced += await removed(c.originals[1:])
            # what stands in the DLQ for the selection now: one entry per event not handled, and what was not sent
            left = (len(skipped) + unsent + sum(c.outcome != State.HANDLED for c in copies))
            again = sum(c.outcome == State.PARKED for c in copies)
            unseen = sum(c.outcome is None or c.outcome == State.UNKNOWN for c in copies)
            console.print(f"re-driven {len(copies)} (run {run_id}); handled and removed {len(handled)}"
                          + (f" ({', '.join(map(str, sorted(handled)))})" if handled else "")
                          + f"; parked again {again}"
                          + (f" (older entries of the same events removed: {', '.join(map(str, sorted(replaced)))})"
                             if replaced else "")
                          + (f"; not seen handled or parked within the wait {unseen}" if unseen else "")
                          + f"; still parked {left}")
            return 0 if left == 0 else 1

    raise typer.Exit(_run(go))


@dlq_app.command("purge")
def dlq_purge(
    event_type: TypeOption = None,
    yes: Annotated[bool, typer.Option("--yes", help="do not ask for confirmation")] = False,
) -> None:
    """Remove every parked message (of one type), after a confirmation: what is purged cannot be re-driven."""

    async def count() -> int:
        from weir.dlqbus import parked_messages

        async with _operator() as js:
            return len([p async for p in parked_messages(js, event_type=event_type)])

    found = _run(count)
    what = f"{found} parked messages" + (f" of {event_type}" if event_type else "")
    if found == 0:
        console.print("nothing parked")
        return
    if not yes and not typer.confirm(f"purge {what}? they cannot be re-driven afterwards", default=False):
        console.print("nothing purged")
        raise typer.Exit(1)

    async def go() -> int:
        from weir.dlqbus import purge

        async with _operator() as js:
            return await purge(js, event_type)

    console.print(f"purged {_run(go)} parked messages" + (f" of {event_type}" if event_type else ""))
