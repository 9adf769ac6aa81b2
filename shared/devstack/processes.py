"""The servers' processes: spawned from one long-lived thread so they die with their parent, found again by
/proc when a killed owner left them behind, and stopped by pid."""

from __future__ import annotations

import contextlib
import ctypes
import os
import pwd
import shutil
import signal
import subprocess
import sysconfig
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from shared.devstack.errors import DevStackError

POLL_S = 0.05  # between looks at a process or a server that is still starting or stopping
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


def spawn(
    args: list[str],
    *,
    log_path: Path,
    cwd: Path,
    env: dict[str, str],
    death_signal: int,
    user: pwd.struct_passwd | None = None,
) -> subprocess.Popen[bytes]:
    def start() -> subprocess.Popen[bytes]:
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

    return _spawner.submit(start).result()


def proc_state(pid: int, tid: int | None = None) -> str | None:
    """The state letter of a process (or of one of its threads)."""
    try:
        text = Path(f"/proc/{pid}" + (f"/task/{tid}" if tid is not None else "") + "/stat").read_text()
    except OSError:
        return None
    return text.rpartition(")")[2].split()[0]  # the field after the command name, which may hold spaces


def pid_alive(pid: int) -> bool:
    """True if the process exists and is not a zombie (an orphan's zombie may linger if init does not reap). A
    multi-threaded server's main thread shows as a zombie while its other threads still exit and hold its files
    (its listening ports): it lives until every thread is gone."""
    state = proc_state(pid)
    if state is None:
        return False
    if state not in ("Z", "X"):
        return True
    try:
        threads = [int(t.name) for t in Path(f"/proc/{pid}/task").iterdir() if t.name != str(pid)]
    except OSError:
        return False
    return any(proc_state(pid, t) not in (None, "Z", "X") for t in threads)


def references(pid: int, path: Path) -> bool:
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


def pids_inside(path: Path, exe: Path) -> list[int]:
    """Live processes of the program `exe` that run inside `path` or name it."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            pid = int(entry.name)
            with contextlib.suppress(OSError):
                if Path(os.readlink(f"/proc/{pid}/exe")) == exe and pid_alive(pid) and references(pid, path):
                    pids.append(pid)
    return pids


def wait_gone(pids: list[int], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while any(pid_alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(POLL_S)
    return True


def terminate(pids: list[int], sig: int, timeout: float) -> None:
    """Stop processes that are not our children: `sig`, then SIGKILL after `timeout`."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
    if not wait_gone(pids, timeout):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        wait_gone(pids, 10.0)


def binary(name: str) -> str:
    candidate = Path(sysconfig.get_path("scripts")) / name
    if candidate.exists():
        return str(candidate)
    found = shutil.which(name)
    if found is None:
        raise DevStackError(f"{name} not found (is the project's venv installed?)")
    return found
