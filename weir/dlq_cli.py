"""`weir dlq list|show|redrive|purge`: the dead-letter queue (SPEC 7), as the operator identity. A parked message's
state comes from its consumer's inbox (weir/inboxes.py): `handled` once the consumer has handled its event since
(re-driven or replayed), which `redrive` then removes from the DLQ."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from weir.deadletters import DeadLetterSettings, Parked, State, redact_body, redact_headers, redact_text, selected

dlq_app = typer.Typer(no_args_is_help=True, help="The dead-letter queue: what consumers parked, and why.")
console = Console()

TypeOption = Annotated[str | None, typer.Option("--type", help="one event type (e.g. upload.completed)")]
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


@contextlib.asynccontextmanager
async def _operator() -> AsyncIterator[Any]:
    from shared.messaging import tool_broker

    async with tool_broker(_settings(), "dlq") as broker:
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

    entries = asyncio.run(go())
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
    message_id: Annotated[int, typer.Argument(metavar="ID", help="the id `weir dlq list` shows")],
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

    entry = asyncio.run(go())
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
    up to WEIR_DLQ_REDRIVE_WAIT_SECONDS for them to be handled and remove from the DLQ what was (and what its
    consumer had handled already). What fails again is parked again; what is handled later shows `handled`.

    Exit code 0 when everything selected was handled, 1 when some is still parked or could not be sent."""
    settings = DeadLetterSettings()
    overrides = _overrides(inbox_schema)
    start = _since(since)

    async def go() -> int:
        from weir.dlqbus import has_replay_durable, new_run_id, parked_messages, redrive, remove

        cli = _settings()
        async with _operator() as js, _database(_warn) as conn:
            chosen = [p async for p in parked_messages(js, event_type=event_type, since=start,
                                                       batch=settings.fetch_batch)
                      if selected(p, event_type=event_type, since=start, consumer=to)]
            states = await _states(conn, chosen, overrides)
            readers = {c: await has_replay_durable(js, c) for c in {p.consumer for p in chosen if p.consumer}}
            already = [p for p in chosen if states[p.seq] == State.HANDLED]
            skipped = [p for p in chosen if not p.consumer or not readers.get(p.consumer)]
            sendable = [p for p in chosen if p not in already and p not in skipped]
            for p in skipped:
                _warn(f"{p.seq}: " + (f"consumer {p.consumer} has no replay durable" if p.consumer
                                      else "no consumer named: not re-driven"))
            by_consumer = Counter(str(p.consumer) for p in sendable)
            verb = "would re-drive" if dry_run else "re-driving"
            console.print(f"{len(chosen)} parked selected; {verb} {len(sendable)}"
                          + (f" ({', '.join(f'{n} to {c}' for c, n in sorted(by_consumer.items()))})"
                             if sendable else "")
                          + f"; {len(already)} handled already" + ("" if dry_run else ", removed"))
            if dry_run:
                return 0
            run_id = new_run_id()
            sent: list[Parked] = []
            for p in sendable:
                try:
                    await redrive(js, p, str(p.consumer), run_id, timeout=cli.bus_publish_timeout_seconds)
                except Exception as exc:  # JetStream did not take it: it stays parked, the rest goes on
                    _warn(f"{p.seq}: not re-driven ({type(exc).__name__}: {exc})")
                    continue
                sent.append(p)
            sent_count = len(sent)
            done = {p.seq for p in already}
            loop = asyncio.get_running_loop()
            deadline = loop.time() + settings.redrive_wait_seconds
            while conn is not None and sent:
                states = await _states(conn, sent, overrides)
                done |= {p.seq for p in sent if states[p.seq] == State.HANDLED}
                sent = [p for p in sent if p.seq not in done]
                if not sent or loop.time() >= deadline:
                    break
                await asyncio.sleep(settings.poll_seconds)
            removed = [seq for seq in sorted(done) if await remove(js, seq)]
            left = len(chosen) - len(removed)
            console.print(f"re-driven {sent_count} (run {run_id}); handled and removed {len(removed)}"
                          + (f" ({', '.join(map(str, removed))})" if removed else "") + f"; still parked {left}")
            return 0 if left == 0 else 1

    raise typer.Exit(asyncio.run(go()))


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

    found = asyncio.run(count())
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

    console.print(f"purged {asyncio.run(go())} parked messages" + (f" of {event_type}" if event_type else ""))
