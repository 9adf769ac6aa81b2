"""`weir nats credentials` and `weir nats publisher`: the files they make, kept on a rerun, refused when a rule breaks.

The servers' side (a real cluster started on what they write) is tests/integration/test_nats_cluster_credentials.py.
"""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from typer.testing import CliRunner

from shared.identities import IDENTITIES
from shared.natsauth import public_key
from weir import natsdeploy
from weir.cli import app
from weir.natsdeploy import CredentialsError, read_cluster, write_credentials


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def weir_nats(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["nats", *args])
    return result.exit_code, result.output


def test_every_identity_gets_a_seed_and_the_servers_their_users(tmp_path: Path) -> None:
    made = write_credentials(tmp_path)
    assert list(made.seeds) == list(IDENTITIES)
    assert made.changed == (made.authorization, made.cluster)
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
    made = write_credentials(tmp_path, ["acme"])
    assert mode(tmp_path / "seeds") == 0o700 and mode(tmp_path / "generated") == 0o700
    # a container (another uid) reads the seed it mounts; the directory keeps others on the host out
    assert all(mode(made.seeds[name]) == natsdeploy.CONTAINER_SEED_MODE for name in IDENTITIES)
    assert mode(made.seeds["acme"]) == 0o600  # handed over, mounted by no container of ours
    assert mode(made.cluster) == 0o600
    assert mode(made.authorization) == 0o644  # public keys and permissions


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
    added = write_credentials(tmp_path, ["acme"])
    assert added.changed == (added.authorization,)
    assert added.authorization.stat().st_ino == inode
    # other nodes: the same password
    moved = write_credentials(tmp_path, nodes=["a", "b", "c"])
    new = read_cluster(moved.cluster)
    assert new is not None and cluster is not None
    assert new.password == cluster.password and new.nodes == ("a:6222", "b:6222", "c:6222")


def test_an_outside_team_stays_until_its_seed_is_removed(tmp_path: Path) -> None:
    write_credentials(tmp_path, ["acme"])
    later = write_credentials(tmp_path)
    assert later.outside == ("acme",)
    assert f'nkey: "{public_key(later.seeds["acme"])}"' in later.authorization.read_text()
    key = public_key(later.seeds["acme"])
    later.seeds["acme"].unlink()
    revoked = write_credentials(tmp_path)
    assert revoked.outside == () and key not in revoked.authorization.read_text()


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
        write_credentials(tmp_path / "out", ["acme"])
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
    assert code == 0, out
    assert f"hand over its seed, privately (whoever holds it is acme on the bus): {tmp_path / 'seeds' / 'acme.nk'}" \
        in out
    assert 'nats.connect(NATS_URL, nkeys_seed="acme.nk", inbox_prefix="_INBOX.acme")' in out
    assert f"server configuration changed: {tmp_path / 'generated' / 'authorization.conf'} (user acme added)" in out
    code, out = weir_nats("publisher", "acme", "--out", str(tmp_path))
    assert code == 0 and "already lists acme" in out, out
    code, out = weir_nats("credentials", "--out", str(tmp_path), "--publisher", "globex")
    assert code == 0 and "globex" in out and "acme" in out, out
    code, out = weir_nats("publisher", "api", "--out", str(tmp_path))
    assert code == 1 and "a declared identity already" in out, out
