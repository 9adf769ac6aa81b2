"""The bus credentials of a deployment (compose.yaml's 3-node cluster), made by `weir nats credentials`.

Under the output directory (`deploy/nats`, none of it committed): `seeds/<identity>.nk`, one NKEY seed per declared
identity and per outside team (the seeds no declared identity owns; delete one and rerun to revoke it);
`teams.json`, each outside team's accounts and whether it is first-party (SPEC 12); `generated/authorization.conf`,
the servers' users rendered from shared/identities.py; `generated/cluster.conf`, the route credential. A rerun keeps
every seed, team, the route password and the nodes, so it changes nothing a running cluster relies on; nothing is
written when the identities break a rule (`violations`).
"""

from __future__ import annotations

import json
import os
import re
import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from shared.identities import IDENTITIES, PUBLISHER_IDENTITY, Identity, publisher_like, valid_name
from shared.identityrules import violations
from shared.natsauth import DIR_MODE, SEED_MODE, SEED_SUFFIX, SeedError, authorization_config, ensure_seeds, public_keys
from shared.publishersubjects import EVERY_ACCOUNT, public_subjects, recording_subjects, rejected_subject, valid_account

DEFAULT_OUT = Path("deploy/nats")
SEEDS_DIR = "seeds"
GENERATED_DIR = "generated"
AUTHORIZATION_FILE = "authorization.conf"
TEAMS_FILE = "teams.json"
CLUSTER_FILE = "cluster.conf"
ROUTE_USER = "weir-route"
ROUTE_PORT = 6222
DEFAULT_NODES: tuple[str, ...] = tuple(f"nats-{n}:{ROUTE_PORT}" for n in (1, 2, 3))  # compose.yaml's nodes

# Compose mounts a file-based secret as the host file itself, with its owner and mode (outside swarm it cannot set
# either), and the Weir image runs as its own user (uid 10001): a seed a container mounts must be readable by others.
# The seeds' directory stays 0700, so on the host only its owner reaches them. An outside team's seed, which no
# container mounts, stays 0600.
CONTAINER_SEED_MODE = 0o644
AUTHORIZATION_MODE = 0o644  # public keys and permissions: nothing secret
CLUSTER_MODE = 0o600  # the route password
# which accounts each team serves: no secret (authorization.conf, readable by others too, lists each team's account
# subjects), and the one-shot job (uid 10001) reads it to make the teams' durables (`weir streams apply`)
TEAMS_MODE = 0o644

_NODE = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?(?::[0-9]{1,5})?")
_PASSWORD = re.compile(r'^\s*password:\s*"([0-9a-f]{32,})"\s*$', re.M)
_ROUTE = re.compile(rf'^\s*"nats://{re.escape(ROUTE_USER)}:[0-9a-f]+@([^"]+)"\s*$', re.M)


class CredentialsError(Exception):
    """The credentials cannot be made as asked (a rule broken, a bad name, a damaged seed or file)."""


def seeds_dir(out: Path) -> Path:
    return out / SEEDS_DIR


def authorization_path(out: Path) -> Path:
    return out / GENERATED_DIR / AUTHORIZATION_FILE


def cluster_path(out: Path) -> Path:
    return out / GENERATED_DIR / CLUSTER_FILE


def teams_path(out: Path) -> Path:
    return out / TEAMS_FILE


@dataclass(frozen=True)
class Team:
    """An outside team's publisher-like identity: the accounts it serves and whether its recordings are first-party.
    A team without accounts (a seed made before teams had them) reads and publishes nothing."""

    name: str
    accounts: tuple[str, ...] = ()
    first_party: bool = False

    def identity(self) -> Identity:
        return publisher_like(self.name, self.accounts, first_party=self.first_party)


@dataclass(frozen=True)
class TeamChange:
    """What `weir nats publisher` asks: the team's accounts (None: keep them) and first-party flag (None: keep it)."""

    name: str
    accounts: tuple[str, ...] | None = None
    first_party: bool | None = None


def changed_team(current: Team | None, change: TeamChange) -> Team:
    """The team after a change: the accounts given replace its accounts (in the order given, once each), a flag
    given replaces its flag; a new team must name at least one account. Pure; raises CredentialsError."""
    accounts = tuple(dict.fromkeys(change.accounts)) if change.accounts is not None else None
    bad = [a for a in accounts or () if not valid_account(a)]
    if bad:
        raise CredentialsError(f"{change.name}: not account ids (one subject token: letters, digits, - and _): {bad}")
    if current is None and not accounts:
        raise CredentialsError(f"{change.name}: a new team needs its accounts (--account ID, once per account)")
    base = current or Team(change.name)
    return Team(change.name, accounts if accounts else base.accounts,
                base.first_party if change.first_party is None else change.first_party)


def read_teams(out: Path) -> dict[str, Team]:
    """The teams an earlier run kept (none: no file yet); raises CredentialsError on a file it did not write."""
    return read_teams_file(teams_path(out))


def read_teams_file(path: Path) -> dict[str, Team]:
    """The teams kept in `path` (none: no file); raises CredentialsError on a file `weir nats publisher` did not
    write."""
    return known_teams(path) or {}


def known_teams(path: Path) -> dict[str, Team] | None:
    """The teams kept in `path`, None when there is no such file: the teams are then unknown, which is not the same
    as a file listing none (`weir streams apply` removes no team's durable on None). Raises CredentialsError on a
    file `weir nats publisher` did not write."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        raw = json.loads(text)
        teams = {name: Team(name, tuple(entry["accounts"]), bool(entry["first_party"]))
                 for name, entry in raw["teams"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CredentialsError(f"{path} is not a teams file this command wrote ({type(exc).__name__}: {exc}): fix "
                               "or delete it (then give each team its accounts again)") from None
    bad = [n for n, t in teams.items() if not valid_name(n) or not all(valid_account(a) for a in t.accounts)]
    if bad:
        raise CredentialsError(f"{path}: bad team names or account ids for {bad}")
    return teams


def teams_text(teams: Iterable[Team]) -> str:
    body = {t.name: {"accounts": list(t.accounts), "first_party": t.first_party}
            for t in sorted(teams, key=lambda t: t.name)}
    return json.dumps({"teams": body}, indent=2) + "\n"


def node_address(node: str) -> str:
    """`nats-1` -> `nats-1:6222`; a host with a port stays as it is."""
    if not _NODE.fullmatch(node):
        raise CredentialsError(f"not a node address (HOST or HOST:PORT): {node!r}")
    return node if ":" in node else f"{node}:{ROUTE_PORT}"


def cluster_config(nodes: Sequence[str], password: str) -> str:
    """The `cluster` block's route credential: demanded of every route, and carried by every route to a node."""
    if not re.fullmatch(r"[0-9a-f]{32,}", password):
        raise ValueError("a route password is at least 32 hex digits")
    addresses = [node_address(n) for n in nodes]
    if not addresses or len(set(addresses)) != len(addresses):
        raise CredentialsError(f"the cluster's nodes must be given once each: {list(nodes)}")
    lines = [
        "# Generated by `weir nats credentials` (weir/natsdeploy.py): the cluster's route credential. Secret: never",
        "# commit it. A node demands it of every node that routes to it, and routes to every node with it in the URL",
        "# (nats-server uses the cluster's authorization for discovered routes only; a listed route carries its own).",
        "authorization {",
        f'  user: "{ROUTE_USER}"',
        f'  password: "{password}"',
        "  timeout: 2",
        "}",
        "# every node lists all of them; a route to itself is recognised and dropped",
        "routes: [",
        *(f'  "nats://{ROUTE_USER}:{password}@{address}"' for address in addresses),
        "]",
        "",
    ]
    return "\n".join(lines)


@dataclass(frozen=True)
class ClusterCredential:
    password: str
    nodes: tuple[str, ...]


def read_cluster(path: Path) -> ClusterCredential | None:
    """The route credential an earlier run wrote (None: there is none yet)."""
    if not path.exists():
        return None
    text = path.read_text()
    password = _PASSWORD.search(text)
    nodes = tuple(_ROUTE.findall(text))
    if password is None or not nodes:
        raise CredentialsError(f"{path} is not a route credential this command wrote: delete it to make a new one "
                               "(then restart every node)")
    return ClusterCredential(password[1], nodes)


def outside_publishers(directory: Path) -> list[str]:
    """The seeds no declared identity owns: the outside teams' publisher-like identities."""
    if not directory.is_dir():
        return []
    names: list[str] = []
    for path in sorted(directory.iterdir()):
        if path.name.startswith(".") or not path.name.endswith(SEED_SUFFIX):
            continue  # a seed being written (ensure_seeds' temporary file), or no seed at all
        name = path.name.removesuffix(SEED_SUFFIX)
        if not valid_name(name):
            raise CredentialsError(f"{path}: not a seed of an identity (a name is letters, digits, - and _)")
        if name not in IDENTITIES:
            names.append(name)
    return names


@dataclass(frozen=True)
class Credentials:
    """What `write_credentials` made or kept."""

    out: Path
    seeds: dict[str, Path]
    outside: tuple[str, ...]  # the outside teams' publisher-like identities among the seeds
    nodes: tuple[str, ...]
    changed: tuple[Path, ...]  # the server configuration files this run wrote (new or different)
    teams: dict[str, Team] = field(default_factory=dict)  # every outside team, with its accounts

    @property
    def authorization(self) -> Path:
        return authorization_path(self.out)

    @property
    def cluster(self) -> Path:
        return cluster_path(self.out)

    def reload_hint(self) -> str:
        hosts = " ".join(n.rsplit(":", 1)[0] for n in self.nodes)
        return (f"a running cluster takes the users on reload (nats-server re-reads its configuration on SIGHUP): "
                f"docker compose kill -s HUP {hosts}")

    def report(self) -> list[str]:
        width = max(len(n) for n in self.seeds)
        lines = [f"seeds in {seeds_dir(self.out)} (each Weir container mounts its own as a compose secret; "
                 "secret: never commit them):"]
        for name, path in self.seeds.items():
            note = f"  (an outside team's publisher: {team_scope(self.teams[name])})" if name in self.teams else ""
            lines.append(f"  {name:<{width}}  {path}{note}")
        for path, what in (
            (self.authorization, f"{len(self.seeds)} NKEY users, each with its permissions (shared/identities.py)"),
            (self.cluster, f"the route credential of {', '.join(self.nodes)} (secret)"),
        ):
            lines.append(f"{path}: {'written' if path in self.changed else 'unchanged'}: {what}")
        lines.append("every identity holds the rules of shared/identityrules.py")
        lines += [f"{t.name} has no accounts (made before teams had them): it reads and publishes nothing until "
                  f"`weir nats publisher {t.name} --account ID` gives it its own" for t in self.teams.values()
                  if not t.accounts]
        if self.authorization in self.changed:
            lines.append(self.reload_hint())
        return lines

    def publisher_report(self, name: str, joined: Sequence[str] | None = None) -> list[str]:
        """What the team is and how it connects; then how the servers take it: `joined`, what a running `weir up`
        did to admit it (its nats-server reloaded, its durables made), else what to run (a compose deployment)."""
        team = self.teams[name]
        identity = team.identity()
        durables = ", ".join(f"{d.name} ({d.stream} {' '.join(d.subjects)})" for d in identity.durables)
        reads = ", ".join(s for a in team.accounts for s in public_subjects(a))
        recordings = ", ".join(recording_subjects(name, team.accounts, team.first_party))
        made_by = ("the operator made them now (below)" if joined is not None else "`weir streams apply` makes them "
                   "(compose: the migrate job), and removes those of an account it lost: run it now")
        lines = [
            f"{name}: a publisher-like identity of its own, {team_scope(team)}; nothing else on the bus",
            f"  publishes its recordings on: {recordings}",
            f"  reads live: {reads}, and what encode refused of its events on {rejected_subject(name)}",
            f"  reads through its durables: {durables} (or a direct get of one of its subjects); it binds to them "
            f"and never makes a consumer: {made_by}",
            f"hand over its seed, privately (whoever holds it is {name} on the bus): {self.seeds[name]}",
            f'they connect with: nats.connect(NATS_URL, nkeys_seed="{name}{SEED_SUFFIX}", '
            f'inbox_prefix="{identity.inbox_prefix}")',
        ]
        if joined is not None:
            state = "written" if self.authorization in self.changed else "unchanged"
            lines.append(f"{self.authorization}: {state} (a deployment's servers' users; {teams_path(self.out)} "
                         "keeps its accounts)")
            return lines + list(joined)
        if self.authorization in self.changed:
            lines.append(f"server configuration changed: {self.authorization} (user {name} added or its rights "
                         "changed)")
            lines.append(self.reload_hint())
        else:
            lines.append(f"server configuration unchanged: {self.authorization} already lists {name} with these "
                         "rights")
        return lines


@dataclass(frozen=True)
class StackTeams:
    """The outside teams a `weir up` admits from its teams file: each one listed there whose seed is beside it
    (`seeds/<name>.nk` in the file's folder, as `weir nats publisher --out` keeps them), with its identity; those
    listed without a seed (deleted to revoke it) are not admitted."""

    file: Path
    teams: tuple[Team, ...] = ()
    seeds: dict[str, Path] = field(default_factory=dict)
    unseeded: tuple[str, ...] = ()

    @property
    def identities(self) -> tuple[Identity, ...]:
        return tuple(t.identity() for t in self.teams)

    def summary(self) -> str:
        """One line: which teams are admitted, with their accounts, and which are not."""
        if not self.teams and not self.unseeded:
            found = "no team listed" if self.file.exists() else "no such file yet"
            return f"outside teams: none ({self.file}: {found}; `weir nats publisher` adds one)"
        admitted = "; ".join(f"{t.name} ({team_scope(t)})" for t in self.teams) or "none"
        missing = (f"; listed without a seed, not admitted: {', '.join(self.unseeded)} (no "
                   f"{seeds_dir(self.file.parent)}/<name>{SEED_SUFFIX})") if self.unseeded else ""
        return f"outside teams of {self.file}: {admitted}{missing}"


def stack_teams(teams_file: Path) -> StackTeams:
    """The teams of `teams_file` (none: no file) a stack admits, their seeds checked and their identities held to
    the rules beside the declared ones. Raises CredentialsError (a file this command did not write, a team named as a
    declared identity, a damaged seed, a rule broken)."""
    teams_file = teams_file.absolute()
    listed = read_teams_file(teams_file)
    taken = sorted(n for n in listed if n in IDENTITIES)
    if taken:
        raise CredentialsError(f"{teams_file}: {', '.join(taken)} is a declared identity (shared/identities.py), not "
                               "an outside team")
    folder = seeds_dir(teams_file.parent)
    seeds = {n: folder / f"{n}{SEED_SUFFIX}" for n in sorted(listed) if (folder / f"{n}{SEED_SUFFIX}").is_file()}
    try:
        public_keys(seeds)  # a damaged seed is an error to look at
        teams = tuple(listed[n] for n in seeds)
        identities = [t.identity() for t in teams]
    except (SeedError, ValueError) as exc:
        raise CredentialsError(str(exc)) from None
    problems = violations([*IDENTITIES.values(), *identities])
    if problems:
        raise CredentialsError(f"{teams_file}: the identities break the rules of shared/identityrules.py:\n  "
                               + "\n  ".join(problems))
    return StackTeams(teams_file, teams, seeds, tuple(sorted(set(listed) - set(seeds))))


def _write_in_place(path: Path, text: str, mode: int) -> bool:
    """`text` into `path`, in place: a running container's bind mount of the file keeps seeing it (a rename would leave
    the container the old file). Created with `mode` (no moment readable by others). Returns whether it changed."""
    if path.exists() and path.read_text() == text:
        os.chmod(path, mode)
        return False
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(path, mode)
    return True


def team_scope(team: Team) -> str:
    """What a team serves, in a line: its accounts and its recordings' job classes."""
    kind = "first-party" if team.first_party else "developer jobs only"
    if team.accounts == (EVERY_ACCOUNT,):
        return f"every account ({kind})"
    return f"accounts {', '.join(team.accounts)} ({kind})" if team.accounts else "no accounts: nothing"


def stack_publisher() -> Team:
    """The stack's own `publisher` (shared/identities.py) as a team: every account (`*`), first-party."""
    return Team(PUBLISHER_IDENTITY.name, PUBLISHER_IDENTITY.accounts, PUBLISHER_IDENTITY.first_party)


def write_credentials(out: Path, publishers: Iterable[str | TeamChange] = (),
                      nodes: Sequence[str] | None = None) -> Credentials:
    """Every declared identity's seed, the outside teams' (those already under `out/seeds`, with their accounts
    from `out/teams.json`, and `publishers`: a name, or a change of a team's accounts and flag), the servers' users
    and the route credential; see the module's docstring. Raises CredentialsError, having written nothing, when the
    identities break a rule."""
    changes = [p if isinstance(p, TeamChange) else TeamChange(p) for p in publishers]
    new = list(dict.fromkeys(c.name for c in changes))
    taken = [n for n in new if n in IDENTITIES]
    if taken:
        raise CredentialsError(f"{', '.join(taken)}: a declared identity already (shared/identities.py); an outside "
                               "team gets a name of its own")
    bad = [n for n in new if not valid_name(n)]
    if bad:
        raise CredentialsError(f"not a free identity name: {', '.join(map(repr, bad))}")
    outside = sorted(set(outside_publishers(seeds_dir(out))) | set(new))
    kept = read_teams(out)
    teams = {name: kept.get(name, Team(name)) for name in outside}  # a seed without a record: no accounts
    for change in changes:
        teams[change.name] = changed_team(kept.get(change.name), change)
    try:
        extras = [teams[name].identity() for name in outside]
    except ValueError as exc:
        raise CredentialsError(str(exc)) from None
    chosen: list[Identity] = [*IDENTITIES.values(), *extras]
    problems = violations(chosen)
    if problems:
        raise CredentialsError("the identities break the rules of shared/identityrules.py:\n  " + "\n  ".join(problems))
    existing = read_cluster(cluster_path(out))
    password = existing.password if existing else secrets.token_hex(24)
    addresses = tuple(node_address(n) for n in nodes) if nodes else (existing.nodes if existing else DEFAULT_NODES)
    cluster_text = cluster_config(addresses, password)

    try:
        seeds = ensure_seeds(seeds_dir(out), [i.name for i in chosen])
        for name, path in seeds.items():
            os.chmod(path, CONTAINER_SEED_MODE if name in IDENTITIES else SEED_MODE)
        users = authorization_config(public_keys(seeds), extra=extras)
    except (SeedError, ValueError, KeyError) as exc:
        raise CredentialsError(str(exc)) from None
    generated = out / GENERATED_DIR
    generated.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    os.chmod(generated, DIR_MODE)
    changed = [path for path, text, mode in (
        (teams_path(out), teams_text(teams.values()), TEAMS_MODE),
        (authorization_path(out), users, AUTHORIZATION_MODE),
        (cluster_path(out), cluster_text, CLUSTER_MODE),
    ) if _write_in_place(path, text, mode)]
    return Credentials(out=out, seeds=seeds, outside=tuple(outside), nodes=addresses, changed=tuple(changed),
                       teams=teams)
