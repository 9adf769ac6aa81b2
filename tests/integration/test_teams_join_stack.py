"""Outside teams on a stack started with `weir up` (SPEC 12), on its real nats-server: `weir up` admits the teams of
its teams file when it starts; `weir nats publisher` run against it (WEIR_STACK) has its nats-server admit a new team
at once (identities rewritten, SIGHUP to the pid of its run file) and the operator make the team's durables, so the
team connects with its seed and reads its account's events from its durable straight away; an account auth does not
hold is refused, in one line, changing nothing; nats-server takes a reload (SIGHUP) and keeps its server name.

One `weir up --media 0` for the module (data in a temp dir of its own, stopped by its pid at the end)."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import nats
import pytest
from nats.aio.client import Client as NATS
from nats.errors import TimeoutError as NatsTimeout

from shared.devstack.ports import free_port
from shared.devstack.runfiles import read_pid_file
from tests.faults import stackhelpers
from tests.integration.test_cli import ROOT, clean_env
from weir.natsdeploy import TeamChange, read_teams_file, write_credentials

pytestmark = pytest.mark.timeout(600)
UP_TIMEOUT_S = 300.0  # `weir up` on a loaded 2-core machine: servers, migrations, five services


@pytest.fixture(scope="module")
def root() -> Iterator[Path]:
    with stackhelpers.data_root() as made:
        yield made


@pytest.fixture(scope="module")
def deploy(root: Path) -> Path:
    """The teams' folder (`weir nats publisher --out`): teams.json and seeds/; globex made there before the stack
    starts, as a deployment's operator would (its files only, for an account of its own)."""
    folder = root / "deploy" / "nats"
    write_credentials(folder, [TeamChange("globex", ("globex1",))])
    return folder


@pytest.fixture(scope="module")
def up(root: Path, deploy: Path) -> Iterator[stackhelpers.WeirUp]:
    env = stackhelpers.stack_env(WEIR_NATS_TEAMS_FILE=str(deploy / "teams.json"))
    with stackhelpers.weir_up(root, env, "--media", "0", timeout=UP_TIMEOUT_S) as started:
        yield started


def weir(up: stackhelpers.WeirUp, *args: str, cwd: Path | None = None, **env: str) -> subprocess.CompletedProcess[str]:
    """A `weir` command run as a user beside the stack: from another directory, the stack found by WEIR_STACK."""
    where = cwd or up.data_dir.parent / "elsewhere"
    where.mkdir(exist_ok=True)
    return subprocess.run([sys.executable, "-m", "weir.cli", *args], capture_output=True, text=True, timeout=180,
                          cwd=where, env={**clean_env(), "PYTHONPATH": ROOT, "COLUMNS": "300",
                                          "WEIR_STACK": str(up.stack_json), **env})


def demo_account(up: stackhelpers.WeirUp) -> str:
    return str(json.loads((up.data_dir / "demo.json").read_text())["account_id"])


async def connect_team(up: stackhelpers.WeirUp, name: str, seed: Path) -> NATS:
    """The team's connection, as the command tells it to connect: its seed, its inbox prefix."""
    return await nats.connect(str(up.info["nats_url"]), nkeys_seed=str(seed), inbox_prefix=f"_INBOX.{name}",
                              allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=5)


def varz(up: stackhelpers.WeirUp) -> dict[str, Any]:
    (node,) = up.info["nats_servers"]
    with urllib.request.urlopen(f"{node['monitor']}/varz", timeout=5) as response:
        found: dict[str, Any] = json.loads(response.read())
    return found


def nats_log(up: stackhelpers.WeirUp) -> str:
    return (up.data_dir / "servers" / "logs" / "nats.log").read_text(errors="replace")


def said(result: subprocess.CompletedProcess[str]) -> str:
    return result.stdout + result.stderr


async def test_weir_up_admits_the_teams_of_its_teams_file(up: stackhelpers.WeirUp, deploy: Path) -> None:
    nc = await connect_team(up, "globex", deploy / "seeds" / "globex.nk")
    try:
        info = await nc.jetstream().consumer_info("VIDEOS", "globex_videos_globex1")  # made by `weir up`, as operator
        assert info.config.filter_subject == "*.*.globex1" and not info.config.deliver_subject
    finally:
        await nc.close()


def test_an_account_auth_does_not_hold_is_refused_in_one_line(up: stackhelpers.WeirUp, deploy: Path) -> None:
    teams_before = (deploy / "teams.json").read_text()
    for typo in ("no-such-account", str(uuid.uuid4())):
        result = weir(up, "nats", "publisher", "bob", "--account", typo, "--out", str(deploy))
        assert result.returncode == 1, said(result)
        lines = [line for line in said(result).splitlines() if line.strip()]
        assert len(lines) == 1 and f"no account {typo}" in lines[0] and "Traceback" not in lines[0], lines
    assert (deploy / "teams.json").read_text() == teams_before
    assert not (deploy / "seeds" / "bob.nk").exists()


async def test_a_team_added_to_the_running_stack_reads_its_accounts_events_at_once(
        up: stackhelpers.WeirUp, deploy: Path) -> None:
    account = demo_account(up)
    result = weir(up, "nats", "publisher", "acme", "--account", account, "--out", str(deploy))
    assert result.returncode == 0, said(result)
    seed = deploy / "seeds" / "acme.nk"
    assert stat.S_IMODE(seed.stat().st_mode) == 0o600
    assert seed.read_text().strip() not in said(result)  # the seed's path is printed, never the seed
    assert f"hand over its seed, privately (whoever holds it is acme on the bus): {seed}" in result.stdout
    assert "reloaded" in result.stdout and "server name weir-dev" in result.stdout, result.stdout
    assert f"created consumer VIDEOS/acme_videos_{account}" in result.stdout, result.stdout
    assert f"created consumer ENCODE/acme_encode_{account}" in result.stdout, result.stdout
    assert f"accounts checked: {account}" in result.stdout, result.stdout
    assert "docker compose kill" not in result.stdout  # a running `weir up` took it: nothing left to run
    identities = up.data_dir / "servers" / "nats" / "weir-identities.conf"
    assert stat.S_IMODE(identities.stat().st_mode) == 0o600

    nc = await connect_team(up, "acme", seed)
    try:
        async with httpx.AsyncClient(base_url=up.api_url, timeout=30) as http:
            made = await http.post("/v1/videos", json={"name": "team clip"},
                                   headers={"Authorization": f"Bearer {up.secret_key}"})
        assert made.status_code == 201, made.text
        video_id = made.json()["id"]
        sub = await nc.jetstream().pull_subscribe_bind(durable=f"acme_videos_{account}", stream="VIDEOS")
        seen: list[str] = []
        deadline = time.monotonic() + 60
        while not any(video_id in s for s in seen):
            assert time.monotonic() < deadline, f"no video.created of {video_id} on acme's durable: {seen[-5:]}"
            try:
                msgs = await sub.fetch(20, timeout=2)
            except NatsTimeout:
                continue
            for msg in msgs:
                assert msg.subject.endswith(f".{account}"), msg.subject  # its own account's, nothing else
                seen.append(f"{msg.subject} {msg.data.decode(errors='replace')}")
                await msg.ack()
        assert any(s.startswith(f"video.created.{account} ") and video_id in s for s in seen), seen[-5:]
    finally:
        await nc.close()
    # the team made before the stack started is still let in
    globex = await connect_team(up, "globex", deploy / "seeds" / "globex.nk")
    await globex.close()


async def test_without_out_a_team_joins_the_running_stacks_teams_file(up: stackhelpers.WeirUp, deploy: Path) -> None:
    account = demo_account(up)
    result = weir(up, "nats", "publisher", "initech", "--account", account, "--first-party")
    assert result.returncode == 0, said(result)
    assert "initech" in read_teams_file(deploy / "teams.json")  # the stack's teams file, not ./deploy/nats
    nc = await connect_team(up, "initech", deploy / "seeds" / "initech.nk")
    try:
        info = await nc.jetstream().consumer_info("ENCODE", f"initech_encode_{account}")
        assert info.config.filter_subject == f"encode.*.{account}"
    finally:
        await nc.close()


def test_nats_server_reloads_and_keeps_its_server_name(up: stackhelpers.WeirUp) -> None:
    recorded = read_pid_file(up.data_dir / "servers" / "run" / "nats.pid")
    assert recorded is not None
    pid = recorded[0]
    for _ in range(2):
        before = varz(up)["config_load_time"]
        os.kill(pid, signal.SIGHUP)  # the stack's own nats-server, by the pid of its run file
        deadline = time.monotonic() + 15
        while (now := varz(up))["config_load_time"] == before:
            assert time.monotonic() < deadline, nats_log(up)[-2000:]
            time.sleep(0.1)
        assert now["server_name"] == "weir-dev"
    assert "Failed to reload" not in nats_log(up), nats_log(up)[-2000:]


async def test_a_team_whose_seed_is_deleted_is_let_in_no_more(up: stackhelpers.WeirUp, deploy: Path,
                                                              tmp_path: Path) -> None:
    """Revoking, as the README says (delete its seed, `weir nats credentials` again): the running stack takes it."""
    account = demo_account(up)
    added = weir(up, "nats", "publisher", "hooli", "--account", account, "--out", str(deploy))
    assert added.returncode == 0, said(added)
    seed = deploy / "seeds" / "hooli.nk"
    kept = tmp_path / "hooli.nk"  # what the team still holds
    kept.write_bytes(seed.read_bytes())
    kept.chmod(0o600)
    await (await connect_team(up, "hooli", kept)).close()
    seed.unlink()
    revoked = weir(up, "nats", "credentials", "--out", str(deploy))
    assert revoked.returncode == 0, said(revoked)
    assert f"removed consumer VIDEOS/hooli_videos_{account}" in revoked.stdout, revoked.stdout
    assert "hooli" not in read_teams_file(deploy / "teams.json")
    with pytest.raises(Exception, match=r"(?i)authorization violation"):
        await connect_team(up, "hooli", kept)
    await (await connect_team(up, "globex", deploy / "seeds" / "globex.nk")).close()  # the others stay


def test_no_seed_in_the_stacks_logs(up: stackhelpers.WeirUp, deploy: Path) -> None:
    seeds = [p.read_text().strip() for p in (deploy / "seeds").glob("*.nk")]
    logs = up.log_path.read_text(errors="replace") + "".join(
        p.read_text(errors="replace") for p in (up.data_dir / "servers" / "logs").glob("*.log"))
    assert seeds and not [s for s in seeds if s in logs]


def test_a_database_that_does_not_answer_is_said_and_offline_only_writes_the_files(tmp_path: Path) -> None:
    """No stack to ask (WEIR_DATABASE_URL names a port nothing listens on): one line, exit 1, nothing written;
    --offline writes the files, says the accounts were not checked, and what a deployment runs."""
    env = {**clean_env(), "PYTHONPATH": ROOT, "COLUMNS": "300", "WEIR_STACK": str(tmp_path / "none.json"),
           "WEIR_DATABASE_URL": f"postgresql://weir@127.0.0.1:{free_port()}/weir"}
    args = [sys.executable, "-m", "weir.cli", "nats", "publisher", "acme", "--account", "acme1", "--out", "deploy"]
    refused = subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert refused.returncode == 1, said(refused)
    lines = [line for line in said(refused).splitlines() if line.strip()]
    assert len(lines) == 1 and "PostgreSQL does not answer" in lines[0] and "--offline" in lines[0], lines
    assert not (tmp_path / "deploy").exists()
    offline = subprocess.run([*args, "--offline"], capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert offline.returncode == 0, said(offline)
    assert "accounts not checked (--offline)" in offline.stdout and "docker compose kill -s HUP" in offline.stdout
    assert read_teams_file(tmp_path / "deploy" / "teams.json")["acme"].accounts == ("acme1",)
