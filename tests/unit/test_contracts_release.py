"""This code's contracts against the previous release's snapshot (contracts/<version>/): no direction may break.

Events are also held to every older release for old publisher -> new consumer (replays bring old events back). The
snapshots, `weir contracts check|snapshot` and `weir release` are tested here too."""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from shared import acceptances, compat, contractsnap, release
from shared.compat import check_current, check_release
from weir.cli import app


@pytest.fixture(scope="module")
def current() -> dict[str, Any]:
    return contractsnap.collect()


def previous() -> release.Release:
    found = release.previous_release()
    assert found is not None, "releases.toml lists no release"
    return found


def checked(current: dict[str, Any], previous: tuple[str, dict[str, Any]],
            older: tuple[tuple[str, dict[str, Any]], ...] = ()) -> compat.ReleaseCheck:
    """check_release with the findings contracts/accepted.toml accepts set apart, as `weir contracts check` has it."""
    accepted = acceptances.read(contractsnap.CONTRACTS_DIR / acceptances.FILE_NAME)
    return acceptances.apply(check_release(current, previous, older), accepted)


def test_this_code_breaks_no_contract_of_the_previous_release() -> None:
    result = check_current()
    assert result.against == previous().version
    assert result.breaking == [], "\n".join(["breaking changes (`weir contracts check` shows them):",
                                             *result.breaking])


def test_every_release_listed_has_its_snapshot_as_written() -> None:
    for r in release.read_releases():
        directory = contractsnap.snapshot_dir(r.version)
        snapshot = contractsnap.load(directory)
        assert snapshot["release"] == {"version": r.version, "commit": r.commit}
        assert snapshot["events"] and snapshot["requests"] and snapshot["openapi"]["api"]["paths"]
        assert snapshot["envelope"]["schema"]["properties"]["data"]
        for relative, text in contractsnap.files(snapshot).items():
            assert (directory / relative).read_text(encoding="utf-8") == text, f"{relative} is not as written"


def test_a_breaking_change_fails_the_check(current: dict[str, Any]) -> None:
    label = previous().version
    old = contractsnap.load(contractsnap.snapshot_dir(label))
    changed = copy.deepcopy(current)
    # the new auth.check reply drops a field the old api requires; sweep.run, still called, is gone
    reply = changed["requests"]["auth.check"]["replies"]["CheckReply"]["schema"]
    del reply["properties"]["client_address"]
    reply["required"].remove("client_address")
    del changed["requests"]["sweep.run"]
    result = checked(changed, (label, old))
    assert {(c.name, c.mode) for c in result.changes if c.breaking} == {("auth.check", compat.FORWARD),
                                                                         ("sweep.run", compat.FORWARD)}
    assert any("client_address" in line for line in result.breaking)


def test_an_event_moved_off_its_old_subject_breaks_both_ways_and_moved_beside_it_breaks_nothing(
    current: dict[str, Any],
) -> None:
    """1.0.0 publishes and reads `upload.completed` on the bare type. This release adds `upload.completed.*` beside
    it (compatible); dropping the bare type in the same release would leave 1.0.0's encode waiting and 1.0.0's api
    publishing where nobody reads (SPEC 11: a new subject ships beside the old one)."""
    label = previous().version
    old = contractsnap.load(contractsnap.snapshot_dir(label))
    assert "subjects" not in old["events"]["upload.completed"]  # 1.0.0's snapshot: the bare type alone
    beside = checked(current, (label, old))
    moved_beside = next(c for c in beside.changes if c.name == "upload.completed")
    assert "subjects +upload.completed.*" in moved_beside.what and not moved_beside.breaking
    dropped = copy.deepcopy(current)
    dropped["events"]["upload.completed"]["subjects"] = ["upload.completed.*"]
    result = checked(dropped, (label, old))
    assert {(c.name, c.mode) for c in result.changes if c.breaking} == {("upload.completed", compat.NONE)}


def test_events_are_held_to_every_older_release_for_replays(current: dict[str, Any]) -> None:
    label = previous().version
    old = contractsnap.load(contractsnap.snapshot_dir(label))
    older = copy.deepcopy(old)  # a release whose encode.completed had no `worker` yet: replays bring those back
    schema = older["events"]["encode.completed"]["schema"]
    del schema["properties"]["worker"]
    schema["required"].remove("worker")
    result = checked(current, (label, old), (("0.9.0", older),))
    assert [(r, c.name) for r, c in result.older] == [("0.9.0", "encode.completed")]
    assert any("0.9.0" in line and "worker" in line for line in result.breaking)


def test_the_envelope_every_event_travels_in_is_checked_too(current: dict[str, Any]) -> None:
    label = previous().version
    old = contractsnap.load(contractsnap.snapshot_dir(label))
    changed = copy.deepcopy(current)
    changed["envelope"]["schema"]["properties"]["partition"] = {"type": "integer"}
    changed["envelope"]["schema"]["required"].append("partition")
    (change,) = [c for c in checked(changed, (label, old), (("0.9.0", old),)).changes if c.breaking]
    assert (change.name, change.mode) == (compat.ENVELOPE, compat.FORWARD)
    assert checked(changed, (label, old), (("0.9.0", old),)).older[0][1].name == compat.ENVELOPE


@pytest.mark.usefixtures("wide_console")
def test_weir_contracts_check_shows_the_changes_and_their_verdicts() -> None:
    out = CliRunner().invoke(app, ["contracts", "check"])
    assert out.exit_code == 0, out.output
    assert f"compatible with {previous().version} in both directions" in out.output


@pytest.mark.usefixtures("wide_console")
def test_weir_contracts_check_exits_1_on_a_breaking_change(monkeypatch: pytest.MonkeyPatch,
                                                           current: dict[str, Any]) -> None:
    changed = copy.deepcopy(current)
    del changed["requests"]["sweep.run"]
    monkeypatch.setattr(contractsnap, "collect", lambda declarations=None: changed)
    out = CliRunner().invoke(app, ["contracts", "check"])
    assert out.exit_code == 1
    assert "sweep.run" in out.output and "breaking" in out.output and "FORWARD" in out.output


def test_the_collector_run_as_a_file_snapshots_the_checkout_it_is_given(tmp_path: Path,
                                                                         current: dict[str, Any]) -> None:
    """How contracts/1.0.0 was made from release 1.0.0's checkout: the file, run with that checkout's code."""
    env = {**os.environ, "PYTHONPATH": str(release.ROOT)}
    subprocess.run([sys.executable, contractsnap.__file__, "--out", str(tmp_path)], env=env, check=True,
                   capture_output=True, timeout=120)
    assert contractsnap.load(tmp_path) == json.loads(json.dumps(current))


@pytest.fixture()
def repository(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A git repository holding a copy of releases.toml, the previous release's snapshot and the findings accepted
    against it, as `weir release` sees this checkout."""
    root = tmp_path / "repo"
    root.mkdir()
    shutil.copy(release.RELEASES_FILE, root / "releases.toml")
    shutil.copytree(contractsnap.snapshot_dir(previous().version), root / "contracts" / previous().version)
    shutil.copy(contractsnap.CONTRACTS_DIR / acceptances.FILE_NAME, root / "contracts")  # what it accepts on purpose
    for args in (["init", "-q"], ["add", "."], ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x"]):
        subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True)
    monkeypatch.setattr(release, "ROOT", root)
    monkeypatch.setattr(release, "RELEASES_FILE", root / "releases.toml")
    monkeypatch.setattr(contractsnap, "CONTRACTS_DIR", root / "contracts")
    return root


def test_weir_release_lists_the_version_and_writes_its_snapshot(repository: Path) -> None:
    head = subprocess.run(["git", "-C", str(repository), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    out = CliRunner().invoke(app, ["release"])
    assert out.exit_code == 0, out.output
    listed = release.read_releases(repository / "releases.toml")
    assert (listed[-1].version, listed[-1].commit) == (release.VERSION, head)
    snapshot = contractsnap.load(repository / "contracts" / release.VERSION)
    assert snapshot["release"] == {"version": release.VERSION, "commit": head}
    again = CliRunner().invoke(app, ["release"])  # the same version twice
    assert again.exit_code == 1 and "already released" in again.output


def test_weir_release_refuses_a_tree_with_changes(repository: Path) -> None:
    (repository / "releases.toml").write_text((repository / "releases.toml").read_text() + "# edited\n")
    out = CliRunner().invoke(app, ["release"])
    assert out.exit_code == 1 and "not clean" in out.output
    assert release.VERSION not in [r.version for r in release.read_releases(repository / "releases.toml")]


def test_every_contract_of_this_code_reads_itself(current: dict[str, Any]) -> None:
    assert compat.compare(current, current) == []
    schemas = [e["schema"] for e in current["events"].values()] + [
        m["schema"] for r in current["requests"].values() for m in (r["request"], *r["replies"].values())]
    assert all(compat.problems_reading(s, s) == [] for s in schemas)


def _commit_all(root: Path) -> str:
    for args in (["add", "."], ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x"]):
        subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True)
    return subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()


def _status(root: Path) -> str:
    return subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=all"],
                          capture_output=True, text=True, check=True).stdout


@pytest.fixture()
def other_checkout(tmp_path: Path) -> tuple[Path, str]:
    """Another git checkout (standing in for a release's own), and its HEAD."""
    root = tmp_path / "other"
    root.mkdir()
    (root / "README.md").write_text("another checkout\n")
    subprocess.run(["git", "-C", str(root), "init", "-q"], check=True, capture_output=True)
    return root, _commit_all(root)


@pytest.fixture()
def snapshots_written(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Path | None]]:
    """The (version, tree) of each snapshot `weir contracts snapshot` goes on to write, instead of writing it."""
    from weir import contracts_cli

    calls: list[tuple[str, Path | None]] = []

    def record(version: str, tree: Path | None = None, commit: str = "") -> list[Path]:
        calls.append((version, tree))
        return []

    monkeypatch.setattr(contracts_cli, "write_snapshot", record)
    return calls


def test_weir_contracts_snapshot_refuses_to_overwrite_a_released_version_with_this_code(repository: Path) -> None:
    """The walkthrough's `snapshot --version 1.0.0` rewrote the baseline with this code's contracts, silently."""
    version = previous().version
    out = CliRunner().invoke(app, ["contracts", "snapshot", "--version", version])
    assert out.exit_code == 1 and isinstance(out.exception, SystemExit), out.output
    assert f"{version} is released" in out.output and "--tree" in out.output and "--force" in out.output
    assert len(out.output.strip().splitlines()) == 1
    assert _status(repository) == ""  # contracts/1.0.0 as committed, nothing added


def test_weir_contracts_snapshot_refuses_a_tree_not_at_the_released_commit(
    repository: Path, other_checkout: tuple[Path, str], snapshots_written: list[tuple[str, Path | None]],
) -> None:
    tree, head = other_checkout
    out = CliRunner().invoke(app, ["contracts", "snapshot", "--tree", str(tree), "--version", previous().version])
    assert out.exit_code == 1 and f"is at {head[:12]}" in out.output, out.output
    assert snapshots_written == []


def test_weir_contracts_snapshot_writes_a_released_version_from_its_own_clean_checkout_or_with_force(
    repository: Path, other_checkout: tuple[Path, str], snapshots_written: list[tuple[str, Path | None]],
) -> None:
    tree, head = other_checkout
    version = previous().version
    listed = (repository / "releases.toml").read_text()
    (repository / "releases.toml").write_text(listed.replace(previous().commit, head))  # released from `tree`
    args = ["contracts", "snapshot", "--tree", str(tree), "--version", version]
    out = CliRunner().invoke(app, args)
    assert out.exit_code == 0, out.output
    assert snapshots_written == [(version, tree)]
    (tree / "stray.json").write_text("{}")  # its checkout, but not as released
    out = CliRunner().invoke(app, args)
    assert out.exit_code == 1 and "untracked" in out.output and "stray.json" in out.output, out.output
    assert len(snapshots_written) == 1
    forced = CliRunner().invoke(app, ["contracts", "snapshot", "--version", version, "--force"])
    assert forced.exit_code == 0, forced.output
    assert snapshots_written[-1] == (version, None)


def test_weir_contracts_snapshot_of_an_unreleased_version_needs_no_force(
    repository: Path, snapshots_written: list[tuple[str, Path | None]],
) -> None:
    out = CliRunner().invoke(app, ["contracts", "snapshot"])
    assert out.exit_code == 0, out.output
    assert snapshots_written == [(release.VERSION, None)]


def test_weir_release_refuses_untracked_files_and_lists_them(repository: Path) -> None:
    """An untracked file inside contracts/<version>/ alters the baseline the check reads: `git status
    --untracked-files=no` let the walkthrough's release go ahead on one."""
    stray = Path("contracts") / previous().version / "events" / "stray.event.json"
    (repository / stray).write_text("{}")
    before = (repository / "releases.toml").read_text()
    out = CliRunner().invoke(app, ["release"])
    assert out.exit_code == 1 and "not clean" in out.output and stray.as_posix() in out.output, out.output
    assert (repository / "releases.toml").read_text() == before
    assert not contractsnap.snapshot_dir(release.VERSION).exists()


def test_weir_release_refuses_a_malformed_releases_file_in_one_line(repository: Path) -> None:
    (repository / "releases.toml").write_text('[[release]]\nversion = "one"\ncommit = "x"\n')
    out = CliRunner().invoke(app, ["release"])
    assert out.exit_code == 1 and isinstance(out.exception, SystemExit), out.output
    assert "not a MAJOR.MINOR.PATCH version" in out.output and len(out.output.strip().splitlines()) == 1


@pytest.mark.parametrize(("command", "says"), [
    (["contracts", "check", "--against", "garbage"], "'garbage' is not a MAJOR.MINOR.PATCH version"),
    (["contracts", "check", "--against", "9.9.9"], "no contract snapshot at"),
    (["contracts", "snapshot", "--version", "garbage"], "'garbage' is not a MAJOR.MINOR.PATCH version"),
])
def test_a_bad_version_is_one_line_and_exit_1_not_a_traceback(command: list[str], says: str) -> None:
    out = CliRunner().invoke(app, command)
    assert out.exit_code == 1 and isinstance(out.exception, SystemExit), out.output
    assert says in out.output and len(out.output.strip().splitlines()) == 1
