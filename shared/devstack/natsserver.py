"""nats-server with JetStream: one server, or one node of a JetStream cluster on 127.0.0.1."""

from __future__ import annotations

import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING

from shared.devstack.addresses import HOST, ServerName
from shared.devstack.errors import DevStackError
from shared.devstack.processes import binary
from shared.devstack.runfiles import write_atomic
from shared.devstack.server import Server, tcp_connects
from shared.identityrules import violations
from shared.natsauth import authorization_config, public_keys

if TYPE_CHECKING:
    from shared.devstack.stack import DevStack


CLUSTER_NAME = "weir-dev"


class NatsServer(Server):
    name: ServerName = "nats"
    port_names: tuple[str, ...] = ("client", "monitor")

    @property
    def config_path(self) -> Path:
        return self.dir / "weir-identities.conf"

    def prepare(self) -> None:
        super().prepare()
        identities = self.stack.identities()
        if identities is None:
            self.config_path.unlink(missing_ok=True)
            return
        problems = violations([i for i in identities if i not in self.stack.harness_identities])
        if problems:
            raise DevStackError("the bus identities break their rules: " + "; ".join(problems))
        seeds = self.stack.nats_seeds()
        config = authorization_config(public_keys(seeds), identities={i.name: i for i in identities})
        write_atomic(self.config_path, config, mode=0o600)

    def command(self) -> list[str]:
        config = ["-c", str(self.config_path)] if self.stack.identities() is not None else []
        return [
            binary("nats-server"),
            *config,
            "-js",
            "-a", HOST,
            "-p", str(self.ports["client"]),
            "-m", str(self.ports["monitor"]),
            "-sd", str(self.dir),
            "--server_name", "weir-dev",
        ]  # fmt: skip

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

    def prepare(self) -> None:
        super().prepare()  # the identities' authorization block, when NATS admits only them
        from weir.natsdeploy import cluster_config  # the deployment's own route block, on loopback addresses

        routes = [f"{HOST}:{node.ports['route']}" for node in self.stack.nats_nodes()]
        lines = [
            "# Written by shared/devstack/natsserver.py: one node of the embedded cluster (`weir up --nats-cluster N`)",
            f'server_name: "weir-dev-{self.index}"',
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

    def command(self) -> list[str]:
        return [binary("nats-server"), "-c", str(self.node_config_path)]

    def wait_ready(self, deadline: float) -> None:
        def healthy() -> bool:
            # the full health check: JetStream enabled and this node current with the cluster's meta leader
            with urllib.request.urlopen(f"http://{HOST}:{self.ports['monitor']}/healthz", timeout=2.0) as response:
                ok = response.status == 200
            return ok and tcp_connects(self.ports["client"])

        self.poll_until(deadline, healthy, "JetStream cluster health")
