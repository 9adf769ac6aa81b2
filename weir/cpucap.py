"""A rollout's new instance starts with its CPU capped: a cgroup of its own with a CPU quota, until it is ready.

On a 2-core machine a new Python process takes about a CPU-second to import and connect. Neither a nice (Linux
shares the CPUs between sessions first: autogroups) nor SCHED_IDLE keeps that from the instances serving: a core
busy with it, whatever its priority, slows the other (bench/RESULTS.md, issue 28). A quota does: the start takes
longer, in bursts of at most a millisecond, and the serving instances barely notice. Needs root and the `cpu`
controller (cgroup v1 or v2); without them `CpuCap.create` says why and the start is only niced.

The cgroup keeps the normal weight, so that only the quota bounds it: with the least weight, a start on a saturated
machine got next to nothing and ran past the ready timeout (bench/RESULTS.md, 2026-12-06).
The rollout also lifts the cap after WEIR_ROLLOUT_START_CAP_SECONDS, whether or not the start reached its gate.

The cap must be off before the instance takes work (an auth at a tenth of a CPU answering its share of auth.check
holds them for seconds): the instance waits at a `StartGate` once connected (shared/runtime.py `pass_start_gate`).
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PERIOD_US = 10_000  # the quota's period: short, so that the capped process runs in bursts of a millisecond or so


class CpuCapUnavailable(Exception):
    """No cgroup with a CPU quota can be made here (the message says why)."""


@dataclass(frozen=True)
class CpuCap:
    path: Path  # the cgroup's directory
    home: Path  # the cgroup its processes go back to (the one `weir up` is in)
    v2: bool

    @classmethod
    def create(cls, name: str, share: float) -> CpuCap:
        """A cgroup `name` whose processes together get at most `share` of one CPU."""
        quota = max(1000, round(share * PERIOD_US))  # the kernel's least quota is 1 ms
        v1_mount = CGROUP_ROOT / "cpu"
        if (v1_mount / "cpu.cfs_quota_us").exists():
            home = v1_mount / _own_path(lambda controllers: "cpu" in controllers.split(","))
            cap = cls(home / name, home, v2=False)
            settings = {"cpu.cfs_period_us": str(PERIOD_US), "cpu.cfs_quota_us": str(quota), "cpu.shares": "1024"}
        elif "cpu" in _read(CGROUP_ROOT / "cgroup.controllers").split():
            # v2 lets a cgroup with processes have no controlled children: the cap is a child of the root
            if "cpu" not in _read(CGROUP_ROOT / "cgroup.subtree_control").split():
                _write(CGROUP_ROOT / "cgroup.subtree_control", "+cpu")
            cap = cls(CGROUP_ROOT / name, CGROUP_ROOT / _own_path(lambda controllers: controllers == ""), v2=True)
            settings = {"cpu.max": f"{quota} {PERIOD_US}", "cpu.weight": "100"}
        else:
            raise CpuCapUnavailable(f"no cgroup `cpu` controller under {CGROUP_ROOT}")
        try:
            cap.path.mkdir(exist_ok=True)
            for file, value in settings.items():
                _write(cap.path / file, value)
        except OSError as exc:
            cap.remove()
            raise CpuCapUnavailable(f"cannot make {cap.path}: {exc.strerror or exc}") from exc
        return cap

    def join(self) -> None:
        """The calling process into the cap (a child's preexec_fn: what it starts afterwards is in it too)."""
        _write(self.path / "cgroup.procs", str(os.getpid()))

    def members(self) -> list[int]:
        with contextlib.suppress(OSError):
            return [int(p) for p in _read(self.path / "cgroup.procs").split()]
        return []

    def release(self) -> None:
        """Every process in the cap back to `home` (their threads with them), and the cap removed."""
        for _ in range(20):  # a process forked meanwhile lands in the cap: move until none is left
            pids = self.members()
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(OSError):  # it exited meanwhile
                    _write(self.home / "cgroup.procs", str(pid))
        self.remove()

    def remove(self) -> None:
        for _ in range(50):  # rmdir fails while the kernel still counts an exited member
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.02)


def _own_path(matches: Callable[[str], bool]) -> str:
    """This process's cgroup (relative) in the hierarchy whose /proc/self/cgroup controllers field `matches`."""
    for line in _read(Path("/proc/self/cgroup")).splitlines():
        _, controllers, path = line.split(":", 2)
        if matches(controllers):
            return path.lstrip("/")
    raise CpuCapUnavailable("this process's cgroup is not in /proc/self/cgroup")


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _write(path: Path, value: str) -> None:
    with open(path, "w") as f:  # one write(2): cgroup files take a value per write
        f.write(value)


class StartGate:
    """A Unix socket the new instance connects to once started and before it takes work; the rollout lifts the cap
    and lets it through with a byte (shared/runtime.py `pass_start_gate`, WEIR_START_GATE)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.unlink(missing_ok=True)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen(1)
        self.passed = False

    def arrived(self, within: float) -> socket.socket | None:
        """The instance's connection when it reaches the gate within `within` seconds."""
        if not select.select([self.sock], [], [], within)[0]:
            return None
        conn, _ = self.sock.accept()
        return conn

    def let_through(self, conn: socket.socket) -> None:
        with contextlib.suppress(OSError), conn:  # an instance that died meanwhile: its probe says so
            conn.sendall(b"1")
        self.passed = True

    def close(self) -> None:
        self.sock.close()
        self.path.unlink(missing_ok=True)
