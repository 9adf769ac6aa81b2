"""`weir contracts check|snapshot` and `weir release`: the contract snapshots of each release and the per-direction
compatibility check against them (SPEC 11; shared/compat.py judges, shared/contractsnap.py collects)."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, NoReturn

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

if TYPE_CHECKING:
    from shared.compat import Change, Verdict

contracts_app = typer.Typer(no_args_is_help=True, help="Contract snapshots per release, and the compatibility check.")
console = Console()


def _fail(message: str) -> NoReturn:
    """One red line (never wrapped, never read as markup), and exit 1."""
    console.print(f"[red]{escape(message)}[/red]", soft_wrap=True)
    raise typer.Exit(1)


@contracts_app.command("check")
def contracts_check(
    against: Annotated[str | None, typer.Option(help="the release to check against (default: the previous one)")]
    = None,
) -> None:
    """Show each contract that changed since a release, what changed, and the verdict per direction; exit 1 when a
    direction breaks (for events, also old publishers of every older release -> this consumer), unless
    contracts/accepted.toml accepts that finding on purpose, or when an entry there matches no finding any more."""
    from shared.acceptances import AcceptanceError
    from shared.compat import check_current
    from shared.release import ReleaseError

    try:
        result = check_current(against)
    except (FileNotFoundError, AcceptanceError, ReleaseError) as exc:
        _fail(str(exc))
    show_check(result)
    if result.breaking:
        raise typer.Exit(1)


def show_check(result: object) -> None:
    from shared.acceptances import FILE_NAME, entry_text
    from shared.compat import ReleaseCheck

    assert isinstance(result, ReleaseCheck)
    if not result.changes:
        console.print(f"no contract changed since {result.against}")
    else:
        table = Table(title=f"contracts changed since {result.against}", show_lines=True)
        for column in ("contract", "what changed", "old -> new", "new -> old", "mode"):
            table.add_column(column, overflow="fold")
        for c in result.changes:
            table.add_row(f"{c.kind} {c.name}", "\n".join(_shorten(c.what)), _verdict(c.backward), _verdict(c.forward),
                          _mode_cell(c))
        console.print(table)
    for release, c in result.older:
        if c.backward.problems:
            console.print(f"[red]event {c.name} from {release}: {c.backward.direction}: "
                          f"{'; '.join(c.backward.problems)}[/red]", soft_wrap=True)
        if c.backward.accepted:
            console.print(f"[yellow]event {c.name} from {release}: {c.backward.direction}: accepted "
                          f"({c.backward.reason}): {'; '.join(c.backward.accepted)}[/yellow]", soft_wrap=True)
    for line in result.stale:
        console.print(f"[red]stale acceptance in contracts/{FILE_NAME}: {line}[/red]", soft_wrap=True)
    breaking = len({(c.kind, c.name) for c in result.changes if c.breaking}) + sum(
        1 for _, c in result.older if c.backward.problems) + len(result.stale)
    accepted = sum(len(d.accepted) for c in result.changes for d in (c.backward, c.forward)) + sum(
        len(c.backward.accepted) for _, c in result.older)
    if breaking:
        unaccepted = [(result.against, c, d) for c in result.changes for d in (c.backward, c.forward) if d.problems]
        unaccepted += [(release, c, c.backward) for release, c in result.older if c.backward.problems]
        if unaccepted:
            console.print(f"A finding that is no break in fact (verified otherwise) may be accepted on purpose in "
                          f"contracts/{FILE_NAME}, with its reason, as:")
            for release, c, d in unaccepted:
                console.print(entry_text(release, c, d), markup=False, highlight=False, soft_wrap=True)
        console.print(f"[red]{breaking} breaking[/red]")
    else:
        console.print(f"[green]compatible with {result.against} in both directions[/green]"
                      + (f"[yellow], {accepted} findings accepted on purpose (contracts/{FILE_NAME})[/yellow]"
                         if accepted else ""))


def _mode(mode: str) -> str:
    """BACKWARD and FORWARD alone: the mode satisfied, the other direction broken."""
    return f"{mode} only" if mode in ("BACKWARD", "FORWARD") else mode


def _mode_cell(c: Change) -> str:
    if c.breaking:
        return f"[red]{_mode(c.mode)}[/red]"
    if c.accepted:
        return f"[yellow]{_mode(c.mode_as_written)}, accepted[/yellow]"
    return f"[green]{c.mode}[/green]"


def _verdict(verdict: Verdict) -> str:
    """A direction's cell: what breaks, then what is accepted on purpose (a few of its problems, and why)."""
    if verdict.problems:
        lines = [f"[red]breaking[/red]\n{verdict.direction}", *(f"- {p}" for p in verdict.problems)]
    elif verdict.accepted:
        lines = [verdict.direction]
    else:
        lines = [f"[green]compatible[/green]\n{verdict.direction}"]
    if verdict.accepted:
        lines += [f"[yellow]accepted ({len(verdict.accepted)}): {verdict.reason}[/yellow]",
                  *_shorten(tuple(f"- {p}" for p in verdict.accepted), most=3)]
    return "\n".join(lines)


def _shorten(lines: tuple[str, ...], most: int = 8) -> list[str]:
    return list(lines[:most]) + ([f"... {len(lines) - most} more"] if len(lines) > most else [])


@contracts_app.command("snapshot")
def contracts_snapshot(
    tree: Annotated[Path | None, typer.Option(help="snapshot another checkout (e.g. an older release's) instead of "
                                              "this code")] = None,
    version: Annotated[str | None, typer.Option(help="the version to write (default: shared/release.py VERSION)")]
    = None,
    force: Annotated[bool, typer.Option("--force", help="write it even over a released version's snapshot (the "
                                        "baseline every later check reads)")] = False,
) -> None:
    """Write contracts/<VERSION>/: every event, request/reply contract and the api's public OpenAPI document.
    Refuses a version releases.toml lists, unless --tree is a clean checkout of that release's commit, or --force."""
    from shared import release

    version = version or release.VERSION
    try:
        release.parse_version(version)
        refusal = None if force else released_snapshot_refusal(version, tree)
    except release.ReleaseError as exc:
        _fail(str(exc))
    if refusal:
        _fail(refusal)
    written = write_snapshot(version, tree)
    console.print(f"wrote {len(written)} files under {written[0].parent.parent if written else '?'}")


def released_snapshot_refusal(version: str, tree: Path | None) -> str | None:
    """Why contracts/<version>/ may not be written from `tree` (None: this code), or None when it may. A released
    version's snapshot is the baseline every later check reads: only that release's own code may write it again."""
    from shared import release

    made = next((r for r in release.read_releases(release.RELEASES_FILE) if r.version == version), None)
    if made is None:
        return None
    why = f"{version} is released (releases.toml: commit {made.commit[:12]}): its snapshot is the baseline"
    how = (f"write it from that release's own checkout (--tree, e.g. `git worktree add DIR {made.commit[:12]}`), "
           f"or --force")
    if tree is None:
        return f"{why}, not this code's contracts; {how}"
    head = _git(tree, "rev-parse", "HEAD")
    if head is None or head.strip() != made.commit:
        return f"{why}; --tree {tree} is at {head.strip()[:12] if head else '(not a git checkout)'}; {how}"
    changed = _git(tree, "status", "--porcelain", "--untracked-files=all")
    if changed is None or changed.strip():
        return f"{why}; --tree {tree} has changes or untracked files: {' '.join(_paths(changed or ''))}"
    return None


def _git(directory: Path, *args: str) -> str | None:
    """git's output in `directory`, or None when it fails."""
    done = subprocess.run(["git", "-C", str(directory), *args], capture_output=True, text=True, check=False)
    return done.stdout if done.returncode == 0 else None


def _paths(porcelain: str) -> list[str]:
    """The paths of `git status --porcelain` lines."""
    return [line[3:] for line in porcelain.splitlines() if line.strip()]


def write_snapshot(version: str, tree: Path | None = None, commit: str = "") -> list[Path]:
    from shared import contractsnap, release

    release.parse_version(version)
    out = contractsnap.snapshot_dir(version)
    if tree is None:
        snapshot = contractsnap.collect()
        snapshot["release"] = {"version": version, "commit": commit or release.commit()}
        return contractsnap.write(snapshot, out)
    # the other checkout's code, in a process of its own: its modules, not these
    head = subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True, text=True, check=False)
    env = {**os.environ, "PYTHONPATH": str(tree.resolve())}
    done = subprocess.run([sys.executable, contractsnap.__file__, "--out", str(out), "--version", version,
                           "--commit", commit or head.stdout.strip()], env=env, capture_output=True, text=True,
                          check=False)
    if done.returncode != 0:
        console.print(f"[red]{done.stderr.strip()}[/red]")
        raise typer.Exit(1)
    return [Path(line) for line in done.stdout.splitlines() if line.strip()]


def release_command() -> None:
    """Make a release of this code: check that the tree is clean and the contracts compatible with the previous
    release, append shared/release.py VERSION with HEAD's commit to releases.toml, and write contracts/<VERSION>/.
    Then commit both, and raise VERSION for the next release."""
    from shared import release
    from shared.acceptances import AcceptanceError
    from shared.compat import check_current

    version = release.VERSION
    try:
        listed = release.read_releases(release.RELEASES_FILE)
        above = not listed or release.parse_version(version) > release.parse_version(listed[-1].version)
    except release.ReleaseError as exc:
        _fail(str(exc))
    if any(r.version == version for r in listed):
        _fail(f"{version} is already released; raise VERSION in shared/release.py")
    if not above:
        _fail(f"{version} is not above the last release, {listed[-1].version}")
    # untracked files count too: one left in contracts/<version>/ would alter the baseline the check reads
    dirty = subprocess.run(["git", "-C", str(release.ROOT), "status", "--porcelain", "--untracked-files=all"],
                           capture_output=True, text=True, check=False)
    if dirty.returncode != 0 or dirty.stdout.strip():
        console.print("[red]the tree is not clean: commit first, and commit or remove untracked files (??)[/red]")
        console.print(f"{dirty.stdout}{dirty.stderr}", markup=False, highlight=False, soft_wrap=True, end="")
        raise typer.Exit(1)
    if listed:
        try:
            result = check_current()
        except (FileNotFoundError, AcceptanceError, release.ReleaseError) as exc:
            _fail(str(exc))
        if result.breaking:
            show_check(result)
            raise typer.Exit(1)
    head = subprocess.run(["git", "-C", str(release.ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    with release.RELEASES_FILE.open("a", encoding="utf-8") as f:
        f.write(f'\n[[release]]\nversion = "{version}"\ncommit = "{head}"\n'
                f'date = "{datetime.now(UTC).date().isoformat()}"\n')
    written = write_snapshot(version, commit=head)
    console.print(f"released {version} at {head[:12]}: releases.toml and {len(written)} contract files written.\n"
                  f"Commit them, then raise VERSION in shared/release.py for the next release.")
