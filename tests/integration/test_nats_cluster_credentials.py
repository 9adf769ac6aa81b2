"""A 3-node cluster on deploy/nats/nats.conf as committed and what `weir nats credentials` writes beside it (as
compose.yaml runs it, on local ports): the nodes route to each other only with the route credential, no anonymous
client gets in, `operator` applies the streams (3 replicas), and an outside team given its own identity with
`weir nats publisher` (the servers reloaded with SIGHUP, as the command says) publishes its accounts' recordings and
nothing else."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import nats
import pytest

from tests.integration.apihelpers import free_port
from tests.integration.identityhelpers import connect_as
from tests.waiting import stop_process, wait_for_sync

ROOT = Path(__file__).resolve().parents[2]
NATS_SERVER = Path(sys.executable).parent / "nats-server"

pytestmark = pytest.mark.slow


def weir(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "weir.cli", *args], capture_output=True, text=True, timeout=120,
        env={**os.environ, **(env or {})}, cwd=ROOT,
    )


@dataclass
class Node:
    name: str
    client_port: int
    route_port: int
    http_port: int
    directory: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.client_port}"

    def log(self) -> str:
        path = self.directory / "nats.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/healthz?js-meta-only=true", timeout=2) as r:
                return bool(json.loads(r.read()).get("status") == "ok")
        except OSError:
            return False


@contextlib.contextmanager
def cluster(deploy: Path, nodes: list[Node]) -> Iterator[list[Node]]:
    """Each node on deploy/nats/nats.conf as committed, beside the generated files (as compose mounts them), with its
    own client and monitoring ports on the command line, and its own route port and store in its copy of the file
    (`--cluster` on the command line would drop the cluster's authorization); stopped by pid on exit."""
    committed = (deploy / "nats.conf").read_text()
    assert "store_dir: /data" in committed and "listen: 0.0.0.0:6222" in committed
    try:
        for node in nodes:
            node.directory.mkdir(parents=True)
            (node.directory / "generated").symlink_to(deploy / "generated", target_is_directory=True)
            conf = node.directory / "nats.conf"
            conf.write_text(committed.replace("store_dir: /data", f"store_dir: {node.directory / 'data'}")
                            .replace("listen: 0.0.0.0:6222", f"listen: 127.0.0.1:{node.route_port}"))
            node.proc = subprocess.Popen(
                [str(NATS_SERVER), "-c", str(conf), "-a", "127.0.0.1", "-p", str(node.client_port),
                 "-m", str(node.http_port), "-l", str(node.directory / "nats.log")],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                env={**os.environ, "NATS_SERVER_NAME": node.name},
            )  # fmt: skip
        yield nodes
    finally:
        for node in nodes:
            if node.proc is not None:
                stop_process(node.proc, 10)


def route_answer(port: int, connect: str) -> str:
    """What a node's route port answers a would-be node's CONNECT (nats-server's route protocol)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.settimeout(5)
        assert s.recv(4096).startswith(b"INFO ")
        s.sendall(f"CONNECT {connect}\r\nPING\r\n".encode())
        answer = b""
        with contextlib.suppress(TimeoutError, ConnectionError):
            while b"-ERR" not in answer and len(answer) < 65536:
                chunk = s.recv(4096)
                if not chunk:
                    break
                answer += chunk
        return answer.decode(errors="replace")


async def test_the_deploy_cluster_admits_only_its_nodes_and_identities(tmp_path: Path) -> None:
    deploy = tmp_path / "deploy" / "nats"
    deploy.mkdir(parents=True)
    shutil.copy(ROOT / "deploy" / "nats" / "nats.conf", deploy / "nats.conf")
    nodes = [Node(f"nats-{i}", free_port(), free_port(), free_port(), tmp_path / f"nats-{i}") for i in (1, 2, 3)]
    made = weir("nats", "credentials", "--out", str(deploy),
                *(a for n in nodes for a in ("--node", f"127.0.0.1:{n.route_port}")))
    assert made.returncode == 0, made.stdout + made.stderr
    seeds = deploy / "seeds"

    with cluster(deploy, nodes):
        # the three nodes form one JetStream cluster: every route carried the credential
        try:
            wait_for_sync(lambda: all(n.healthy() for n in nodes), 30, "a JetStream meta leader on every node")
        except AssertionError as e:
            raise AssertionError("\n".join([str(e), *(f"--- {n.name}\n{n.log()[-3000:]}" for n in nodes)])) from None
        # a node without the credential, or with a wrong one, is refused
        for connect in ('{"verbose":false,"name":"intruder","cluster":"weir"}',
                        '{"verbose":false,"name":"intruder","cluster":"weir","user":"weir-route","pass":"guess"}'):
            answer = route_answer(nodes[0].route_port, connect)
            assert "Authorization Violation" in answer, answer
        # no anonymous client
        with pytest.raises(Exception) as refused:
            await nats.connect(nodes[1].url, allow_reconnect=False, connect_timeout=2, max_reconnect_attempts=0)
        assert "authorization violation" in str(refused.value).lower()

        # compose's one-shot job: `operator` applies the streams, each on all three nodes
        env = {"WEIR_NATS_URL": ",".join(n.url for n in nodes), "WEIR_NATS_IDENTITY": "operator",
               "WEIR_NATS_NKEY_SEED": str(seeds / "operator.nk"), "WEIR_STREAM_REPLICAS": "3"}
        applied = weir("streams", "apply", env=env)
        assert applied.returncode == 0, applied.stdout + applied.stderr

        # an outside team gets its own identity; the servers take it on SIGHUP, as the command says
        given = weir("nats", "publisher", "acme", "--account", "acme1", "--out", str(deploy))
        assert given.returncode == 0, given.stdout + given.stderr
        assert str(seeds / "acme.nk") in given.stdout and "docker compose kill -s HUP" in given.stdout
        assert f"127.0.0.1:{nodes[0].route_port}" in (deploy / "generated" / "cluster.conf").read_text()  # kept
        for node in nodes:
            assert node.proc is not None
            node.proc.send_signal(signal.SIGHUP)

        deadline = time.monotonic() + 15
        while True:
            try:
                acme = await connect_as(nodes[2].url, "acme", seeds / "acme.nk")
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)
        try:
            ack = await acme.nc.jetstream().publish("recording.completed.acme1.acme.developer", b"{}", timeout=5)
            assert ack.stream == "RECORDINGS"
            assert await acme.settled() == []
            await acme.nc.subscribe("encode.completed.acme1")  # a public event of its account: allowed
            assert await acme.settled() == []
            await acme.nc.publish("upload.completed", b"{}")  # the api's event: refused
            refusal = await acme.violation("publish", "upload.completed")
            assert "upload.completed" in refusal
            assert len(await acme.settled()) == 1  # that one, and nothing else
        finally:
            await acme.nc.close()
