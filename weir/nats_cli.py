"""`weir nats`: the bus identities of a deployment (weir/natsdeploy.py does the work)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

console = Console()


def echo(line: str) -> None:
    """A line to stdout as it is (no rich markup or wrapping: paths and seeds' file names print whole)."""
    print(line, flush=True)


nats_app = typer.Typer(no_args_is_help=True, help="The bus identities of a deployment (compose.yaml): NKEY seeds, "
                       "the servers' users and the cluster's route credential (weir/natsdeploy.py).")

NatsOut = Annotated[Path, typer.Option("--out", help="where the seeds (seeds/) and the servers' generated "
                                       "configuration (generated/) go; compose.yaml reads deploy/nats")]
NatsNodes = Annotated[list[str] | None, typer.Option(
    "--node", help="a node of the cluster, HOST[:PORT] (route port, default 6222), once per node; default: the nodes "
    "of the existing route credential, else nats-1, nats-2 and nats-3 (compose.yaml)")]


def _nats_credentials(out: Path, publishers: list[Any], nodes: list[str] | None) -> Any:
    from weir.natsdeploy import CredentialsError, write_credentials

    try:
        return write_credentials(out, publishers, nodes)
    except CredentialsError as exc:
        console.print(f"[red]weir nats: {exc}[/red]", soft_wrap=True)
        raise typer.Exit(1) from exc


@nats_app.command("credentials")
def nats_credentials(
    out: NatsOut = Path("deploy/nats"),
    node: NatsNodes = None,
) -> None:
    """Make every identity's seed (existing ones are kept, outside teams with their accounts), check the identities
    against the rules, and write the servers' users and the route credential that deploy/nats/nats.conf includes.
    An outside team is added or changed with `weir nats publisher`."""
    made = _nats_credentials(out, [], node)
    for line in made.report():
        echo(line)


@nats_app.command("publisher")
def nats_publisher(
    name: Annotated[str, typer.Argument(help="the team's identity: letters, digits, - and _")],
    account: Annotated[list[str] | None, typer.Option(
        "--account", help="an account the team serves, once per account (a new team needs one; given, they replace "
        "its accounts; omitted, they are kept)")] = None,
    first_party: Annotated[bool | None, typer.Option(
        "--first-party/--developer", help="its recordings may be first-party jobs (and on the bare legacy subject); "
        "default: a new team's are developer jobs, an existing team keeps its flag")] = None,
    out: NatsOut = Path("deploy/nats"),
    node: NatsNodes = None,
) -> None:
    """Give an outside team a publisher-like identity of its own, or change its accounts: it reads only its
    accounts' public events and publishes only their recordings under its own name (SPEC 12). Prints the seed to
    hand over, how they connect, and which server configuration changed."""
    from weir.natsdeploy import TeamChange

    change = TeamChange(name, tuple(account) if account else None, first_party)
    made = _nats_credentials(out, [change], node)
    for line in made.publisher_report(name):
        echo(line)


@nats_app.command("publishers")
def nats_publishers(out: NatsOut = Path("deploy/nats")) -> None:
    """List the publishers: the outside teams (their accounts and whether first-party) and the stack's own."""
    from weir.natsdeploy import CredentialsError, outside_publishers, read_teams, seeds_dir, stack_publisher

    if not out.is_dir():  # a mistyped --out lists no team: said, not shown as a stack without teams
        console.print(f"[red]weir nats publishers: no directory {out} (the --out of `weir nats credentials`)[/red]",
                      soft_wrap=True)
        raise typer.Exit(1)
    try:
        kept = read_teams(out)
        names = outside_publishers(seeds_dir(out))
    except CredentialsError as exc:
        console.print(f"[red]weir nats: {exc}[/red]", soft_wrap=True)
        raise typer.Exit(1) from exc
    stack = stack_publisher()
    echo(f"{stack.name}: every account, first-party (the stack's own: weir up's and the platform's recording "
          "services; its seed is not handed over)")
    for name in names:
        team = kept.get(name)
        accounts = ", ".join(team.accounts) if team and team.accounts else "none (reads and publishes nothing)"
        kind = "first-party" if team and team.first_party else "developer jobs only"
        echo(f"{name}: accounts {accounts}; {kind}; seed {seeds_dir(out) / f'{name}.nk'}")
