"""`weir nats`: the bus identities of a deployment (weir/natsdeploy.py does the work), and of a running `weir up`.

Against a running `weir up` (its stack file: WEIR_STACK, else .weir/stack.json) whose NATS admits the teams of the
files written here, `weir nats publisher` (and `credentials`) also has its nats-server admit them at once: its
identities' users written again and reloaded by SIGHUP to the pid of its run file, then the teams' durables made
by the operator, as `weir streams apply` would (weir/up.py `admit_teams`).
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape

if TYPE_CHECKING:
    from weir.up import RunningStack

console = Console()


def echo(line: str) -> None:
    """A line to stdout as it is (no rich markup or wrapping: paths and seeds' file names print whole)."""
    print(line, flush=True)


def fail(line: str) -> typer.Exit:
    """One red line (never wrapped; brackets in it are text, not markup), and exit code 1."""
    console.print(escape(line), style="red", soft_wrap=True, highlight=False)
    return typer.Exit(1)


nats_app = typer.Typer(no_args_is_help=True, help="The bus identities of a deployment (compose.yaml): NKEY seeds, "
                       "the servers' users and the cluster's route credential (weir/natsdeploy.py); and the outside "
                       "teams of a running `weir up`.")

NatsOut = Annotated[Path | None, typer.Option(
    "--out", help="where the seeds (seeds/), the teams (teams.json) and the servers' generated configuration "
    "(generated/) go; compose.yaml reads deploy/nats. Default: the folder of the teams file of the running `weir up` "
    "(its stack file: WEIR_STACK, else .weir/stack.json), else deploy/nats", show_default=False)]
NatsNodes = Annotated[list[str] | None, typer.Option(
    "--node", help="a node of the cluster, HOST[:PORT] (route port, default 6222), once per node; default: the nodes "
    "of the existing route credential, else nats-1, nats-2 and nats-3 (compose.yaml)")]
Offline = Annotated[bool, typer.Option(
    "--offline", help="write the files only: ask no stack or database (the accounts are not checked) and change no "
    "running nats-server (a deployment's files made away from it)")]


def _stack() -> RunningStack | None:
    from shared.settings import stack_file
    from weir.up import read_stack

    return read_stack(stack_file())


def _out(out: Path | None, stack: RunningStack | None) -> Path:
    """--out as given; else the folder of the running `weir up`'s teams file; else deploy/nats."""
    from weir.natsdeploy import DEFAULT_OUT, TEAMS_FILE

    if out is not None:
        return out
    if stack is not None and stack.teams_file is not None and stack.teams_file.name == TEAMS_FILE:
        return stack.teams_file.parent
    return DEFAULT_OUT


def _nats_credentials(out: Path, publishers: list[Any], nodes: list[str] | None) -> Any:
    from weir.natsdeploy import CredentialsError, write_credentials

    try:
        return write_credentials(out, publishers, nodes)
    except CredentialsError as exc:
        raise fail(f"weir nats: {exc}") from exc


# ---------------------------------------------------------------------------------------------- the accounts


async def unknown_accounts(database_url: str, accounts: Sequence[str]) -> list[str]:
    """Those of `accounts` that auth's database does not hold (auth.accounts, by id)."""
    import asyncpg

    from shared import db

    conn = await asyncpg.connect(database_url, timeout=10)
    try:
        rows = await conn.fetch(f"SELECT id::text AS id FROM {db.quote_ident(db.SCHEMAS['auth'])}.accounts "
                                "WHERE id::text = ANY($1::text[])", list(accounts))
    finally:
        await conn.close()
    found = {row["id"] for row in rows}
    return [a for a in accounts if a not in found]


def check_accounts(command: str, name: str, accounts: Sequence[str], stack: RunningStack | None,
                   offline: bool) -> str:
    """Refuse (exit 1, one line) accounts auth does not hold, asked in the database of the running `weir up` (or
    WEIR_DATABASE_URL's); that database not answering is refused too, unless --offline. With nothing to ask (no stack
    file, no WEIR_DATABASE_URL: a deployment's files made away from it) the accounts are not checked. Returns the
    line that says which."""
    import asyncpg

    from shared.settings import STACK_FILE_ENV, CommonSettings, local_stack_settings, stack_file

    if offline:
        return f"accounts not checked (--offline): make sure {', '.join(accounts)} are auth's account ids"
    if stack is None and "WEIR_DATABASE_URL" not in os.environ:
        return (f"accounts not checked: no running `weir up` ({stack_file()}; {STACK_FILE_ENV}) nor WEIR_DATABASE_URL "
                f"to ask: make sure {', '.join(accounts)} are auth's account ids")
    where = "WEIR_DATABASE_URL" if "WEIR_DATABASE_URL" in os.environ else f"the database of {stack_file()}"
    settings = CommonSettings(**local_stack_settings())
    try:
        unknown = asyncio.run(unknown_accounts(settings.database_url, accounts))
    except asyncpg.UndefinedTableError as exc:
        raise fail(f"weir nats {command}: {where} has no auth.accounts (auth's migrations not applied: `weir migrate "
                   f"auth`); {name} is not changed") from exc
    except (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
        raise fail(f"weir nats {command}: PostgreSQL does not answer at {where}'s address ({type(exc).__name__}: "
                   f"{exc}), so the accounts cannot be checked; {name} is not changed. Is the stack running? A `weir "
                   f"up` elsewhere: set {STACK_FILE_ENV} to its stack.json; a deployment: WEIR_DATABASE_URL; files "
                   "for a deployment out of reach: --offline") from exc
    if unknown:
        raise fail(f"weir nats {command}: no account {', '.join(unknown)} in auth's accounts ({where}): check the id "
                   f"(`weir accounts create` prints it); {name} is not changed")
    return f"accounts checked: {', '.join(accounts)} held by auth ({where})"


# ------------------------------------------------------------------------------------- a running `weir up`


def join_stack(command: str, out: Path, stack: RunningStack | None, offline: bool,
               team: str | None = None) -> tuple[list[str] | None, list[str]]:
    """Have a running `weir up` whose teams file is `out`'s admit its teams now (weir/up.py `admit_teams`) and make
    their durables, as the operator. Returns what was done (None: no such stack, nothing done) and notes on why
    not. A stack that should take the teams but does not: one line, exit 1 (the files are written)."""
    from shared.devstack.errors import DevStackError
    from weir.natsdeploy import CredentialsError, teams_path
    from weir.up import admit_teams

    if stack is None:
        return None, []
    at = f"the running `weir up` ({stack.stack_json})"
    if stack.teams_file is None or stack.servers_dir is None or not stack.nats_names:
        return None, [f"{at} runs no NATS of its own that admits teams (`--external`, or a release before): not "
                      "changed; its NATS takes the files as a deployment's does"]
    if not stack.nats_running():
        return None, [f"{stack.stack_json}: its `weir up` is not running (its nats-server's run file names no live "
                      "process): nothing reloaded; a `weir up` admits the teams of its teams file when it starts"]
    if teams_path(out).absolute() != stack.teams_file.absolute():
        return None, [f"{at} admits the teams of {stack.teams_file}, not {teams_path(out)}: not changed (--out "
                      f"{stack.teams_file.parent}, or start it with WEIR_NATS_TEAMS_FILE={teams_path(out).absolute()})"]
    if offline:
        return None, [f"{at} not changed (--offline): it admits the teams of {stack.teams_file} when it starts again"]
    try:
        teams, lines = admit_teams(stack)
    except (DevStackError, CredentialsError) as exc:
        raise fail(f"weir nats {command}: the files are written, but {at} did not take them: {exc}") from exc
    lines.append(f"{at} admits now: {teams.summary()}")
    lines += [f"  {line}" for line in _apply_durables(stack, team)]
    return lines, []


def _apply_durables(stack: RunningStack, team: str | None) -> list[str]:
    """The publishers' durables of the stack's teams file, made by the operator as `weir streams apply` does; what
    changed, and what concerns `team`."""
    from shared.messaging import tool_broker
    from shared.settings import CommonSettings, local_stack_settings
    from weir.cli import _run_tool
    from weir.readerdurables import apply_reader_durables

    settings = CommonSettings(**local_stack_settings(stack.stack_json)).model_copy(
        update={"nats_teams_file": str(stack.teams_file)})

    async def go() -> list[str]:
        async with tool_broker(settings, "cli", fail_fast=True) as broker:
            return await apply_reader_durables(broker.connection.jetstream(), settings)

    done: list[str] = _run_tool(settings, go)
    mine = f"/{team}_" if team else None
    return [line for line in done if not line.startswith("kept ") or (mine and mine in line.split(":")[0])]


# ------------------------------------------------------------------------------------------------- commands


@nats_app.command("credentials")
def nats_credentials(
    out: NatsOut = None,
    node: NatsNodes = None,
    offline: Offline = False,
) -> None:
    """Make every identity's seed (existing ones are kept, outside teams with their accounts), check the identities
    against the rules, and write the servers' users and the route credential that deploy/nats/nats.conf includes.
    An outside team is added or changed with `weir nats publisher`. A running `weir up` admitting the teams of these
    files takes them at once (a team whose seed was deleted is let in no more)."""
    stack = _stack()
    out = _out(out, stack)
    made = _nats_credentials(out, [], node)
    joined, notes = join_stack("credentials", out, stack, offline)
    for line in made.report():
        echo(line)
    for line in [*(joined or []), *notes]:
        echo(line)


@nats_app.command("publisher")
def nats_publisher(
    name: Annotated[str, typer.Argument(help="the team's identity: letters, digits, - and _")],
    account: Annotated[list[str] | None, typer.Option(
        "--account", help="an account the team serves, once per account (a new team needs one; given, they replace "
        "its accounts; omitted, they are kept); checked against auth's accounts (the running stack's database, or "
        "WEIR_DATABASE_URL's)")] = None,
    first_party: Annotated[bool | None, typer.Option(
        "--first-party/--developer", help="its recordings may be first-party jobs (and on the bare legacy subject); "
        "default: a new team's are developer jobs, an existing team keeps its flag")] = None,
    out: NatsOut = None,
    node: NatsNodes = None,
    offline: Offline = False,
) -> None:
    """Give an outside team a publisher-like identity of its own, or change its accounts: it reads only its
    accounts' public events and publishes only their recordings under its own name (SPEC 12). An account auth does
    not hold is refused. Against a running `weir up` admitting the teams of these files, its nats-server takes the
    team at once and the operator makes its durables. Prints the seed to hand over, how they connect, and what was
    done or is left to do."""
    from shared.identities import IDENTITIES, valid_name
    from shared.publishersubjects import valid_account
    from weir.natsdeploy import TeamChange

    stack = _stack()
    out = _out(out, stack)
    accounts = tuple(account) if account else None
    checked = None
    # a malformed id or name: write_credentials says what is wrong with it, before anything is asked
    if accounts and all(map(valid_account, accounts)) and valid_name(name) and name not in IDENTITIES:
        checked = check_accounts("publisher", name, list(dict.fromkeys(accounts)), stack, offline)
    change = TeamChange(name, accounts, first_party)
    made = _nats_credentials(out, [change], node)
    joined, notes = join_stack("publisher", out, stack, offline, team=name)
    if joined is not None and stack is not None:
        urls = str(stack.info.get("nats_url") or "NATS_URL").split(",")  # nats-py takes a list, not a comma string
        servers = json.dumps(urls[0]) if len(urls) == 1 else json.dumps(urls)
        identity = made.teams[name].identity()
        joined.append(f'{name} may connect now: nats.connect({servers}, nkeys_seed="{made.seeds[name]}", '
                      f'inbox_prefix="{identity.inbox_prefix}")')
    for line in [*([checked] if checked else []), *made.publisher_report(name, joined), *notes]:
        echo(line)


@nats_app.command("publishers")
def nats_publishers(out: NatsOut = None) -> None:
    """List the publishers: the outside teams (their accounts and whether first-party) and the stack's own."""
    from weir.natsdeploy import CredentialsError, outside_publishers, read_teams, seeds_dir, stack_publisher

    out = _out(out, _stack())
    if not out.is_dir():  # a mistyped --out lists no team: said, not shown as a stack without teams
        raise fail(f"weir nats publishers: no directory {out} (the --out of `weir nats credentials`)")
    try:
        kept = read_teams(out)
        names = outside_publishers(seeds_dir(out))
    except CredentialsError as exc:
        raise fail(f"weir nats: {exc}") from exc
    stack = stack_publisher()
    echo(f"{stack.name}: every account, first-party (the stack's own: weir up's and the platform's recording "
         "services; its seed is not handed over)")
    for name in names:
        team = kept.get(name)
        accounts = ", ".join(team.accounts) if team and team.accounts else "none (reads and publishes nothing)"
        kind = "first-party" if team and team.first_party else "developer jobs only"
        echo(f"{name}: accounts {accounts}; {kind}; seed {seeds_dir(out) / f'{name}.nk'}")
