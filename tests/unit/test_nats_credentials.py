"""`weir nats credentials` and `weir nats publisher`: the files they make, kept on a rerun, refused when a rule breaks.

The servers' side (a real cluster started on what they write) is tests/integration/test_nats_cluster_credentials.py.
"""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from typer.testing import CliRunner

from shared.identities import IDENTITIES
from shared.natsauth import ensure_seeds, public_key
from weir import natsdeploy
from weir.cli import app
from weir.natsdeploy import (
    CredentialsError,
    Team,
    TeamChange,
    changed_team,
    read_cluster,
    read_teams,
    teams_path,
    write_credentials,
)

ACME = TeamChange("acme", ("acme1",))


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def weir_nats(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["nats", *args])
    return result.exit_code, result.output


def test_every_identity_gets_a_seed_and_the_servers_their_users(tmp_path: Path) -> None:
    made = write_credentials(tmp_path)
    assert list(made.seeds) == list(IDENTITIES)
    assert made.changed == (teams_path(tmp_path), made.authorization, made.cluster)
    users = made.authorization.read_text()
    for name, path in made.seeds.items():
        assert path == tmp_path / "seeds" / f"{name}.nk"
        assert f'nkey: "{public_key(path)}"' in users
    assert "no_auth_user" not in users
    cluster = read_cluster(made.cluster)
    assert cluster is not None and cluster.nodes == natsdeploy.DEFAULT_NODES
    text = made.cluster.read_text()
    assert f'password: "{cluster.password}"' in text
    assert all(f"nats://{natsdeploy.ROUTE_USER}:{cluster.password}@{node}" in text for node in cluster.nodes)


def test_modes_keep_secrets_to_their_owner(tmp_path: Path) -> None:
    made = write_credentials(tmp_path, [ACME])
    assert mode(tmp_path / "seeds") == 0o700 and mode(tmp_path / "generated") == 0o700
    # a container (another uid) reads the seed it mounts; the directory keeps others on the host out
    assert all(mode(made.seeds[name]) == natsdeploy.CONTAINER_SEED_MODE for name in IDENTITIES)
    assert mode(made.seeds["acme"]) == 0o600  # handed over, mounted by no container of ours
    assert mode(made.cluster) == 0o600
    assert mode(made.authorization) == 0o644  # public keys and permissions
    assert mode(teams_path(tmp_path)) == 0o644  # no secret (authorization.conf lists it); the one-shot job reads it


def test_a_rerun_keeps_seeds_password_nodes_and_files(tmp_path: Path) -> None:
    first = write_credentials(tmp_path, nodes=["n1.example", "n2.example:7222"])
    seeds = {name: path.read_bytes() for name, path in first.seeds.items()}
    cluster = read_cluster(first.cluster)
    inode = first.authorization.stat().st_ino
    again = write_credentials(tmp_path)
    assert again.changed == ()
    assert {name: path.read_bytes() for name, path in again.seeds.items()} == seeds
    assert read_cluster(again.cluster) == cluster
    assert again.nodes == ("n1.example:6222", "n2.example:7222")
    # a new user: the users' file changes in place (a running container's bind mount sees it), the route stays
    added = write_credentials(tmp_path, [ACME])
    assert added.changed == (teams_path(tmp_path), added.authorization)
    assert added.authorization.stat().st_ino == inode
    # other nodes: the same password
    moved = write_credentials(tmp_path, nodes=["a", "b", "c"])
    new = read_cluster(moved.cluster)
    assert new is not None and cluster is not None
    assert new.password == cluster.password and new.nodes == ("a:6222", "b:6222", "c:6222")


def test_an_outside_team_stays_with_its_accounts_until_its_seed_is_removed(tmp_path: Path) -> None:
    write_credentials(tmp_path, [TeamChange("acme", ("acme1", "acme2"), first_party=True)])
    later = write_credentials(tmp_path)
    assert later.outside == ("acme",) and later.changed == ()
    assert later.teams == {"acme": Team("acme", ("acme1", "acme2"), True)} == read_teams(tmp_path)
    users = later.authorization.read_text()
    assert f'nkey: "{public_key(later.seeds["acme"])}"' in users
    assert '"recording.completed.acme2.acme.first_party"' in users and '"video.created.acme1"' in users
    # a name alone keeps the accounts and the flag; accounts given replace them; a flag given replaces it
    assert write_credentials(tmp_path, ["acme"]).teams["acme"] == Team("acme", ("acme1", "acme2"), True)
    moved = write_credentials(tmp_path, [TeamChange("acme", ("acme3",), first_party=False)])
    assert moved.teams["acme"] == Team("acme", ("acme3",), False)
    users = moved.authorization.read_text()
    assert '"video.created.acme3"' in users and '"video.created.acme1"' not in users
    assert "first_party" not in users.split("# acme:")[1]
    key = public_key(later.seeds["acme"])
    later.seeds["acme"].unlink()
    revoked = write_credentials(tmp_path)
    assert revoked.outside == () and key not in revoked.authorization.read_text()
    assert read_teams(tmp_path) == {}


def test_a_teams_change_is_decided_purely() -> None:
    with pytest.raises(CredentialsError, match="needs its accounts"):
        changed_team(None, TeamChange("acme"))
    with pytest.raises(CredentialsError, match="not account ids"):
        changed_team(None, TeamChange("acme", ("a1", "a.*")))
    assert changed_team(None, TeamChange("acme", ("a1", "a2", "a1"))) == Team("acme", ("a1", "a2"), False)
    current = Team("acme", ("a1",), True)
    assert changed_team(current, TeamChange("acme")) == current
    assert changed_team(current, TeamChange("acme", ("b1",))) == Team("acme", ("b1",), True)
    assert changed_team(current, TeamChange("acme", None, False)) == Team("acme", ("a1",), False)


def test_a_seed_without_accounts_reads_and_publishes_nothing(tmp_path: Path) -> None:
    """A team made before teams had accounts: its seed is kept, its rights are none but its inbox."""
    (tmp_path / "seeds").mkdir(mode=0o700)
    write_credentials(tmp_path)
    ensure_seeds(tmp_path / "seeds", ["oldteam"])
    made = write_credentials(tmp_path)
    assert made.teams["oldteam"] == Team("oldteam")
    users = made.authorization.read_text().split("# oldteam:")[1].split("\n    # ")[0]  # its user entry
    assert "recording.completed" not in users and "video.created" not in users and "CONSUMER" not in users
    assert any("oldteam has no accounts" in line for line in made.report())


def test_a_teams_file_it_did_not_write_is_refused(tmp_path: Path) -> None:
    tmp_path.mkdir(exist_ok=True)
    teams_path(tmp_path).write_text('{"teams": {"acme": {"accounts": ["*"], "first_party": false}}}')
    with pytest.raises(CredentialsError, match="bad team names or account ids"):
        write_credentials(tmp_path)
    teams_path(tmp_path).write_text("[]")
    with pytest.raises(CredentialsError, match="not a teams file"):
        write_credentials(tmp_path)


@pytest.mark.parametrize(("names", "fragment"), [
    (["auth"], "a declared identity already"),
    (["publisher"], "a declared identity already"),
    (["a.b"], "not a free identity name"),
    (["x" * 65], "not a free identity name"),
])
def test_bad_names_are_refused_and_nothing_is_written(tmp_path: Path, names: list[str], fragment: str) -> None:
    with pytest.raises(CredentialsError, match=fragment):
        write_credentials(tmp_path / "out", names)
    assert not (tmp_path / "out").exists()


def test_identities_that_break_a_rule_are_refused_and_nothing_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[list[str]] = []

    def broken(identities: list[object]) -> list[str]:
        seen.append([getattr(i, "name", "") for i in identities])
        return ["acme may publish ['upload.completed'] (upload.completed): SPEC 7"]

    monkeypatch.setattr(natsdeploy, "violations", broken)
    with pytest.raises(CredentialsError, match=r"upload\.completed"):
        write_credentials(tmp_path / "out", [ACME])
    assert seen == [[*IDENTITIES, "acme"]]  # the rules are checked for every identity it would serve
    assert not (tmp_path / "out").exists()


def test_a_route_credential_it_did_not_write_is_not_replaced(tmp_path: Path) -> None:
    (tmp_path / "generated").mkdir()
    (tmp_path / "generated" / "cluster.conf").write_text("routes: [nats://nats-1:6222]\n")
    with pytest.raises(CredentialsError, match="not a route credential this command wrote"):
        write_credentials(tmp_path)


def test_a_stray_file_in_the_seeds_is_refused(tmp_path: Path) -> None:
    (tmp_path / "seeds").mkdir()
    (tmp_path / "seeds" / "not.an.identity.nk").write_text("x")
    with pytest.raises(CredentialsError, match="not a seed of an identity"):
        write_credentials(tmp_path)


def test_the_commands_print_what_to_hand_over_and_what_changed(tmp_path: Path) -> None:
    code, out = weir_nats("credentials", "--out", str(tmp_path))
    assert code == 0, out
    assert f"{tmp_path / 'seeds' / 'operator.nk'}" in out
    assert f"{tmp_path / 'generated' / 'authorization.conf'}: written" in out
    assert "docker compose kill -s HUP nats-1 nats-2 nats-3" in out
    code, out = weir_nats("publisher", "acme", "--out", str(tmp_path))
    assert code == 1 and "a new team needs its accounts" in out, out
    code, out = weir_nats("publisher", "acme", "--account", "acme1", "--account", "acme2", "--out", str(tmp_path))
    assert code == 0, out
    assert "accounts acme1, acme2 (developer jobs only)" in out
    assert "recording.completed.acme1.acme.developer, recording.completed.acme2.acme.developer" in out
    assert "publisher.acme.rejected" in out and "acme_videos_acme1 (VIDEOS *.*.acme1)" in out
    assert f"hand over its seed, privately (whoever holds it is acme on the bus): {tmp_path / 'seeds' / 'acme.nk'}" \
        in out
    assert 'nats.connect(NATS_URL, nkeys_seed="acme.nk", inbox_prefix="_INBOX.acme")' in out
    assert f"server configuration changed: {tmp_path / 'generated' / 'authorization.conf'} (user acme added" in out
    code, out = weir_nats("publisher", "acme", "--out", str(tmp_path))
    assert code == 0 and "already lists acme" in out and "accounts acme1, acme2" in out, out
    code, out = weir_nats("publisher", "globex", "--account", "g1", "--first-party", "--out", str(tmp_path))
    assert code == 0 and "accounts g1 (first-party)" in out, out
    code, out = weir_nats("credentials", "--out", str(tmp_path))
    assert code == 0 and "globex" in out and "acme" in out, out
    code, out = weir_nats("publishers", "--out", str(tmp_path))
    assert code == 0, out
    assert "publisher: every account, first-party" in out
    assert f"acme: accounts acme1, acme2; developer jobs only; seed {tmp_path / 'seeds' / 'acme.nk'}" in out
    assert "globex: accounts g1; first-party" in out
    code, out = weir_nats("publishers", "--out", str(tmp_path / "mistyped"))
    assert code == 1 and "no directory" in out and "publisher:" not in out, out
    code, out = weir_nats("publisher", "api", "--out", str(tmp_path))
    assert code == 1 and "a declared identity already" in out, out
