"""Migrations since the previous release only expand the schema, so that release runs on it (SPEC 11).

A deployment migrates with the newest code first, while services of the previous release still run. So:
- every migration of the previous release is still here, unchanged (it is applied; the old code looks for it by its
  source and number, and would otherwise apply it again);
- a migration added since drops, renames or retypes nothing, and makes no column NOT NULL that the old code may leave
  out (SET NOT NULL, or a new NOT NULL column without a default);
- unless the file declares itself a contract step, `-- contract: drops <table>.<column>, ...` on a line of its own,
  and the previous release's code (services/, shared/, outside migrations) no longer names any column it declares.

The patterns are plain text matches on the SQL (comments removed): honest for the statements Weir's migrations use,
not a SQL parser. A constraint added to existing rows (CHECK, UNIQUE) is not judged here.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from shared.release import Release, previous_release

ROOT = Path(__file__).resolve().parents[2]
MIGRATION = re.compile(r"^(shared/migrations|services/[a-z]+/migrations)/[^/]+\.sql$")
CONTRACT = re.compile(r"^--\s*contract:\s*drops\s+(.+)$", re.IGNORECASE | re.MULTILINE)
# what an older reader of the schema cannot survive, each with why
BREAKING: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"\bDROP\s+(TABLE|COLUMN|SCHEMA|VIEW)\b", re.I), "drops what the previous release may read"),
    (re.compile(r"\bALTER\s+TABLE\s+(IF\s+EXISTS\s+)?[\w.\"]+\s+DROP\s+(?!CONSTRAINT|DEFAULT|NOT\s+NULL)", re.I),
     "drops a column the previous release may read"),
    (re.compile(r"\bRENAME\b", re.I), "renames what the previous release names"),
    (re.compile(r"\bALTER\s+TYPE\b", re.I), "changes a type the previous release writes"),
    (re.compile(r"\bALTER\s+COLUMN\s+[\w\"]+\s+(SET\s+DATA\s+)?TYPE\b", re.I), "retypes a column"),
    (re.compile(r"\bSET\s+NOT\s+NULL\b", re.I), "makes a column NOT NULL that the previous release may leave out"),
    (re.compile(r"\bADD\s+(COLUMN\s+)?(IF\s+NOT\s+EXISTS\s+)?[\w\"]+\s[^,;]*\bNOT\s+NULL\b(?![^,;]*\bDEFAULT\b)", re.I),
     "adds a NOT NULL column without a default: the previous release's inserts leave it out"),
)


def _sql_text(sql: str) -> str:
    """The statements without comments (`-- ...` lines, `/* ... */`)."""
    sql = re.sub(r"/\*.*?\*/", " ", sql, flags=re.S)
    return re.sub(r"--[^\n]*", " ", sql)


def breaking_statements(sql: str) -> list[str]:
    """Why the SQL would break the previous release's code running on the migrated schema (empty: expand-only)."""
    text = _sql_text(sql)
    return [f"{why}: {m.group(0).strip()!r}" for pattern, why in BREAKING for m in pattern.finditer(text)]


def declared_contract(sql: str) -> list[str]:
    """The columns a contract step says it drops (`table.column`), in the order declared."""
    return [c.strip() for m in CONTRACT.finditer(sql) for c in m.group(1).split(",") if c.strip()]


def _git(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=60, check=False)


@pytest.fixture(scope="module")
def release() -> Release:
    found = previous_release()
    assert found is not None, "releases.toml lists no release"
    if _git("cat-file", "-e", f"{found.commit}^{{commit}}").returncode != 0:
        pytest.fail(f"release {found.version} (commit {found.commit}) is not in this clone's history: clone with full "
                    f"history (`git fetch --unshallow`) to check its migrations", pytrace=False)
    return found


def released_migrations(release: Release) -> dict[str, str]:
    listed = _git("ls-tree", "-r", "--name-only", release.commit, "--", "shared", "services").stdout.split()
    return {path: _git("show", f"{release.commit}:{path}").stdout for path in listed if MIGRATION.match(path)}


def current_migrations() -> dict[str, str]:
    return {str(p.relative_to(ROOT)): p.read_text(encoding="utf-8")
            for p in sorted([*ROOT.glob("shared/migrations/*.sql"), *ROOT.glob("services/*/migrations/*.sql")])}


def test_every_migration_of_the_previous_release_is_here_unchanged(release: Release) -> None:
    old, now = released_migrations(release), current_migrations()
    assert old, f"no migrations found in release {release.version}'s tree"
    assert {p for p in old if p not in now} == set(), "migrations of the previous release removed or renamed"
    assert [p for p in old if now[p] != old[p]] == [], "applied migrations edited since the previous release"


def used_by(release: Release, columns: list[str]) -> dict[str, str]:
    """The columns (`table.column`) whose name the release's code outside its migrations still has, with where."""
    return {c: hits for c in columns if (hits := _git(
        "grep", "-n", "-w", c.split(".")[-1], release.commit, "--", "services", "shared",
        ":(exclude)*/migrations/*").stdout.strip())}


def test_migrations_added_since_the_previous_release_only_expand(release: Release) -> None:
    old = released_migrations(release)
    faults = {}
    for path, sql in current_migrations().items():
        if path in old:
            continue
        dropped = declared_contract(sql)
        if dropped:  # a contract step: the previous release must not use what it removes
            if still_used := used_by(release, dropped):
                faults[path] = [f"declared contract step, but release {release.version} still uses {c}:\n{hits}"
                                for c, hits in still_used.items()]
        elif found := breaking_statements(sql):
            faults[path] = found
    assert not faults, faults


@pytest.mark.parametrize("sql", [
    "ALTER TABLE videos DROP COLUMN processing;",
    "ALTER TABLE videos DROP processing;",
    "DROP TABLE runs;",
    "ALTER TABLE videos RENAME COLUMN name TO title;",
    "ALTER TABLE videos RENAME TO clips;",
    "ALTER TABLE videos ALTER COLUMN file_size TYPE numeric;",
    "ALTER TABLE videos ALTER COLUMN metadata SET DATA TYPE text;",
    "ALTER TYPE state ADD VALUE 'paused';",
    "ALTER TABLE videos ALTER COLUMN metadata SET NOT NULL;",
    "ALTER TABLE videos ADD COLUMN title text NOT NULL;",
    "ALTER TABLE videos ADD COLUMN IF NOT EXISTS title text NOT NULL, ADD COLUMN x int;",
])
def test_a_contracting_statement_is_found(sql: str) -> None:
    assert breaking_statements(sql), sql


@pytest.mark.parametrize("sql", [
    "CREATE TABLE t (id uuid PRIMARY KEY, name text NOT NULL);",
    "ALTER TABLE videos ADD COLUMN title text;",
    "ALTER TABLE videos ADD COLUMN tries int NOT NULL DEFAULT 0;",
    "ALTER TABLE videos ADD COLUMN IF NOT EXISTS traceparent text;",
    "CREATE INDEX videos_title ON videos (title);",
    "ALTER TABLE videos ALTER COLUMN name DROP NOT NULL;",
    "ALTER TABLE videos DROP CONSTRAINT videos_status_check;",
    "-- we never DROP TABLE here\nALTER TABLE videos ADD COLUMN note text; /* nor RENAME */",
])
def test_an_expanding_statement_passes(sql: str) -> None:
    assert breaking_statements(sql) == [], sql


def test_a_contract_step_names_what_it_drops() -> None:
    sql = "-- contract: drops videos.processing, videos.legacy\nALTER TABLE videos DROP COLUMN processing;"
    assert declared_contract(sql) == ["videos.processing", "videos.legacy"]
    assert declared_contract("ALTER TABLE videos DROP COLUMN processing;") == []


def test_a_contract_step_is_refused_while_the_previous_release_uses_the_column(release: Release) -> None:
    assert set(used_by(release, ["videos.completion_claimed_at", "videos.never_a_column_xyz"])) == {
        "videos.completion_claimed_at"}
