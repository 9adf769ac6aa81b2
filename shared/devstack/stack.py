"""The stack: NATS (JetStream), PostgreSQL and SeaweedFS S3 started side by side in one data directory, which it
owns by an flock so that a killed owner's leftovers may be cleaned up and a live owner's may not."""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from functools import partial
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from shared.devstack.addresses import HOST, S3_REGION, ServerName, StackAddresses
from shared.devstack.errors import DevStackError, StartAbandoned
from shared.devstack.natsserver import NatsNode, NatsServer
from shared.devstack.ports import release_ports
from shared.devstack.postgres import Postgres
from shared.devstack.runfiles import write_atomic
from shared.devstack.seaweed import S3_ALLOWED_ORIGINS, SeaweedS3
from shared.devstack.server import Server
from shared.identities import IDENTITIES, Identity
from shared.natsauth import ensure_seeds

READY_TIMEOUT_S = 90.0


class DevStack:
    """NATS (JetStream), PostgreSQL and SeaweedFS S3 as child processes, with their data in `data_dir`."""

    def __init__(
        self,
        data_dir: Path,
        *,
        s3_bucket: str = "weir",
        s3_access_key: str = "weir",
        s3_secret_key: str = "weir-secret-key",
        s3_allowed_origins: Sequence[str] = S3_ALLOWED_ORIGINS,
        durable: bool = True,
        log: Callable[[str], None] | None = None,
        nats_identities_dir: Path | None = None,
        extra_identities: Sequence[Identity] = (),
        extra_seeds: Mapping[str, Path] | None = None,
        harness_identities: Sequence[Identity] = (),
        nats_cluster: int = 1,
    ) -> None:
        """`nats_identities_dir`: NATS admits only the declared identities (shared/identities.py, plus
        `extra_identities`, e.g. an outside team's publisher), each with its NKEY seed kept there (made once, then
        reused), after checking they keep the rules; None lets anyone in. `extra_seeds`: the seed files of extra
        identities kept elsewhere (an outside team's, which `weir nats publisher` made beside its teams file): read
        for their public keys, never made. `harness_identities` are admitted without the rules: a test suite's own
        clients, which play every party. `nats_cluster` > 1 runs that many NATS nodes as one JetStream cluster
        (`nats-1` ... `nats-N`), routes authenticated, every client URL in `nats_url`."""
        if nats_cluster < 1:
            raise DevStackError("nats_cluster: at least one node")
        self.nats_cluster = nats_cluster
        self.nats_identities_dir = Path(nats_identities_dir).absolute() if nats_identities_dir else None
        self.extra_identities = tuple(extra_identities)
        self.extra_seeds = {name: Path(path).absolute() for name, path in (extra_seeds or {}).items()}
        strays = sorted(set(self.extra_seeds) - {i.name for i in self.extra_identities})
        if strays:
            raise DevStackError(f"extra_seeds of no extra identity: {', '.join(strays)}")
        self.harness_identities = tuple(harness_identities)
        self.data_dir = Path(data_dir).absolute()
        self.s3_bucket = s3_bucket
        self.s3_access_key = s3_access_key
        self.s3_secret_key = s3_secret_key
        self.s3_allowed_origins = tuple(s3_allowed_origins)
        self.durable = durable
        self._log = log
        self.timings: dict[str, float] = {}
        self.saved_ports: dict[str, dict[str, int]] = {}
        self._servers: dict[ServerName, Server] | None = None
        self._owner_lock: IO[str] | None = None
        self._started = False
        self._ports_lock = threading.Lock()
        self._seeds_lock = threading.Lock()
        self.aborting = threading.Event()  # set when one server failed to start: the others stop waiting

    # public API

    def identities(self) -> list[Identity] | None:
        """The identities NATS admits (None: anyone)."""
        if self.nats_identities_dir is None:
            return None
        return [*IDENTITIES.values(), *self.extra_identities, *self.harness_identities]

    def nats_seeds(self) -> dict[str, Path]:
        """Each identity's seed file in `nats_identities_dir` (made if missing): every identity's but those whose
        seed is kept elsewhere (`extra_seeds`); {} when NATS lets anyone in."""
        identities = self.identities()
        if identities is None or self.nats_identities_dir is None:
            return {}
        with self._seeds_lock:  # a cluster's nodes prepare side by side
            return ensure_seeds(self.nats_identities_dir,
                                [i.name for i in identities if i.name not in self.extra_seeds])

    def admitted_seeds(self) -> dict[str, Path]:
        """The seed file of every identity NATS admits: `nats_seeds` and `extra_seeds`; {} when it lets anyone in."""
        if self.identities() is None:
            return {}
        return {**self.nats_seeds(), **self.extra_seeds}

    def server_names(self) -> tuple[ServerName, ...]:
        nats = ("nats",) if self.nats_cluster == 1 else tuple(f"nats-{i}" for i in range(1, self.nats_cluster + 1))
        return (*nats, "postgres", "s3")

    def nats_nodes(self) -> list[NatsServer]:
        """The NATS server, or each node of the cluster."""
        return [s for s in (self._servers or {}).values() if isinstance(s, NatsServer)]

    def nats_servers(self) -> list[dict[str, Any]]:
        """Each NATS node's name, client URL, monitoring URL and pid (None when stopped)."""
        return [{"name": n.name, "url": n.url(), "monitor": f"http://{HOST}:{n.ports['monitor']}",
                 "pid": n.proc.pid if n.proc is not None and n.proc.poll() is None else None}
                for n in self.nats_nodes()]

    def route_password(self) -> str:
        """The cluster's route credential, made once per data dir (0600) and reused."""
        path = self.data_dir / "run" / "nats-route.secret"
        with self._ports_lock:
            if not path.exists():
                write_atomic(path, secrets.token_hex(24) + "\n", mode=0o600)
            return path.read_text().strip()

    @property
    def addresses(self) -> StackAddresses:
        if not self._started or self._servers is None:
            raise DevStackError("the stack is not started")
        s = self._servers
        return StackAddresses(
            nats_url=",".join(n.url() for n in self.nats_nodes()),
            database_url=s["postgres"].url(),
            s3_endpoint=s["s3"].url(),
            s3_bucket=self.s3_bucket,
            s3_access_key=self.s3_access_key,
            s3_secret_key=self.s3_secret_key,
            s3_region=S3_REGION,
            nats_identities={name: str(path) for name, path in self.nats_seeds().items()},
        )

    @property
    def pids(self) -> dict[ServerName, int]:
        """The pid of each running server process."""
        servers = self._servers or {}
        return {n: s.proc.pid for n, s in servers.items() if s.proc is not None and s.proc.poll() is None}

    @property
    def ports(self) -> dict[ServerName, dict[str, int]]:
        """Every port each server listens on, by name."""
        return {n: dict(s.ports) for n, s in (self._servers or {}).items()}

    def start(self) -> StackAddresses:
        """Start the three servers side by side and return once each really answers."""
        if self._started:
            raise DevStackError("the stack is already started")
        for sub in ("logs", "run"):
            (self.data_dir / sub).mkdir(parents=True, exist_ok=True)
        self._take_ownership()
        self.saved_ports = self._read_saved_ports()
        nats: list[Server] = [NatsServer(self)] if self.nats_cluster == 1 else [
            NatsNode(self, i) for i in range(1, self.nats_cluster + 1)]
        self._servers = {**{n.name: n for n in nats}, "postgres": Postgres(self), "s3": SeaweedS3(self)}
        try:
            if self.nats_cluster > 1:  # every node's configuration names every node's route port: chosen first
                for node in nats:
                    node.choose_ports(node.recover())
                self._save_ports()
            self._in_parallel([partial(self._bring_up, name, fresh=True) for name in self.server_names()])
        except BaseException:
            self._stop_servers(self.server_names())
            for server in self._servers.values():
                release_ports(server.ports)
            self._release_ownership()
            raise
        self._started = True
        return self.addresses

    def stop(self) -> None:
        """Stop every server this stack started, by pid, and wait for each to exit. Idempotent."""
        if self._servers is not None:
            self._stop_servers(self.server_names())
            for server in self._servers.values():
                release_ports(server.ports)
        self._started = False
        self._release_ownership()

    def stop_server(self, name: ServerName) -> None:
        """Stop one server (to simulate an outage); `start_server` brings it back on the same port."""
        self._server(name).stop()
        self.say(f"{name}: stopped")

    def start_server(self, name: ServerName) -> None:
        """Start a server stopped by `stop_server` again, on the same ports with the same data."""
        server = self._server(name)
        if server.proc is not None and server.proc.poll() is None:
            return
        self._in_parallel([partial(self._bring_up, name, fresh=False)])

    def __enter__(self) -> DevStack:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # internals

    def say(self, line: str) -> None:
        if self._log is not None:
            self._log(line)

    def _server(self, name: ServerName) -> Server:
        if not self._started or self._servers is None:
            raise DevStackError("the stack is not started")
        return self._servers[name]

    def _bring_up(self, name: ServerName, *, fresh: bool) -> None:
        assert self._servers is not None
        server = self._servers[name]
        t0 = time.monotonic()
        if fresh and not isinstance(server, NatsNode):  # a cluster's nodes have theirs already (start)
            server.choose_ports(server.recover())
            self._save_ports()
        server.prepare()
        server.launch()
        server.wait_ready(time.monotonic() + READY_TIMEOUT_S)
        self.timings[name] = time.monotonic() - t0
        assert server.proc is not None
        self.say(f"{name}: ready at {server.url()} in {self.timings[name]:.1f} s (pid {server.proc.pid}, "
                 f"log {server.log_path})")  # fmt: skip

    def _stop_servers(self, names: tuple[ServerName, ...]) -> None:
        if self._servers is not None:
            servers = self._servers
            self._in_parallel([servers[name].stop for name in names])

    def _in_parallel(self, tasks: list[Callable[[], None]]) -> None:
        """Run the tasks on worker threads (which also keeps asyncio.run clear of a caller's running loop)."""
        self.aborting.clear()
        with ThreadPoolExecutor(max_workers=len(tasks), thread_name_prefix="devstack") as pool:
            futures = [pool.submit(task) for task in tasks]
            try:
                wait(futures, return_when=FIRST_EXCEPTION)
            finally:
                if any(f.done() and f.exception() for f in futures) or not all(f.done() for f in futures):
                    self.aborting.set()
        errors = sorted(
            (e for f in futures if (e := f.exception()) is not None), key=lambda e: isinstance(e, StartAbandoned)
        )
        if errors:
            raise errors[0]

    def _read_saved_ports(self) -> dict[str, dict[str, int]]:
        try:
            saved = json.loads((self.data_dir / "run" / "ports.json").read_text())
            return {str(n): {str(k): int(v) for k, v in p.items()} for n, p in saved.items()}
        except (OSError, ValueError, AttributeError):
            return {}

    def _save_ports(self) -> None:
        # kept across clean stops (unlike the pid files) so that addresses stay put from one run to the next
        with self._ports_lock:
            ports: dict[str, dict[str, int]] = dict(self.saved_ports)
            ports.update((n, p) for n, p in self.ports.items() if p)
            self.saved_ports = ports
            write_atomic(self.data_dir / "run" / "ports.json", json.dumps(ports, indent=2) + "\n")

    def _take_ownership(self) -> None:
        # An flock, released by the kernel when its holder dies: a killed owner's leftovers may be cleaned up,
        # a live owner's servers may not.
        lock = (self.data_dir / "run" / "devstack.lock").open("a+")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            owner = lock.read().strip() or "?"
            lock.close()
            raise DevStackError(f"{self.data_dir} is in use by another running stack (pid {owner})") from None
        lock.seek(0)
        lock.truncate()
        lock.write(f"{os.getpid()}\n")
        lock.flush()
        self._owner_lock = lock

    def _release_ownership(self) -> None:
        if self._owner_lock is not None:
            self._owner_lock.close()  # closing the file releases the flock
            self._owner_lock = None
