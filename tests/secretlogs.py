"""No secret in any log line of a test run (SPEC 2: a key's 12-character prefix at most), checked when the run ends.

It reads every log file under pytest's base temporary directory and the test process's own records
(`test-process.log`), for every secret the run knows by value (TEST_SECRETS, storage and database passwords, NATS
seeds, `register_secret`) and anything shaped like a credential (keys, tokens, NKEY seeds, presigned signatures).
A leak fails the run (exit 1), listed masked; tests/unit/test_secret_logs.py plants one. A pytest plugin:
tests/conftest.py takes its hooks and fixture (`pytest -p tests.secretlogs` elsewhere).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

LOG_SUFFIXES = (".log", ".jsonl", ".out", ".err")
MAX_BYTES = 64 * 1024 * 1024  # a larger file is not a log
MIN_SECRET_LENGTH = 8  # shorter values would match ordinary text
KEEP = 12  # a key's prefix may be shown (shared.events.catalog.KEY_PREFIX_MAX_LENGTH)
IN_PROCESS_LOG = "test-process.log"

CREDENTIAL_SHAPES: dict[str, re.Pattern[str]] = {
    "a key or account token past its 12-character prefix": re.compile(rf"\bw(?:at|sk|pk)_[0-9A-Za-z]{{{KEEP - 3},}}"),
    "an upload token": re.compile(rf"\bwut_[A-Za-z0-9_-]{{{KEEP - 3},}}"),
    "an NKEY seed": re.compile(r"\bS[UAOCNPX][A-Z2-7]{56}\b"),
    "a presigned URL's signature": re.compile(r"X-Amz-Signature=[0-9a-fA-F]{16,}"),
}

_secrets: dict[str, str] = {}  # value -> what it is
_roots: list[Path] = []


def register_secret(value: str | bytes | None, what: str) -> None:
    """A value that must appear in no log line of this run."""
    if isinstance(value, bytes):
        value = value.decode(errors="replace")
    if value and len(value.strip()) >= MIN_SECRET_LENGTH:
        _secrets.setdefault(value.strip(), what)


def register_root(path: Path) -> None:
    """A directory whose log files are read at the end of the run."""
    if path not in _roots:
        _roots.append(path)


@dataclass(frozen=True)
class Leak:
    path: Path
    line: int
    what: str
    excerpt: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.what}: {self.excerpt}"


def log_files(roots: Iterable[Path]) -> Iterator[Path]:
    for root in roots:
        if root.is_file():
            yield root
            continue
        for path in sorted(root.rglob("*")):
            if path.suffix in LOG_SUFFIXES and path.is_file() and path.stat().st_size <= MAX_BYTES:
                yield path


def _masked(line: str, start: int, end: int) -> str:
    """The line around a finding, the finding itself cut to its first few characters."""
    shown = line[start:end][:6] + "…"
    return (line[max(0, start - 60):start] + shown + line[end:end + 60]).strip()


def find_leaks(paths: Iterable[Path], secrets: Mapping[str, str]) -> list[Leak]:
    """Every line of the files that holds a secret (by value) or something shaped like a credential."""
    leaks: list[Leak] = []
    for path in paths:
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            for value, what in secrets.items():
                at = line.find(value)
                if at >= 0:
                    leaks.append(Leak(path, number, what, _masked(line, at, at + len(value))))
            for what, shape in CREDENTIAL_SHAPES.items():
                for match in shape.finditer(line):
                    leaks.append(Leak(path, number, what, _masked(line, match.start(), match.end())))
    return leaks


def known_secrets() -> dict[str, str]:
    """What this run registered, and the services' secret settings every service process of the suite gets."""
    from tests.integration.authhelpers import TEST_SECRETS

    for name, value in TEST_SECRETS.items():
        register_secret(value, f"WEIR_{name.upper()}")
    return dict(_secrets)


# --------------------------------------------------------------------------------------------------- the plugin


@pytest.fixture(scope="session", autouse=True)
def secret_log_roots(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The run's base temporary directory is read at its end; the test process's own log records are kept there."""
    base = tmp_path_factory.getbasetemp()
    register_root(base)
    handler = logging.FileHandler(base / IN_PROCESS_LOG, encoding="utf-8")
    from shared.logs import TextFormatter

    handler.setFormatter(TextFormatter("tests"))  # as a service writes them (its redaction of shapes included)
    logging.getLogger().addHandler(handler)
    try:
        yield
    finally:
        logging.getLogger().removeHandler(handler)
        handler.close()


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if not _roots:
        return
    leaks = find_leaks(log_files(_roots), known_secrets())
    if not leaks:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    lines = [f"SECRETS IN LOGS: {len(leaks)} line(s) of this run's logs hold a secret (tests/secretlogs.py):",
             *(f"  {leak}" for leak in leaks[:50])]
    if reporter is not None:
        reporter.write("\n")
        for line in lines:
            reporter.write_line(line, red=True)
    else:
        print("\n".join(lines))
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
