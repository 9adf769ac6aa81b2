"""The run-wide check that no log line holds a secret (tests/secretlogs.py) catches one when there is one.

The files planted here live outside this run's temporary directory (which the check reads at the end of the run)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.logs import Redactor
from tests import secretlogs

ROOT = Path(__file__).resolve().parents[2]
KEY = "wsk_" + "A1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6"  # a well-formed secret key (32 base62 digits)


@pytest.fixture
def outside() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="weir-secretlogs-") as tmp:
        yield Path(tmp)


def test_a_registered_secret_in_a_log_file_is_found_and_masked_in_the_report(outside: Path) -> None:
    secret = "s3cr3t-internal-token-value"
    log = outside / "logs" / "api-1234.log"
    log.parent.mkdir()
    log.write_text("ok line\nINFO something with s3cr3t-internal-token-value in it\n")
    leaks = secretlogs.find_leaks(secretlogs.log_files([outside]), {secret: "WEIR_INTERNAL_TOKEN"})
    assert [(leak.path, leak.line, leak.what) for leak in leaks] == [(log, 2, "WEIR_INTERNAL_TOKEN")]
    assert secret not in str(leaks[0])  # the report shows its first characters only


def test_credential_shapes_are_found_whoever_made_them_but_a_12_character_prefix_is_allowed(outside: Path) -> None:
    lines = {
        "whole key": f"rejected {KEY}",
        "prefix only": f"rejected {KEY[:12]}",  # what a log may show
        "redacted": Redactor()(f"rejected {KEY}"),  # what the services' formatter leaves
        "upload token": "token wut_eyJ2aWRlbyI6IjEyMyJ9.c2lnbmF0dXJlLWJ5dGVz",
        "seed": "seed SUAOQCGDFD7M73QOJ7PGKBOYFJOMEPMIEW23BXSHMVI2DNUQKXNN747DZE",
        "signature": "GET http://s3/x?X-Amz-Credential=weir%2F20261201&X-Amz-Signature=0123456789abcdef0123",
    }
    for name, line in lines.items():
        (outside / f"{name.replace(' ', '-')}.log").write_text(line + "\n")
    found = {leak.path.stem for leak in secretlogs.find_leaks(secretlogs.log_files([outside]), {})}
    assert found == {"whole-key", "upload-token", "seed", "signature"}


def test_only_log_files_are_read(outside: Path) -> None:
    (outside / "clip.mp4").write_bytes(KEY.encode())
    (outside / "traces.jsonl").write_text(f'{{"key": "{KEY}"}}\n')
    assert [p.name for p in secretlogs.log_files([outside])] == ["traces.jsonl"]


def _run_pytest(directory: Path, test_body: str) -> subprocess.CompletedProcess[str]:
    """A pytest run of its own (outside this suite's conftest) with the plugin, on one test file."""
    (directory / "test_planted.py").write_text(textwrap.dedent(test_body))
    (directory / "pytest.ini").write_text("[pytest]\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "tests.secretlogs", "-p", "no:cacheprovider",
         f"--rootdir={directory}", "-c", str(directory / "pytest.ini"), f"--basetemp={directory / 'tmp'}",
         str(directory / "test_planted.py")],
        capture_output=True, text=True, timeout=120, cwd=directory, env=env,
    )


def test_a_run_whose_logs_hold_a_secret_fails_and_a_clean_one_passes(outside: Path) -> None:
    leaky_dir, clean_dir = outside / "leaky", outside / "clean"
    leaky_dir.mkdir()
    clean_dir.mkdir()
    leaky = _run_pytest(leaky_dir, """
        import logging
        from tests import secretlogs

        def test_a_service_logs_a_secret(tmp_path):
            secretlogs.register_secret("planted-secret-value-42", "a planted secret")
            (tmp_path / "api-1.log").write_text("INFO api: using planted-secret-value-42\\n")

        def test_the_test_process_logs_one_too():
            logging.getLogger("weir.test").warning("token %s", "planted-secret-value-42")
    """)
    assert leaky.returncode == 1, leaky.stdout + leaky.stderr
    assert "2 passed" in leaky.stdout and "SECRETS IN LOGS: 2 line(s)" in leaky.stdout
    assert "api-1.log:1: a planted secret" in leaky.stdout
    assert "test-process.log:1: a planted secret" in leaky.stdout
    assert "planted-secret-value-42" not in leaky.stdout  # the report masks what it found

    clean = _run_pytest(clean_dir, """
        import logging
        from tests import secretlogs

        def test_only_prefixes_are_logged(tmp_path):
            secretlogs.register_secret("planted-secret-value-42", "a planted secret")
            (tmp_path / "api-1.log").write_text("INFO api: key wpk_ZZZZZZZZ (its prefix) rejected\\n")
            # in the test process, a whole key goes through the services' formatter, which keeps its prefix only
            logging.getLogger("weir.test").warning("key %s", "wpk_" + "Z" * 32)
    """)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    assert "SECRETS IN LOGS" not in clean.stdout
