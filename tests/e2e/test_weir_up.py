"""`weir up` as a user runs it: everything starts and answers, Ctrl-C/SIGTERM leaves nothing, kill -9 recovers."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import nats
import pytest
from nats import errors as nats_errors

from shared.authcheck import CheckReply, CheckRequest
from shared.authclient import check
from shared.devstack.ports import free_port
from shared.devstack.processes import pid_alive
from shared.identities import IDENTITIES


def _described(pid: int) -> str:
    """A process as /proc shows it: its pid, state and command line (for a failure's message)."""
    try:
        state = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("State"))
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except (OSError, StopIteration):
        return f"pid {pid} (gone)"
    return f"pid {pid}, {state}, {command[:200]}"


def _server_pids(data_dir: Path) -> list[int]:
    pids = []
    for f in (data_dir / "servers" / "run").glob("*.pid"):
        first = f.read_text().split()[0] if f.read_text().strip() else ""
        if first.isdigit():
            pids.append(int(first))
    return pids


PORT_TAKEN = "Address already in use"
UP_ATTEMPTS = 3  # a port taken between its choice and the api's bind (another worker's server): chosen again


def _start_up(data_dir: Path, env: dict[str, str], *args: str
              ) -> tuple[subprocess.Popen[bytes], dict[str, object], float]:
    """`weir up` until it wrote stack.json. The api's port is chosen here and bound by the api some seconds later,
    after the servers start; a server of the other test worker may take it in between (each process keeps its own
    claims: shared/devstack/ports.py), so a start that failed on that port alone is made again on another."""
    for attempt in range(1, UP_ATTEMPTS + 1):
        try:
            return _start_up_once(data_dir, env, *args)
        except PortTaken:
            if attempt == UP_ATTEMPTS:
                raise
    raise AssertionError("unreachable")


class PortTaken(AssertionError):
    pass


def _start_up_once(data_dir: Path, env: dict[str, str], *args: str
                   ) -> tuple[subprocess.Popen[bytes], dict[str, object], float]:
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "weir.cli", "up", "--data-dir", str(data_dir), "--api-port", str(free_port()),
         *args],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )
    stack_json = data_dir / "stack.json"
    deadline = time.monotonic() + 120
    while not stack_json.exists():
        if proc.poll() is not None:
            out = proc.communicate()[0].decode()
            raise (PortTaken if PORT_TAKEN in out else AssertionError)(out[-4000:])
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("weir up did not write stack.json in time: " + proc.communicate()[0].decode()[-4000:])
        time.sleep(0.1)
    return proc, json.loads(stack_json.read_text()), time.monotonic() - t0


async def _check(nats_url: str, operator_seed: str, secret_key: str) -> CheckReply:
    nc = await nats.connect(nats_url, nkeys_seed=operator_seed, inbox_prefix="_INBOX.operator")
    try:
        return await check(nc, CheckRequest(authorization=f"Bearer {secret_key}", peer="127.0.0.1",
                                            route_class="secret", route="GET /v1/videos"))
    finally:
        await nc.close()


def _all_ready(info: dict[str, object]) -> None:
    services = info["services"]
    assert isinstance(services, dict)
    assert set(services) >= {"auth", "api", "encode", "sweep", "media-1"}
    for url in services.values():
        r = httpx.get(f"{url}/readyz", timeout=5)
        assert r.status_code == 200, r.text
    assert httpx.get(f"{info['api_url']}/healthz", timeout=5).json()["service"] == "api"


@pytest.fixture
def data_root() -> Iterator[Path]:
    """Not pytest's tmp_path: a pytest session started elsewhere resets /tmp/pytest-of-<user> to 0700 at any time,
    and PostgreSQL runs as its own user, which must be able to reach its data directory."""
    with tempfile.TemporaryDirectory(prefix="weir-up-") as tmp:
        yield Path(tmp)


@pytest.mark.slow
async def _anonymous(nats_url: str) -> None:
    nc = await nats.connect(nats_url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2)
    await nc.close()


def test_weir_up_starts_everything_and_sigterm_leaves_nothing(data_root: Path) -> None:
    env = {**os.environ, "WEIR_LIMIT_KEY_PER_MINUTE": "5", "PYTHONUNBUFFERED": "1"}
    data_dir = data_root / "weir"
    proc, info, took = _start_up(data_dir, env)
    try:
        _all_ready(info)
        for key in ("api_url", "nats_url", "database_url", "s3_endpoint", "s3_bucket", "internal_token", "demo"):
            assert key in info
        pids = [int(p) for p in info["pids"].values()] + _server_pids(data_dir)  # type: ignore[attr-defined]
        assert len(pids) >= 8 and all(pid_alive(p) for p in pids)
        # SeaweedFS is told its allowed origins rather than left to its default (browser uploads: issue 14)
        s3_pid = int((data_dir / "servers" / "run" / "s3.pid").read_text().split()[0])
        assert "-s3.allowedOrigins=*" in Path(f"/proc/{s3_pid}/cmdline").read_bytes().decode().split("\0")
        # a setting given to `weir up` reaches the service that reads it
        auth_url = info["services"]["auth"]  # type: ignore[index]
        internal = {"X-Weir-Internal-Token": str(info["internal_token"])}
        assert httpx.get(f"{auth_url}/settings", headers=internal).json()["WEIR_LIMIT_KEY_PER_MINUTE"] == 5
        for name, url in info["services"].items():  # type: ignore[attr-defined]
            # operators only, on every service: no token or a wrong one is 401, and secrets show as set/unset
            assert httpx.get(f"{url}/settings").status_code == 401, name
            wrong = {"X-Weir-Internal-Token": "x" + str(info["internal_token"])}
            assert httpx.get(f"{url}/settings", headers=wrong).status_code == 401, name
            shown = httpx.get(f"{url}/settings", headers=internal)
            assert shown.status_code == 200 and shown.json()["WEIR_INTERNAL_TOKEN"] == "(set)", name
            assert str(info["internal_token"]) not in shown.text, name
        # the demo keys it provisioned are live
        # every identity has its seed, readable by the owner alone; NATS lets no one in without one
        seeds: dict[str, str] = info["nats_identities"]  # type: ignore[assignment]
        assert set(seeds) == set(IDENTITIES)
        for name, seed in seeds.items():
            assert Path(seed) == data_dir / "nats" / f"{name}.nk"
            assert stat.S_IMODE(Path(seed).stat().st_mode) == 0o600, name
        with pytest.raises((nats_errors.Error, OSError)):
            asyncio.run(_anonymous(str(info["nats_url"])))
        reply = asyncio.run(_check(str(info["nats_url"]), seeds["operator"],
                                   info["demo"]["secret_key"]))  # type: ignore[index]
        assert reply.allowed and reply.identity is not None
        assert reply.identity.app_id == info["demo"]["app_id"]  # type: ignore[index]
        print(f"weir up ready in {took:.1f} s")
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=90)
    assert proc.returncode == 0, out.decode()[-4000:]
    assert "prepare | set CORS rules of bucket weir" in out.decode(), out.decode()[-4000:]
    assert not [p for p in pids if pid_alive(p)], "processes left behind"
    assert not (data_dir / "stack.json").exists()


@pytest.mark.slow
def test_weir_up_recovers_after_kill_9(data_root: Path) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    data_dir = data_root / "weir"
    proc, info, _ = _start_up(data_dir, env)
    services = {n: int(p) for n, p in info["pids"].items() if n != "weir"}  # type: ignore[attr-defined]
    proc.kill()  # kill -9: no clean-up runs
    proc.wait()
    deadline = time.monotonic() + 30
    while [p for p in services.values() if pid_alive(p)] and time.monotonic() < deadline:
        time.sleep(0.1)
    left = {name: _described(pid) for name, pid in services.items() if pid_alive(pid)}
    assert not left, f"services outlived a killed weir up by 30 s: {left}"
    (data_dir / "stack.json").unlink(missing_ok=True)

    proc2, info2, _ = _start_up(data_dir, env)
    try:
        _all_ready(info2)
        pids = [int(p) for p in info2["pids"].values()] + _server_pids(data_dir)  # type: ignore[attr-defined]
    finally:
        proc2.send_signal(signal.SIGTERM)
        out, _ = proc2.communicate(timeout=90)
    assert proc2.returncode == 0, out.decode()[-4000:]
    assert not [p for p in pids if pid_alive(p)]


def _pid_of(data_dir: Path, name: str) -> int:
    return int(json.loads((data_dir / "stack.json").read_text())["pids"][name])


def test_weir_up_starts_a_dead_service_again_and_gives_up_on_one_that_keeps_dying(data_root: Path) -> None:
    quick_s, most, backoff_ms = 120, 3, 100
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "WEIR_SUPERVISE_QUICK_SECONDS": str(quick_s),
           "WEIR_SUPERVISE_MAX_QUICK_DEATHS": str(most), "WEIR_SUPERVISE_BACKOFF_MS": str(backoff_ms)}
    data_dir = data_root / "weir"
    proc, info, _ = _start_up(data_dir, env)
    sweep = str(info["services"]["sweep"])  # type: ignore[index]
    try:
        for death in range(1, most + 1):  # each within quick_s of its start: a quick death
            pid = _pid_of(data_dir, "sweep")
            os.kill(pid, signal.SIGKILL)
            if death == most:
                break
            deadline = time.monotonic() + 30  # the backoff is at most backoff_ms * 2 ** most, far below this
            while _pid_of(data_dir, "sweep") == pid:
                assert time.monotonic() < deadline, "sweep was not started again"
                time.sleep(0.05)
            if death == 1:  # started again on the same address, and it serves
                deadline = time.monotonic() + 30
                while True:
                    try:
                        if httpx.get(f"{sweep}/readyz", timeout=2).status_code == 200:
                            break
                    except httpx.HTTPError:
                        pass
                    assert time.monotonic() < deadline, "the restarted sweep did not become ready"
                    time.sleep(0.1)
        time.sleep(backoff_ms * 2 ** most / 1000 + 1)  # longer than any restart would have waited
        assert not pid_alive(_pid_of(data_dir, "sweep")), "given up on, it stays down"
        for name, url in info["services"].items():  # type: ignore[attr-defined]
            if name != "sweep":  # the rest of the stack goes on
                assert httpx.get(f"{url}/readyz", timeout=5).status_code == 200, name
    finally:
        proc.send_signal(signal.SIGTERM)
        out_bytes, _ = proc.communicate(timeout=90)
    out = out_bytes.decode()
    assert proc.returncode == 0, out[-4000:]
    assert "sweep exited with -9; starting it again in" in out, out[-4000:]
    assert out.count("sweep started again (pid") == most - 1, out[-4000:]
    assert f"sweep exited with -9: it died {most} times in a row" in out and "not restarting it" in out, out[-4000:]


async def _stream_replicas(info: dict[str, object]) -> tuple[int, list[str]]:
    seeds: dict[str, str] = info["nats_identities"]  # type: ignore[assignment]
    nc = await nats.connect(str(info["nats_url"]).split(","), nkeys_seed=seeds["operator"],
                            inbox_prefix="_INBOX.operator")
    try:
        stream = await nc.jetstream().stream_info("VIDEOS")
        assert stream.cluster is not None
        peers = [stream.cluster.leader or "", *(p.name for p in stream.cluster.replicas or [])]
        return stream.config.num_replicas or 1, peers
    finally:
        await nc.close()


@pytest.mark.slow
def test_weir_up_runs_a_three_node_cluster_with_streams_at_three_replicas(data_root: Path) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    data_dir = data_root / "weir"
    proc, info, _ = _start_up(data_dir, env, "--nats-cluster", "3")
    try:
        _all_ready(info)
        nodes: list[dict[str, object]] = info["nats_servers"]  # type: ignore[assignment]
        assert [n["name"] for n in nodes] == ["nats-1", "nats-2", "nats-3"]
        assert all(pid_alive(int(str(n["pid"]))) for n in nodes)
        assert str(info["nats_url"]).split(",") == [n["url"] for n in nodes]  # every service is given all three
        replicas, peers = asyncio.run(_stream_replicas(info))
        assert replicas == 3 and sorted(peers) == ["weir-dev-1", "weir-dev-2", "weir-dev-3"]
        with pytest.raises((nats_errors.Error, OSError)):  # no anonymous client on any node
            asyncio.run(_anonymous(str(nodes[1]["url"])))
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=90)
    assert proc.returncode == 0, out.decode()[-4000:]
    assert not [n for n in nodes if pid_alive(int(str(n["pid"])))]


@pytest.mark.slow
def test_weir_up_external_uses_the_given_servers(tmp_path: Path, stack_env: dict[str, str]) -> None:
    env = {**os.environ, **stack_env, "PYTHONUNBUFFERED": "1"}
    data_dir = tmp_path / "weir"
    proc = subprocess.Popen(
        [sys.executable, "-m", "weir.cli", "up", "--external", "--data-dir", str(data_dir),
         "--api-port", str(free_port())],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not (data_dir / "stack.json").exists():
            assert proc.poll() is None, proc.communicate()[0].decode()[-4000:]
            assert time.monotonic() < deadline, "weir up --external did not become ready"
            time.sleep(0.1)
        info = json.loads((data_dir / "stack.json").read_text())
        _all_ready(info)
        assert info["nats_url"] == stack_env["WEIR_NATS_URL"]
        # the given seeds' directory (WEIR_NATS_NKEY_SEED_DIR): every service connected as itself from it
        assert set(info["nats_identities"]) == set(IDENTITIES)
        assert info["database_url"] == stack_env["WEIR_DATABASE_URL"]
        assert not (data_dir / "servers").exists()  # no embedded server was started
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out.decode()[-4000:]
