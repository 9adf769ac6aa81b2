"""nats-server with JetStream: one server, or one node of a JetStream cluster on 127.0.0.1.

Everything a server is told is in its configuration file (`server.conf`, a cluster node's `node.conf`), never on the
command line: nats-server re-reads the file on SIGHUP, and an option given on the command line is one a reload cannot
keep (`--server_name` made every reload fail: "config reload not supported for ServerName"). The identities' users
are in `weir-identities.conf` beside it, which the file includes; `reload_identities` rewrites it and has a running
server take it (an outside team added to a running `weir up`).
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from shared.devstack.addresses import HOST, ServerName
from shared.devstack.errors import DevStackError
from shared.devstack.processes import POLL_S, binary, pid_alive, references
from shared.devstack.runfiles import log_tail, read_pid_file, write_atomic
from shared.devstack.server import Server, tcp_connects
from shared.identities import Identity
from shared.identityrules import violations
from shared.natsauth import SeedError, authorization_config, public_keys

if TYPE_CHECKING:
    from shared.devstack.stack import DevStack


CLUSTER_NAME = "weir-dev"
SERVER_NAME = "weir-dev"  # the single server's JetStream name (a cluster's nodes: weir-dev-1 ... weir-dev-N)
IDENTITIES_FILE = "weir-identities.conf"
RELOAD_TIMEOUT_S = 15.0


def identities_config(identities: Sequence[Identity], seeds: Mapping[str, Path],
                      unchecked: Collection[Identity] = ()) -> str:
    """The `authorization` block admitting exactly `identities`, each by the public key of its seed file in `seeds`,
    once they keep the rules (shared/identityrules.py; `unchecked`, a test harness's own, are not held to them).
    Raises DevStackError."""
    problems = violations([i for i in identities if i not in unchecked])
    if problems:
        raise DevStackError("the bus identities break their rules: " + "; ".join(problems))
    try:
        return authorization_config(public_keys(seeds), identities={i.name: i for i in identities})
    except (SeedError, ValueError, KeyError) as exc:
        raise DevStackError(f"the bus identities' users cannot be written: {exc}") from None


def _varz(monitor_port: int) -> dict[str, object]:
    with urllib.request.urlopen(f"http://{HOST}:{monitor_port}/varz", timeout=2.0) as response:
        varz: dict[str, object] = json.loads(response.read())
    return varz


def reload_identities(servers_dir: Path, name: ServerName, config: str, *,
                      timeout: float = RELOAD_TIMEOUT_S) -> tuple[int, str]:
    """Have the running nats-server `name` of a stack's data dir (`servers_dir`, DevStack's `data_dir`) admit the
    identities of `config` (`identities_config`): the server's `weir-identities.conf` rewritten (0600), then SIGHUP to
    the pid of its run file (`run/<name>.pid`), only when that process is alive and is this data dir's server; then
    waited for until its monitoring endpoint shows a configuration loaded after the signal. Connections of users it
    keeps stay up. Returns the pid and the server's name as it reports it after the reload. Raises DevStackError
    (nothing signalled when the pid is not the stack's server; a reload refused is told with its log's tail)."""
    servers_dir = servers_dir.absolute()
    pid_file = servers_dir / "run" / f"{name}.pid"
    recorded = read_pid_file(pid_file)
    if recorded is None:
        raise DevStackError(f"{name}: no run file {pid_file}: the stack's nats-server is not running")
    pid, ports = recorded
    if not pid_alive(pid) or not references(pid, servers_dir):
        raise DevStackError(f"{name}: pid {pid} of {pid_file} is not this stack's nats-server (gone?)")
    try:
        exe = Path(os.readlink(f"/proc/{pid}/exe")).name
    except OSError as exc:
        raise DevStackError(f"{name}: pid {pid} cannot be looked at: {exc}") from None
    if not exe.startswith("nats-server"):
        raise DevStackError(f"{name}: pid {pid} of {pid_file} runs {exe}, not nats-server: not signalled")
    if "monitor" not in ports:
        raise DevStackError(f"{name}: {pid_file} names no monitoring port")
    conf = servers_dir / name / IDENTITIES_FILE
    if not conf.exists():
        raise DevStackError(f"{name}: {conf} is missing: this stack's NATS lets anyone in, it admits no identities")
    try:
        before = _varz(ports["monitor"]).get("config_load_time")
    except (OSError, ValueError) as exc:
        raise DevStackError(f"{name}: its monitoring endpoint does not answer ({exc})") from None
    write_atomic(conf, config, mode=0o600)
    os.kill(pid, signal.SIGHUP)
    deadline = time.monotonic() + timeout
    while True:
        try:
            varz = _varz(ports["monitor"])
            if varz.get("config_load_time") != before:
                return pid, str(varz.get("server_name", ""))
        except (OSError, ValueError):
            pass  # reloading: the next look tells
        if time.monotonic() > deadline:
            log = servers_dir / "logs" / f"{name}.log"
            raise DevStackError(f"{name}: nats-server pid {pid} did not take {conf} within {timeout:g} s; "
                                f"{log}:\n{log_tail(log, 5)}")
        time.sleep(POLL_S)


class NatsServer(Server):
    name: ServerName = "nats"
    port_names: tuple[str, ...] = ("client", "monitor")

    @property
    def config_path(self) -> Path:
        """The identities' users (`authorization`), included by the server's configuration."""
        return self.dir / IDENTITIES_FILE

    @property
    def server_config_path(self) -> Path:
        """The server's whole configuration: what nats-server is started with and re-reads on SIGHUP."""
        return self.dir / "server.conf"

    def prepare(self) -> None:
        super().prepare()
        self.write_identities()
        lines = [
            "# Written by shared/devstack/natsserver.py: the embedded server (`weir up`). All of it here, nothing on",
            "# the command line, so that a reload (SIGHUP) keeps every option",
            f'server_name: "{SERVER_NAME}"',
            f"listen: {HOST}:{self.ports['client']}",
            f"http: {HOST}:{self.ports['monitor']}",
            f'jetstream {{ store_dir: "{self.dir}" }}',
        ]
        if self.stack.identities() is not None:
            lines.append(f'include "{self.config_path.name}"')
        write_atomic(self.server_config_path, "\n".join(lines) + "\n", mode=0o600)

    def write_identities(self) -> None:
        """The identities' users (0600), when NATS admits only them; else no such file."""
        identities = self.stack.identities()
        if identities is None:
            self.config_path.unlink(missing_ok=True)
            return
        config = identities_config(identities, self.stack.admitted_seeds(), unchecked=self.stack.harness_identities)
        write_atomic(self.config_path, config, mode=0o600)

    def command(self) -> list[str]:
        return [binary("nats-server"), "-c", str(self.server_config_path)]

    def url(self) -> str:
        return f"nats://{HOST}:{self.ports['client']}"

    def wait_ready(self, deadline: float) -> None:
        def healthy() -> bool:
            health = f"http://{HOST}:{self.ports['monitor']}/healthz?js-enabled-only=true"
            with urllib.request.urlopen(health, timeout=2.0) as response:
                ok = response.status == 200
            return ok and tcp_connects(self.ports["client"])

        self.poll_until(deadline, healthy, "JetStream health")


class NatsNode(NatsServer):
    """One node of a JetStream cluster on 127.0.0.1 (`DevStack(nats_cluster=N)`): its own configuration file with the
    cluster block (routes to every node, each carrying the route credential, which every node demands) and the
    identities' authorization, like deploy/nats/nats.conf; nothing on the command line but the file."""

    port_names = ("client", "monitor", "route")

    def __init__(self, stack: DevStack, index: int) -> None:
        self.name = f"nats-{index}"
        self.index = index
        super().__init__(stack)

    @property
    def node_config_path(self) -> Path:
        return self.dir / "node.conf"

    @property
    def server_config_path(self) -> Path:
        return self.node_config_path

    def prepare(self) -> None:
        Server.prepare(self)
        self.write_identities()  # the identities' authorization block, when NATS admits only them
        from weir.natsdeploy import cluster_config  # the deployment's own route block, on loopback addresses

        routes = [f"{HOST}:{node.ports['route']}" for node in self.stack.nats_nodes()]
        lines = [
            "# Written by shared/devstack/natsserver.py: one node of the embedded cluster (`weir up --nats-cluster N`)",
            f'server_name: "{SERVER_NAME}-{self.index}"',
            f"listen: {HOST}:{self.ports['client']}",
            f"http: {HOST}:{self.ports['monitor']}",
            f'jetstream {{ store_dir: "{self.dir / "jetstream"}" }}',
            "cluster {",
            f"  name: {CLUSTER_NAME}",
            f"  listen: {HOST}:{self.ports['route']}",
            *("  " + line for line in cluster_config(routes, self.stack.route_password()).splitlines() if line),
            "}",
        ]
        if self.stack.identities() is not None:
            lines.append(f'include "{self.config_path.name}"')
        write_atomic(self.node_config_path, "\n".join(lines) + "\n", mode=0o600)

    def wait_ready(self, deadline: float) -> None:
        def healthy() -> bool:
            # the full health check: JetStream enabled and this node current with the cluster's meta leader
            with urllib.request.urlopen(f"http://{HOST}:{self.ports['monitor']}/healthz", timeout=2.0) as response:
                ok = response.status == 200
            return ok and tcp_connects(self.ports["client"])

        self.poll_until(deadline, healthy, "JetStream cluster health")
