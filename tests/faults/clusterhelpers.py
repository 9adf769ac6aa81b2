"""What the fault tests share: a stack of their own on a 3-node JetStream cluster, killing and restarting a node,
the leader of a stream, a probe publisher, and the figures the lead collects (.weir/test-artifacts/faults.jsonl).

No tests here (pytest collects this module and finds none).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from shared.bus import HDR_MSG_ID, connect
from shared.devstack.addresses import StackAddresses
from shared.devstack.natsserver import CLUSTER_NAME
from shared.devstack.processes import pid_alive
from shared.devstack.stack import DevStack
from shared.events import Envelope, VideoCreated, new_event
from shared.settings import CommonSettings
from tests.conftest import HARNESS
from tests.integration.apihelpers import TRUSTED
from tests.integration.authhelpers import TEST_SECRETS
from tests.stored import stored_messages
from tests.waiting import wait_for, wait_for_sync
from weir.up import prepare

CLUSTER_NODES = 3
ARTIFACTS = Path(__file__).resolve().parents[2] / ".weir" / "test-artifacts"
FIGURES = ARTIFACTS / "faults.jsonl"


def record_figure(test: str, figure: str, value: float) -> None:
    """One measured figure: printed (`pytest -s` shows it) and appended as a JSON line for the lead's p50/max."""
    print(f"\n[figure] {test}: {figure} = {value:.3f}", flush=True)
    FIGURES.parent.mkdir(parents=True, exist_ok=True)
    with FIGURES.open("a") as out:
        out.write(json.dumps({"test": test, "figure": figure, "value": round(value, 4)}) + "\n")


async def quiet(exc: Exception) -> None:
    """A connection's error callback that says nothing: a node killed on purpose makes nats-py print tracebacks."""


def node_of(server_name: str) -> str:
    """The devstack's node name (`nats-2`) of a JetStream server name (`weir-dev-2`)."""
    prefix = f"{CLUSTER_NAME}-"
    if not server_name.startswith(prefix):
        raise ValueError(f"not a node of the embedded cluster: {server_name!r}")
    return f"nats-{server_name.removeprefix(prefix)}"


@dataclass
class ClusterStack:
    """A test module's own servers: NATS as a 3-node JetStream cluster (streams at 3 replicas), PostgreSQL, S3."""

    dev: DevStack
    addresses: StackAddresses
    settings: CommonSettings  # the harness's: may publish and read anything
    env: dict[str, str]  # what a service process needs (stack_env's variables, the secrets, 3 replicas)
    logs: Path
    kills: list[str] = field(default_factory=list)

    def node(self, name: str) -> dict[str, Any]:
        return next(n for n in self.dev.nats_servers() if n["name"] == name)

    def clients_of(self, name: str) -> list[str]:
        """The names of the client connections a node serves now (its monitoring endpoint's /connz)."""
        with urllib.request.urlopen(f"{self.node(name)['monitor']}/connz?limit=1024", timeout=5) as r:
            connections = json.loads(r.read()).get("connections") or []
        return sorted(str(c.get("name") or "?") for c in connections)

    def kill9(self, name: str) -> float:
        """kill -9 of one node (the machine is gone): returns the monotonic time of the signal, once it is dead."""
        pid = self.node(name)["pid"]
        assert pid is not None, f"{name} is not running"
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        wait_for_sync(lambda: not pid_alive(pid), 10, f"{name} (pid {pid}) to die", interval=0.01)
        self.kills.append(name)
        return killed_at

    async def restart(self, name: str) -> float:
        """Start a node again on its ports and data; returns once it is healthy (current with the cluster), in s."""
        t0 = time.monotonic()
        await asyncio.to_thread(self.dev.start_server, name)
        return time.monotonic() - t0

    def log_tail(self, name: str, lines: int = 40) -> str:
        path = self.dev.data_dir / "logs" / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


@contextlib.contextmanager
def cluster_stack(prefix: str) -> Iterator[ClusterStack]:
    """The servers in a temp dir (not pytest's tmp_path: PostgreSQL runs as its own user, which must reach its data
    directory, and a pytest session started elsewhere may reset /tmp/pytest-of-<user> to 0700), streams applied at
    3 replicas, every service migrated, the bucket made; stopped and removed at the end."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        root = Path(tmp)
        dev = DevStack(root / "servers", durable=False, nats_identities_dir=root / "nats",
                       nats_cluster=CLUSTER_NODES, harness_identities=(HARNESS,))
        try:
            addresses = dev.start()
            seeds = str(Path(next(iter(addresses.nats_identities.values()))).parent)
            env = {
                "WEIR_NATS_NKEY_SEED_DIR": seeds,
                "WEIR_NATS_URL": addresses.nats_url,  # every node's client URL, comma-separated
                "WEIR_DATABASE_URL": addresses.database_url,
                "WEIR_S3_ENDPOINT": addresses.s3_endpoint,
                "WEIR_S3_BUCKET": addresses.s3_bucket,
                "WEIR_S3_ACCESS_KEY": addresses.s3_access_key,
                "WEIR_S3_SECRET_KEY": addresses.s3_secret_key,
                "WEIR_S3_REGION": addresses.s3_region,
                "WEIR_STREAM_REPLICAS": str(CLUSTER_NODES),
                "WEIR_TRUSTED_PROXIES": TRUSTED,
                **{f"WEIR_{k.upper()}": v for k, v in TEST_SECRETS.items()},
            }
            settings = CommonSettings(
                nats_nkey_seed_dir=seeds, nats_identity=HARNESS.name, nats_url=addresses.nats_url,
                database_url=addresses.database_url, s3_endpoint=addresses.s3_endpoint,
                s3_bucket=addresses.s3_bucket, s3_access_key=addresses.s3_access_key,
                s3_secret_key=addresses.s3_secret_key,
                s3_region=addresses.s3_region, stream_replicas=CLUSTER_NODES,
            )
            # on a thread of its own: asyncio.run must not touch the event loop of the test session
            with ThreadPoolExecutor(1) as one:
                one.submit(asyncio.run, prepare(settings)).result()
            logs = root / "service-logs"
            logs.mkdir()
            yield ClusterStack(dev, addresses, settings, env, logs)
        finally:
            dev.stop()


# ------------------------------------------------------------------------------------------------- streams


async def _stream_cluster(js: JetStreamContext, stream: str) -> Any:
    """The stream's cluster info, or the error the stream API answered with (right after a node died it may)."""
    try:
        return (await js.stream_info(stream)).cluster
    except Exception as exc:  # no leader: the stream API answers with an error or not at all
        return exc


def _has_leader(cluster: Any) -> bool:
    return not isinstance(cluster, Exception) and cluster is not None and bool(cluster.leader)


async def stream_leader(js: JetStreamContext, stream: str, timeout: float = 30.0) -> str:
    """The node (`nats-N`) that leads the stream, once it has a leader (right after a node died it may have none)."""
    cluster = await wait_for(lambda: _stream_cluster(js, stream), timeout, f"a leader of stream {stream}",
                             interval=0.1, until=_has_leader)
    return node_of(cluster.leader)


async def wait_stream_whole(js: JetStreamContext, stream: str, timeout: float) -> str:
    """Wait until the stream has a leader and every other replica is current; returns the leader's node."""

    def whole(cluster: Any) -> bool:
        replicas = (cluster.replicas or []) if _has_leader(cluster) else []
        return len(replicas) == CLUSTER_NODES - 1 and all(r.current and not r.offline for r in replicas)

    cluster = await wait_for(lambda: _stream_cluster(js, stream), timeout,
                             f"stream {stream} whole (a leader and {CLUSTER_NODES - 1} current replicas)",
                             interval=0.1, until=whole)
    return node_of(cluster.leader)


async def stream_events(js: JetStreamContext, stream: str, subject: str) -> list[tuple[Envelope, datetime]]:
    """Every message of one subject in the stream, copies included, with the time the stream stored it."""
    msgs = await stored_messages(js, stream, subject, fetch_timeout=10)
    return [(Envelope.from_bytes(m.data), _stored_at(m.metadata.timestamp)) for m in msgs]


def _stored_at(timestamp: Any) -> datetime:
    if isinstance(timestamp, datetime):
        return timestamp if timestamp.tzinfo else timestamp.replace(tzinfo=UTC)
    return datetime.fromisoformat(str(timestamp).replace("Z", "+00:00"))


# --------------------------------------------------------------------------------------------- the probe


class PublishProbe:
    """Publishes, as the api would, a `video.created` of a made-up video into VIDEOS every `interval` s (no service
    consumes that type), each publish on its own task with its own timeout, so one that hangs on a dead leader does
    not hold back the next; records when each was sent and when its PubAck came."""

    def __init__(self, settings: CommonSettings, interval: float = 0.05, timeout: float = 1.0) -> None:
        self.settings = settings
        self.interval = interval
        self.timeout = timeout
        self.acked: list[tuple[float, float]] = []  # (sent, acked), monotonic
        self.failures = 0
        self._nc: NATS | None = None
        self._task: asyncio.Task[None] | None = None
        self._inflight: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> PublishProbe:
        self._nc = await connect(self.settings, name="probe", error_cb=quiet)
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await asyncio.gather(*self._inflight, return_exceptions=True)
        if self._nc is not None:
            await self._nc.close()

    def first_ack_after(self, moment: float) -> float | None:
        """Seconds from `moment` to the first PubAck of a publish sent after it (None: none yet)."""
        acks = [acked for sent, acked in self.acked if sent >= moment]
        return min(acks) - moment if acks else None

    async def _run(self) -> None:
        while True:
            task = asyncio.create_task(self._publish_one())
            self._inflight.add(task)
            task.add_done_callback(self._inflight.discard)
            await asyncio.sleep(self.interval)

    async def _publish_one(self) -> None:
        assert self._nc is not None
        video_id = str(uuid.uuid4())
        event = new_event(VideoCreated(video_id=video_id, app_id=str(uuid.uuid4()), account_id=str(uuid.uuid4())),
                          source="fault-probe", subject=video_id)
        sent = time.monotonic()
        try:
            await self._nc.jetstream().publish(event.type, event.to_bytes(), stream="VIDEOS", timeout=self.timeout,
                                               headers={HDR_MSG_ID: event.id})
        except Exception:
            self.failures += 1
            return
        self.acked.append((sent, time.monotonic()))


# ------------------------------------------------------------------------------------------------ services


def connection_trouble(logs: dict[str, Path]) -> dict[str, int]:
    """How many times each service process logged trouble with its NATS connection (`NATS (<identity>): ...`, its
    connection's error callback): those that were connected to the node that died."""
    return {name: sum(" NATS (" in line for line in path.read_text(errors="replace").splitlines())
            for name, path in logs.items()}


# ------------------------------------------------------------------------------------------------ waiting


# ------------------------------------------------------------------------------------------------ database


async def fetch(database_url: str, sql: str, *args: Any) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(database_url)
    try:
        return list(await conn.fetch(sql, *args))
    finally:
        await conn.close()
