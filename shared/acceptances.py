"""Contract findings accepted on purpose: contracts/accepted.toml, read by `weir contracts check` (SPEC 11).

Like `buf breaking`'s ignore list, but narrower: each entry names the release it is against, one contract as the check
names it (`api GET /v1/videos/{video_id}`, `event video.created`, `request auth.check`), one direction, the exact
problems it accepts as the check words them, and why. An accepted problem is shown with its reason and fails nothing;
a problem not listed still fails; an entry, or a problem of one, that no finding matches any more is itself an error,
so the file never excuses more than it did when written. Entries against a release the check did not compare (an
older one, once the next is released) are left alone.

    [[accepted]]
    against = "1.0.0"
    contract = "api GET /v1/videos/{video_id}"
    direction = "new client -> old server"
    reason = "why this is no break in fact, and what verifies it"
    problems = ["response 200 (application/json) `id`: the reader requires it, the writer does not write it"]
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from shared.compat import DIRECTIONS, EVENT, Change, ReleaseCheck, Verdict
from shared.release import ReleaseError, parse_version

FILE_NAME = "accepted.toml"
TABLE = "accepted"
KEYS = ("against", "contract", "direction", "reason", "problems")
WILDCARDS = ("*", ">", "?")  # glob and NATS wildcards: an entry names one contract


class AcceptanceError(ValueError):
    """contracts/accepted.toml is not a list of specific, complete entries."""


@dataclass(frozen=True)
class Acceptance:
    against: str  # the release
    contract: str  # `<kind> <name>`, as the check shows it
    direction: str  # one of compat.DIRECTIONS[kind]
    problems: tuple[str, ...]  # exactly as the check words them
    reason: str

    @property
    def key(self) -> tuple[str, str, str]:
        return self.against, self.contract, self.direction

    def __str__(self) -> str:
        return f"{self.contract} ({self.direction}) against {self.against}"


def read(path: Path, *, releases: Sequence[str] | None = None) -> tuple[Acceptance, ...]:
    """The entries of `path` (none when there is no such file); `releases`: the versions an entry may be against."""
    if not path.is_file():
        return ()
    return parse(path.read_text(encoding="utf-8"), releases=releases, source=f"{path.parent.name}/{path.name}")


def parse(text: str, *, releases: Sequence[str] | None = None, source: str = FILE_NAME) -> tuple[Acceptance, ...]:
    """The entries of a TOML text; AcceptanceError naming the entry and what is wrong with it."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise AcceptanceError(f"{source}: {exc}") from None
    if data.keys() - {TABLE}:
        raise AcceptanceError(f"{source}: only [[{TABLE}]] entries, not {sorted(data.keys() - {TABLE})}")
    entries = data.get(TABLE, [])
    if not isinstance(entries, list):
        raise AcceptanceError(f"{source}: `{TABLE}` is a list of entries ([[{TABLE}]])")
    found: list[Acceptance] = []
    for number, entry in enumerate(entries, start=1):
        acceptance = _entry(entry, f"{source}, entry {number}", releases)
        if any(a.key == acceptance.key for a in found):
            raise AcceptanceError(f"{source}, entry {number}: a second entry for {acceptance}: list its problems "
                                  "in one")
        found.append(acceptance)
    return tuple(found)


def _entry(entry: Any, where: str, releases: Sequence[str] | None) -> Acceptance:
    if not isinstance(entry, Mapping):
        raise AcceptanceError(f"{where}: an entry is a table")
    if missing := [k for k in KEYS if k not in entry]:
        raise AcceptanceError(f"{where}: missing {', '.join(missing)}")
    if unknown := sorted(entry.keys() - set(KEYS)):
        raise AcceptanceError(f"{where}: unknown {', '.join(unknown)}")
    for key in ("against", "contract", "direction", "reason"):
        if not isinstance(entry[key], str) or not entry[key].strip():
            raise AcceptanceError(f"{where}: `{key}` is a non-empty string")
    against, contract, direction = entry["against"], entry["contract"], entry["direction"]
    try:
        parse_version(against)
    except ReleaseError as exc:
        raise AcceptanceError(f"{where}: `against`: {exc}") from None
    if releases is not None and against not in releases:
        raise AcceptanceError(f"{where}: `against` {against} is not a release listed in releases.toml")
    kind, _, name = contract.partition(" ")
    if kind not in DIRECTIONS or not name.strip():
        raise AcceptanceError(f"{where}: `contract` is `<kind> <name>` as the check shows it, kind one of "
                              f"{', '.join(DIRECTIONS)}: not {contract!r}")
    if any(w in name for w in WILDCARDS):
        raise AcceptanceError(f"{where}: `contract` names one contract, with no wildcard ({' '.join(WILDCARDS)})")
    if direction not in DIRECTIONS[kind]:
        raise AcceptanceError(f"{where}: `direction` of {kind} is one of {' | '.join(DIRECTIONS[kind])}")
    problems = entry["problems"]
    if not isinstance(problems, list) or not problems or not all(isinstance(p, str) and p.strip() for p in problems):
        raise AcceptanceError(f"{where}: `problems` is a non-empty list of the problems accepted, as the check "
                              "words them")
    if len(set(problems)) != len(problems):
        raise AcceptanceError(f"{where}: a problem listed twice")
    return Acceptance(against, contract, direction, tuple(problems), entry["reason"].strip())


def apply(check: ReleaseCheck, accepted: Sequence[Acceptance]) -> ReleaseCheck:
    """The check with the accepted problems set apart (each verdict's `accepted`, with the reason), and each entry,
    or problem of one, that matched no finding among the releases compared as `stale`."""
    in_scope = {a.key: a for a in accepted
                if a.against == check.against
                or (a.against in check.older_releases and a.contract.partition(" ")[0] == EVENT)}
    used: set[tuple[str, str, str]] = set()
    stale: list[str] = []

    def judged(release: str, change: Change, verdict: Verdict) -> Verdict:
        acceptance = in_scope.get((release, f"{change.kind} {change.name}", verdict.direction))
        if acceptance is None:
            return verdict
        used.add(acceptance.key)
        listed = set(acceptance.problems)
        stale.extend(f"{acceptance}: no longer found: {p}" for p in acceptance.problems if p not in verdict.problems)
        return replace(verdict, problems=tuple(p for p in verdict.problems if p not in listed),
                       accepted=tuple(p for p in verdict.problems if p in listed), reason=acceptance.reason)

    changes = tuple(replace(c, backward=judged(check.against, c, c.backward),
                            forward=judged(check.against, c, c.forward)) for c in check.changes)
    older = tuple((release, replace(c, backward=judged(release, c, c.backward))) for release, c in check.older)
    stale += [f"{a}: matches no finding" for key, a in in_scope.items() if key not in used]
    return replace(check, changes=changes, older=older, stale=check.stale + tuple(stale))


def entry_text(against: str, change: Change, verdict: Verdict) -> str:
    """The entry that would accept a verdict's problems, for the check to print beside a break."""
    problems = "".join(f"    {json.dumps(p, ensure_ascii=False)},\n" for p in verdict.problems)
    return (f"[[{TABLE}]]\nagainst = {json.dumps(against)}\ncontract = {json.dumps(f'{change.kind} {change.name}')}\n"
            f"direction = {json.dumps(verdict.direction)}\nreason = \"why no client or reader breaks in fact, and "
            f"what verifies it\"\nproblems = [\n{problems}]\n")
