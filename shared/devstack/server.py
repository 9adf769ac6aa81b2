"""One embedded server's lifecycle (recover a killed run's leftovers, choose ports, launch, poll until ready,
stop); each server (NATS, PostgreSQL, SeaweedFS) supplies its command and its readiness check."""

from __future__ import annotations

import contextlib
import os
import pwd
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from shared.devstack.addresses import HOST, ServerName
from shared.devstack.errors import DevStackError, StartAbandoned
from shared.devstack.ports import claim_port, port_is_free
from shared.devstack.processes import POLL_S, pid_alive, references, spawn, terminate
from shared.devstack.runfiles import log_tail, read_pid_file, write_atomic

PORTS_FREE_WAIT_S = 5.0  # how long a restart waits for a killed run's ports before it takes others

if TYPE_CHECKING:
    from shared.devstack.stack import DevStack


class Server:
    """A child process with named ports, a pid file and a log; subclasses say how to start it and when it is ready."""

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
            if pid_alive(pid) and references(pid, self.stack.data_dir):
                self.stack.say(f"{self.name}: stopping pid {pid} left by a previous run")
                terminate([pid], self.stop_signal, self.stop_timeout_s)
            self.pid_path.unlink(missing_ok=True)
            # a killed server's ports come free a moment after its process is gone (its last threads close them)
            deadline = time.monotonic() + PORTS_FREE_WAIT_S
            while not all(map(port_is_free, ports.values())) and time.monotonic() < deadline:
                time.sleep(POLL_S)
        self.clean_stale()
        return ports

    def choose_ports(self, previous: dict[str, int]) -> None:
        self.ports = {name: claim_port(previous.get(name)) for name in self.port_names}

    def launch(self) -> None:
        self.proc = spawn(
            self.command(),
            log_path=self.log_path,
            cwd=self.dir,
            env=self.env(),
            death_signal=self.stop_signal,
            user=self.user(),
        )
        lines = [str(self.proc.pid), *(f"{k}={v}" for k, v in self.ports.items())]
        write_atomic(self.pid_path, "\n".join(lines) + "\n")

    def check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise DevStackError(
                f"{self.name} exited with {self.proc.returncode} while starting; "
                f"{self.log_path}:\n{log_tail(self.log_path)}"
            )

    def poll_until(self, deadline: float, attempt: Callable[[], bool], what: str) -> None:
        delay = POLL_S
        last_error = ""
        while True:
            self.check_alive()
            if self.stack.aborting.is_set():
                raise StartAbandoned(f"{self.name}: start abandoned")
            try:
                if attempt():
                    return
            except Exception as e:  # a server that is still starting fails in many ways
                last_error = f"{type(e).__name__}: {e}"
            if time.monotonic() > deadline:
                raise DevStackError(
                    f"{self.name} not ready ({what}) in time; last error: {last_error}; "
                    f"{self.log_path}:\n{log_tail(self.log_path)}"
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


def tcp_connects(port: int) -> bool:
    with socket.create_connection((HOST, port), timeout=1.0):
        return True
