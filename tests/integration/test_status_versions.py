"""`weir status` shows each instance's release and warns when a stack runs several (SPEC 11): an auth of this code
beside an auth of the previous release (releases.toml, its commit's tree as `git archive` gives it), both real
processes on the session's servers. The previous release has no `GET /version`: it shows as older than the route."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.devstack.ports import free_port
from shared.release import FIRST_WITH_VERSION_ROUTE, ROOT, VERSION, commit, parse_version, previous_release
from shared.settings import CommonSettings
from tests.integration.apihelpers import Services, run_services
from tests.integration.test_status import Doc, weir_status
from tests.waiting import wait_for, wait_service_ready

pytestmark = pytest.mark.asyncio(loop_scope="session")

NO_VERSION_ROUTE = f"before {FIRST_WITH_VERSION_ROUTE} (no /version)"


@pytest.fixture(scope="module")
def previous_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The previous release's files, from its commit (no worktree: nothing in the repository's git directory
    changes)."""
    release = previous_release()
    assert release is not None, "releases.toml lists no release"
    assert parse_version(release.version) < parse_version(FIRST_WITH_VERSION_ROUTE), (
        "this test needs a previous release without /version")
    root = tmp_path_factory.mktemp(f"weir-{release.version}")
    archive = root / "tree.tar"
    with archive.open("wb") as out:
        made = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", release.commit], stdout=out,
                              stderr=subprocess.PIPE, timeout=120, check=False)
    assert made.returncode == 0, f"the commit of release {release.version} is not in this clone: {made.stderr!r}"
    with tarfile.open(archive) as tar:
        tar.extractall(root, filter="data")
    archive.unlink()
    return root


@pytest.fixture
def previous_auth(previous_tree: Path, services: Services, tmp_path: Path) -> Iterator[str]:
    """auth of the previous release, as its own process beside this code's (both in auth's queue group)."""
    port = free_port()
    log = tmp_path / f"auth-previous-{port}.log"
    # its own tree first on the path, from its own directory (`-m` puts the working directory first)
    env = {**services.env, "PYTHONPATH": str(previous_tree), "PYTHONDONTWRITEBYTECODE": "1",
           "WEIR_HTTP_PORT": str(port)}
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "services.auth"], cwd=previous_tree, env=env, stdout=out,
                                stderr=out)
    try:
        wait_service_ready(f"http://127.0.0.1:{port}", proc, log)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def services(stack_env: dict[str, str], prepared: CommonSettings, tmp_path: Path) -> Iterator[Services]:
    with run_services(stack_env, tmp_path, names=("auth",)) as running:
        yield running


async def test_status_shows_each_release_and_warns_of_a_mixed_stack(
    services: Services, previous_auth: str, stack_env: dict[str, str], tmp_path: Path
) -> None:
    release = previous_release()
    assert release is not None
    no_stack = ("--stack", str(tmp_path / "no-stack.json"))
    current = ("--service", f"auth={services.urls['auth']}")
    both = (*current, "--service", f"auth-{release.version}={previous_auth}")

    async def answered(*args: str) -> tuple[int, Doc] | None:
        rc, doc = await weir_status(stack_env, *args, *no_stack)
        return (rc, doc) if rc == 0 else None  # every figure read (the limits mode of a just-started auth too)

    # one version running: no warning
    rc, doc = await wait_for(lambda: answered(*current), 30, "weir status of this release's auth")
    assert doc["services"]["auth"]["version"] == VERSION and doc["services"]["auth"]["commit"] == commit()
    assert doc["versions"] == {VERSION: ["auth"]} and doc["warnings"] == []

    # beside the previous release: each shown, the mix a warning, the exit code still 0
    rc, doc = await wait_for(lambda: answered(*both), 30, "weir status of both auths")
    old = doc["services"][f"auth-{release.version}"]
    assert old["ready"] is True
    assert (old["version"], old["commit"], old["version_reason"]) == (NO_VERSION_ROUTE, None, None)
    assert doc["services"]["auth"]["version"] == VERSION
    assert doc["versions"] == {NO_VERSION_ROUTE: [f"auth-{release.version}"], VERSION: ["auth"]}
    assert doc["warnings"] == [f"the stack runs 2 versions: {NO_VERSION_ROUTE} (auth-{release.version}); "
                               f"{VERSION} (auth)"]
    assert doc["ok"] is True and rc == 0

    # the terminal view says the same
    drawn = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "weir.cli", "status", *both, *no_stack], capture_output=True,
        text=True, timeout=120, env={**os.environ, **stack_env, "COLUMNS": "200"})
    assert drawn.returncode == 0, drawn.stdout + drawn.stderr
    assert "warning: the stack runs 2 versions" in drawn.stdout
    assert NO_VERSION_ROUTE in drawn.stdout and commit()[:12] in drawn.stdout
