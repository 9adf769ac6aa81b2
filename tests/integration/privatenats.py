"""A nats-server of a test's own (stopped, frozen and started again without touching the session's server)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import nats

from shared.devstack.ports import free_port
from tests.waiting import stop_process, wait_for_sync


class PrivateNats:
    """A nats-server of this test's own, so that stopping it leaves the session's server alone."""

    def __init__(self, data_dir: Path, *extra: str) -> None:
        self.port = free_port()
        self.data_dir = data_dir
        self.extra = extra  # more nats-server arguments (a config file, users)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> None:
        binary = Path(sys.executable).parent / "nats-server"
        self.proc = subprocess.Popen(
            [str(binary), "-js", "-a", "127.0.0.1", "-p", str(self.port), "-sd", str(self.data_dir), *self.extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # in case it is frozen
            stop_process(self.proc, 10)

    def freeze(self, frozen: bool) -> None:
        """SIGSTOP: the server keeps its connections but answers nothing; returns once every thread is stopped."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP if frozen else signal.SIGCONT)
        if frozen:  # the signal lands a little after kill() returns
            wait_for_sync(self._all_threads_stopped, 10, "every thread of nats-server stopped", interval=0.001)

    def _all_threads_stopped(self) -> bool:
        assert self.proc is not None
        states = []
        for task in Path(f"/proc/{self.proc.pid}/task").iterdir():
            with contextlib.suppress(OSError):
                states.append((task / "stat").read_text().rpartition(")")[2].split()[0])
        return bool(states) and all(state in ("T", "t") for state in states)


@contextlib.contextmanager
def running_private_nats(prefix: str = "weir-private-nats-") -> Iterator[PrivateNats]:
    """A started PrivateNats in a temporary data directory, stopped (by its own pid) on exit."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        server = PrivateNats(Path(tmp))
        server.start()
        try:
            yield server
        finally:
            server.stop()


async def wait_until_up(url: str, deadline_s: float = 15, **connect: object) -> None:
    """Returns once the server at `url` accepts a connection and its JetStream answers (`connect`: more options for
    nats.connect, e.g. an identity's credentials and TLS)."""
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            nc = await nats.connect(url, allow_reconnect=False, connect_timeout=1, **connect)
            try:
                await nc.jetstream().account_info()
                return
            finally:
                await nc.close()
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)
