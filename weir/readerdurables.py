"""The publishers' durables, made by the operator (`weir streams apply`, and so `weir up`), never by their readers.

A consumer create request carries its deliver subject in its body, which nats-server does not check against the
creator's rights: whoever may create a consumer may make it a push consumer delivering the stream onto any subject
(a service's `farm.result`, say). So a publisher (an outside team, the stack's own `publisher`) may not create,
change or delete any consumer (shared/identities.py's READER_DENIED); the operator makes each of its durables from
the teams file (`weir nats publisher` writes it; WEIR_NATS_TEAMS_FILE): pull, explicit ack, one filter on one
account's public events of one stream, marked as the operator's in its metadata. A durable whose team lost the
account is removed, and so is any push consumer on a public stream (Weir makes none). No teams file is not a file
listing no teams: the teams are unknown (a run from another directory, a path mistyped), so no team's durable is made
or removed, with a warning; removing them would lose every team's place in the streams. `plan` decides, purely;
`apply_reader_durables` asks JetStream and does it.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

from shared.identities import PUBLISHER_IDENTITY, Durable, Identity
from shared.publishersubjects import PUBLIC_STREAMS
from shared.settings import CommonSettings
from weir.natsdeploy import known_teams

KEPT_UNKNOWN = "perhaps a team's: the teams are unknown (no teams file), so it is left as it is"
MADE_BY = "weir-made-by"  # the consumer metadata marking a reader durable as the operator's
MADE_BY_OPERATOR = "operator"
READER = "weir-reader"  # the identity the durable is made for

Action = Literal["create", "recreate", "adopt", "keep", "delete"]


@dataclass(frozen=True)
class Existing:
    """A consumer on a public stream as JetStream describes it: what `plan` needs to judge it."""

    stream: str
    name: str
    filters: tuple[str, ...]
    deliver_subject: str = ""  # set: a push consumer, delivering onto that subject
    ack_explicit: bool = True
    ours: bool = False  # marked as a reader durable the operator made (MADE_BY)


@dataclass(frozen=True)
class Step:
    """One thing to do to one consumer, and why; `durable` is the wanted one (none for a delete)."""

    action: Action
    stream: str
    name: str
    why: str
    durable: Durable | None = None
    reader: str = ""
    start: datetime | None = None  # a recreate from this time (`--restart NAME --since TIME`)

    def line(self) -> str:
        verb = {"create": "created", "recreate": "recreated", "adopt": "adopted", "keep": "kept",
                "delete": "removed"}[self.action]
        return f"{verb} consumer {self.stream}/{self.name}: {self.why}"


def reader_durables(identities: Iterable[Identity]) -> list[tuple[str, Durable]]:
    """Every operator-made durable of the identities, with its reader's name."""
    return [(i.name, d) for i in identities for d in i.durables if d.made_by_operator]


def plan(wanted: Sequence[tuple[str, Durable]], existing: Sequence[Existing],
         restarts: Mapping[str, datetime | None] | None = None,
         streams: Iterable[str] = PUBLIC_STREAMS, teams_known: bool = True) -> list[Step]:
    """What to do so that the public streams hold exactly the wanted reader durables (pull, explicit ack, their one
    filter, marked as the operator's), no reader durable of a lost account and no push consumer; the durables named
    in `restarts` start over (from the time given, else the stream's start). With `teams_known` false (no teams
    file) an operator's durable not wanted may be a team's: it is kept, never removed. Other consumers (the
    services', `weir replay`'s) are left alone. Pure; raises ValueError for a restart of a durable that is not
    wanted."""
    restarts = dict(restarts or {})
    unknown = sorted(set(restarts) - {d.name for _, d in wanted})
    if unknown:
        hint = "the teams file names its readers" if teams_known else "no teams file: the teams are unknown"
        raise ValueError(f"not a publisher's durable: {', '.join(unknown)} ({hint})")
    scanned = set(streams)
    found = {(e.stream, e.name): e for e in existing}
    steps: list[Step] = []
    for reader, d in wanted:
        e = found.get((d.stream, d.name))
        start = restarts.get(d.name)
        if e is None:
            steps.append(Step("create", d.stream, d.name, f"{reader}'s pull durable on {d.subjects[0]}", d, reader))
        elif e.deliver_subject:
            steps.append(Step("recreate", d.stream, d.name, f"a push consumer (onto {e.deliver_subject}) made pull "
                              f"for {reader}", d, reader, start))
        elif e.filters != tuple(sorted(d.subjects)) or not e.ack_explicit:
            steps.append(Step("recreate", d.stream, d.name, f"{reader}'s durable back to {d.subjects[0]}, explicit "
                              "ack", d, reader, start))
        elif d.name in restarts:
            since = f"from {start.isoformat()}" if start else "from the stream's start"
            steps.append(Step("recreate", d.stream, d.name, f"{reader} starts over, {since}", d, reader, start))
        elif not e.ours:
            steps.append(Step("adopt", d.stream, d.name, f"{reader}'s durable, now marked as the operator's", d,
                              reader))
        else:
            steps.append(Step("keep", d.stream, d.name, f"{reader}'s pull durable", d, reader))
    names = {(d.stream, d.name) for _, d in wanted}
    for e in existing:
        if (e.stream, e.name) in names or e.stream not in scanned:
            continue
        if e.deliver_subject:
            steps.append(Step("delete", e.stream, e.name, f"a push consumer onto {e.deliver_subject} (Weir makes none "
                              "on a public stream)"))
        elif e.ours and not teams_known:
            steps.append(Step("keep", e.stream, e.name, KEPT_UNKNOWN))
        elif e.ours:
            steps.append(Step("delete", e.stream, e.name, "its reader no longer serves the account (or is gone)"))
    return steps


def reader_identities(teams_file: Path) -> tuple[list[Identity], bool]:
    """The stack's own publisher and every team of the teams file (with its accounts; none: no durables), and
    whether the teams are known: not when there is no file (then only the publisher)."""
    teams = known_teams(teams_file)
    return [PUBLISHER_IDENTITY, *(t.identity() for t in (teams or {}).values())], teams is not None


def no_teams_file_warning(teams_file: Path) -> str:
    """What the operator is told when the teams file is missing: where it was looked for, and how to name it."""
    return (f"warning: no teams file at {teams_file.absolute()} (WEIR_NATS_TEAMS_FILE; a relative path is taken "
            "from the current directory): the teams are unknown, so no team's durable is made or removed; set "
            "WEIR_NATS_TEAMS_FILE to the teams.json `weir nats publisher` keeps")


def consumer_config(reader: str, d: Durable, settings: CommonSettings, start: datetime | None = None) -> Any:
    """A reader durable's configuration: pull (no deliver subject), explicit ack, its one filter, the operator's
    mark; from `start` if given, else from the stream's start."""
    from nats.js import api

    config = api.ConsumerConfig(
        name=d.name, durable_name=d.name, filter_subject=d.subjects[0], ack_policy=api.AckPolicy.EXPLICIT,
        ack_wait=settings.consumer_ack_wait_seconds, description=f"{reader}'s: {d.why} (weir streams apply)",
        metadata={MADE_BY: MADE_BY_OPERATOR, READER: reader})
    if start is not None:
        config.deliver_policy = api.DeliverPolicy.BY_START_TIME
        config.opt_start_time = start
    else:
        config.deliver_policy = api.DeliverPolicy.ALL
    return config


def _existing(stream: str, info: Any) -> Existing:
    c = info.config
    filters = tuple(sorted(c.filter_subjects or ([c.filter_subject] if c.filter_subject else [])))
    from nats.js import api

    return Existing(stream=stream, name=info.name, filters=filters, deliver_subject=c.deliver_subject or "",
                    ack_explicit=c.ack_policy == api.AckPolicy.EXPLICIT,
                    ours=(c.metadata or {}).get(MADE_BY) == MADE_BY_OPERATOR)


async def _consumers(js: Any, stream: str) -> list[Any]:
    """Every consumer of the stream (JetStream lists them a page at a time)."""
    found: list[Any] = []
    while True:
        page = await js.consumers_info(stream, offset=len(found) or None)
        found += page
        if not page:
            return found


async def apply_reader_durables(js: Any, settings: CommonSettings, identities: Sequence[Identity] | None = None,
                                restarts: Mapping[str, datetime | None] | None = None) -> list[str]:
    """Bring the public streams' reader durables to `plan` (the readers: the stack's publisher and the teams of
    WEIR_NATS_TEAMS_FILE unless given), as the operator; returns what was done (kept ones included). No teams file:
    no team's durable made or removed, and a warning on stderr when there are durables it keeps so."""
    teams_known = True
    teams_file = Path(settings.nats_teams_file)
    if identities is None:
        readers, teams_known = reader_identities(teams_file)
    else:
        readers = list(identities)
    existing = [_existing(stream, info) for stream in PUBLIC_STREAMS for info in await _consumers(js, stream)]
    steps = plan(reader_durables(readers), existing, restarts, teams_known=teams_known)
    if any(step.why == KEPT_UNKNOWN for step in steps):  # a stack that never had teams needs no warning
        print(no_teams_file_warning(teams_file), file=sys.stderr, flush=True)
    for step in steps:
        if step.action in ("recreate", "delete"):
            await js.delete_consumer(step.stream, step.name)
        if step.durable is not None and step.action in ("create", "recreate", "adopt"):
            await js.add_consumer(step.stream, consumer_config(step.reader, step.durable, settings, step.start))
    return [step.line() for step in steps]
