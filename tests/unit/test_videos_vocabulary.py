"""The SQL agrees with `shared/videos.py`: every CHECK on a status/state column in the migrations, and every literal
the stores' queries and the migrations' indexes compare such a column with, belongs to the vocabulary declared there.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from services.api.playback import PlaybackPolicy
from services.sweep.domain import Outcome, Trigger
from shared.db import SCHEMAS
from shared.videos import (
    GONE,
    IMPORT_ACTIVE,
    RETIRABLE,
    SWEEP_CANDIDATE_SQL,
    ImportState,
    JobClass,
    OutputState,
    ProcessingState,
    VideoStatus,
)

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("api", "encode", "media", "sweep")  # the services whose tables hold a video's state
STORES = {service: ROOT / "services" / service / "store.py" for service in ("api", "encode", "sweep")}

# (service owning the table, table, column) -> the values the column may hold
VOCABULARY: dict[tuple[str, str, str], frozenset[str]] = {
    ("api", "videos", "status"): frozenset(VideoStatus),
    ("api", "videos", "playback_policy"): frozenset(PlaybackPolicy),
    ("api", "videos", "import_state"): frozenset(ImportState),
    ("encode", "videos", "state"): frozenset(ProcessingState),
    ("encode", "videos", "job_class"): frozenset(JobClass),
    ("encode", "outputs", "state"): frozenset(OutputState),
    ("sweep", "runs", "trigger"): frozenset(Trigger),
    ("sweep", "runs", "outcome"): frozenset(Outcome),
}
COLUMNS = "|".join(sorted({column for _, _, column in VOCABULARY}))
COMPARED = re.compile(rf"\b(?:(\w+)\.)?({COLUMNS})\s*(=|<>|!=)\s*'([^']*)'")
LISTED = re.compile(rf"\b(?:(\w+)\.)?({COLUMNS})\s+(NOT\s+)?IN\s*\(([^)]*)\)", re.IGNORECASE)
CASE = re.compile(rf"\b({COLUMNS})\s*=\s*CASE\b(.*?)\bEND\b", re.DOTALL)
TABLE = re.compile(r"\b(?:FROM|JOIN|UPDATE|INTO|TABLE|ON)\s+(?:(\w+)\.)?(\w+)(?:\s+(?:AS\s+)?(\w+))?", re.IGNORECASE)
CHECK = re.compile(r"CHECK\s*\(\s*(\w+)\s+IN\s*\(([^)]*)\)\s*\)", re.IGNORECASE | re.DOTALL)
NOT_TABLES = {"conflict", "delete", "update", "unnest", "select", "lateral"}
KEYWORDS = {"where", "set", "using", "on", "join", "order", "group", "limit", "for", "returning", "values", "and",
            "left", "inner", "as", "select", "when"}
SERVICE_OF_SCHEMA = {schema: service for service, schema in SCHEMAS.items()}


def values_of(listing: str) -> set[str]:
    return set(re.findall(r"'([^']*)'", listing))


@dataclass(frozen=True)
class Use:
    """One literal compared with (or listed for) a vocabulary column, where it was found."""

    where: str
    table: tuple[str, str, str]
    values: frozenset[str]
    negated: bool


def tables_before(sql: str, service: str) -> list[tuple[int, tuple[str, str], str | None]]:
    found = []
    for m in TABLE.finditer(sql):
        schema, table, alias = m.group(1), m.group(2), m.group(3)
        if table.lower() in NOT_TABLES:
            continue
        owner = SERVICE_OF_SCHEMA.get(schema, service) if schema else service
        found.append((m.start(), (owner, table), alias if alias and alias.lower() not in KEYWORDS else None))
    return found


def uses(sql: str, service: str, where: str) -> Iterator[Use]:
    """The vocabulary literals of one statement: `col = 'x'`, `col [NOT] IN ('x', ...)`, `col = CASE ... END`."""
    tables = tables_before(sql, service)
    aliases = {alias: table for _, table, alias in tables if alias}

    def table_at(pos: int, alias: str | None, column: str) -> tuple[str, str]:
        """The alias's table; else the nearest table named before that has the column (a subquery may sit between)."""
        if alias is not None:
            return aliases.get(alias) or next(t for _, t, _ in tables if t[1] == alias)
        before = [t for start, t, _ in tables if start < pos]
        assert before, f"{where}: no table before {sql[pos:pos + 60]!r}"
        return next((t for t in reversed(before) if (*t, column) in VOCABULARY), before[-1])

    for m in COMPARED.finditer(sql):
        owner, table = table_at(m.start(), m.group(1), m.group(2))
        yield Use(where, (owner, table, m.group(2)), frozenset({m.group(4)}), m.group(3) != "=")
    for m in LISTED.finditer(sql):
        owner, table = table_at(m.start(), m.group(1), m.group(2))
        yield Use(where, (owner, table, m.group(2)), frozenset(values_of(m.group(4))), bool(m.group(3)))
    for m in CASE.finditer(sql):
        owner, table = table_at(m.start(), None, m.group(1))
        yield Use(where, (owner, table, m.group(1)), frozenset(values_of(m.group(2))), False)


def statements(path: Path) -> Iterator[str]:
    """A migration's statements, comments removed."""
    text = "\n".join(line.split("--", 1)[0] for line in path.read_text().splitlines())
    yield from (s.strip() for s in text.split(";") if s.strip())


def python_sql(path: Path) -> Iterator[str]:
    """Every string of a module that reads as SQL (an f-string's placeholders as `?`)."""
    tree = ast.parse(path.read_text())
    parts = {id(v) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for v in node.values}
    for node in ast.walk(tree):
        if id(node) in parts:
            continue  # read with its f-string
        if isinstance(node, ast.JoinedStr):
            text = "".join(v.value if isinstance(v, ast.Constant) else "?" for v in node.values)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value
        else:
            continue
        if re.search(r"\b(SELECT|UPDATE|INSERT|DELETE|WHERE)\b", text):
            yield text


def migration_checks() -> dict[tuple[str, str, str], set[str]]:
    """The CHECK (column IN (...)) constraints in force after every migration of each service, in order."""
    checks: dict[tuple[str, str, str], set[str]] = {}
    for service in SERVICES:
        for path in sorted((ROOT / "services" / service / "migrations").glob("*.sql")):
            for sql in statements(path):
                table = re.match(r"(?:CREATE|ALTER)\s+TABLE\s+(?:IF\s+NOT\s+EXISTS\s+)?(\w+)", sql, re.IGNORECASE)
                if table is None:
                    continue
                for dropped in re.findall(r"DROP\s+CONSTRAINT\s+(\w+)", sql, re.IGNORECASE):
                    column = dropped.removeprefix(f"{table.group(1)}_").removesuffix("_check")
                    checks.pop((service, table.group(1), column), None)
                for column, listing in CHECK.findall(sql):
                    checks[(service, table.group(1), column)] = values_of(listing)
    return checks


def all_uses() -> list[Use]:
    found: list[Use] = []
    for service in SERVICES:
        for path in sorted((ROOT / "services" / service / "migrations").glob("*.sql")):
            for sql in statements(path):
                found += uses(sql, service, str(path.relative_to(ROOT)))
    for service, path in STORES.items():
        for sql in python_sql(path):
            found += uses(sql, service, str(path.relative_to(ROOT)))
    return found


def test_every_check_on_a_state_column_is_the_vocabulary() -> None:
    assert migration_checks() == {key: set(values) for key, values in VOCABULARY.items()}


def test_every_literal_the_sql_compares_a_state_column_with_is_in_the_vocabulary() -> None:
    found = all_uses()
    for use in found:
        vocabulary = VOCABULARY.get(use.table)
        assert vocabulary is not None, f"{use.where}: {use.table} has no vocabulary here"
        assert use.values <= vocabulary, f"{use.where}: {sorted(use.values - vocabulary)} not in {use.table}"
    # each store and each vocabulary is really read (an extractor that finds nothing would pass anything)
    assert {u.where for u in found} >= {str(p.relative_to(ROOT)) for p in STORES.values()}
    assert {u.table for u in found} == set(VOCABULARY)


def test_what_the_sql_leaves_out_of_listings_is_the_gone_statuses() -> None:
    excluded = [u for u in all_uses() if u.table == ("api", "videos", "status") and u.negated]
    assert len(excluded) >= 3  # the listing index, the sweep's index, the api's listing query
    assert all(u.values == GONE for u in excluded), excluded


def test_the_sweep_queries_run_the_candidate_predicate_built_from_the_vocabulary() -> None:
    from services.sweep import store

    assert store.CANDIDATE == SWEEP_CANDIDATE_SQL and SWEEP_CANDIDATE_SQL in store.CANDIDATES
    found = list(uses(store.CANDIDATES, "sweep", "CANDIDATES"))
    assert {u.table for u in found} == {("api", "videos", "status"), ("api", "videos", "import_state")}
    status = [u for u in found if u.table == ("api", "videos", "status")]
    assert {u.values for u in status if not u.negated} == {RETIRABLE}
    assert {u.values for u in status if u.negated} == {GONE}
    assert [(u.values, u.negated) for u in found if u.table[2] == "import_state"] == [(IMPORT_ACTIVE, True)]


@pytest.mark.parametrize(("sql", "service", "table"), [
    ("UPDATE videos SET status = 'paused' WHERE id = $1", "api", ("api", "videos", "status")),
    ("SELECT 1 FROM outputs o JOIN videos v USING (video_id) WHERE o.state IN ('pending', 'queued')", "encode",
     ("encode", "outputs", "state")),
    ("UPDATE videos.videos SET status = CASE WHEN status = 'created' THEN 'parked' END", "sweep",
     ("api", "videos", "status")),
])
def test_the_reader_catches_a_value_outside_the_vocabulary(sql: str, service: str,
                                                           table: tuple[str, str, str]) -> None:
    found = list(uses(sql, service, "planted"))
    assert any(u.table == table and not u.values <= VOCABULARY[table] for u in found), found


def test_encode_processing_states_are_video_statuses() -> None:
    assert {s.value for s in ProcessingState} <= {s.value for s in VideoStatus}
