"""`weir rollout SERVICE` / `--all`: a running `weir up` replaces a service's instances one at a time (SPEC 11).

For each instance in turn: start the new one (the code on disk now, the same environment and port), wait until it
says ready (its own /readyz, through its own socket: the port is shared, SO_REUSEPORT), then SIGTERM the old one and
wait for it to drain and exit; from then on `weir up` tends the new one. A new instance that is not ready in time is
stopped, the old one keeps serving, and the rollout stops there with a non-zero exit.

`weir up` does the work (it supervises the processes and would otherwise start the old one again): it listens on a
control socket (stack.json's `control_socket`) for one JSON request a connection, answered by JSON lines of progress
and a last line with the outcome. This module holds both ends.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import socketserver
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from weir.cpucap import CpuCap, CpuCapUnavailable, StartGate

if TYPE_CHECKING:
    from weir.up import ServiceProcess, Supervisor

MIGRATE_REQ = Path("/proc/sys/net/ipv4/tcp_migrate_req")


class RolloutSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="WEIR_ROLLOUT_", extra="ignore", frozen=True)

    ready_timeout_seconds: float = Field(60.0, gt=0, description="how long a new instance gets to say ready before "
                                         "it is stopped and the old one kept")
    drain_timeout_seconds: float = Field(60.0, gt=0, description="how long an old instance gets to drain and exit "
                                         "after SIGTERM before it is killed (its own limits: WEIR_HTTP_DRAIN_SECONDS, "
                                         "WEIR_SHUTDOWN_GRACE_SECONDS, WEIR_MEDIA_DRAIN_SECONDS)")
    stop_timeout_seconds: float = Field(30.0, gt=0, description="how long a new instance that never got ready gets "
                                        "to exit after SIGTERM before it is killed")
    start_nice: int = Field(10, ge=0, le=19, description="a new instance starts this much nicer (lower CPU "
                            "priority) and is set back once ready, so that the instances serving keep their "
                            "latency while it imports and connects; only where `weir up` may raise a priority "
                            "again (root), else 0")
    start_idle: bool = Field(False, description="a new instance also starts under SCHED_IDLE (it gets a CPU only "
                             "when nothing else wants it) and is set back to the normal policy once ready; only "
                             "where `weir up` may set it back (root). Off: on a busy machine it makes the start "
                             "several times longer (a saturated one may starve it past the ready timeout)")
    start_cpu_share: float = Field(0.1, ge=0, description="a new instance starts with its CPU capped at this share "
                                   "of one CPU (a cgroup quota, weir/cpucap.py) until ready, so that its imports "
                                   "and connections do not slow the instances serving; 0: not capped; only as root "
                                   "with the cgroup `cpu` controller, else niced only")
    start_cap_seconds: float = Field(30.0, gt=0, description="the longest a new instance's start stays CPU-capped: "
                                     "a start not at its gate by then (a saturated machine) finishes at full speed "
                                     "rather than run into the ready timeout")
    probe_interval_seconds: float = Field(0.2, gt=0, description="between two readiness probes of a new instance")
    probe_timeout_seconds: float = Field(2.0, gt=0, description="one readiness probe's longest wait")
    migrate_requests: bool = Field(True, description="set net.ipv4.tcp_migrate_req=1 (Linux 5.14+, root) so that "
                                   "connections queued on a listener that closes go to the instance beside instead "
                                   "of being reset")


def service_of(instance: str) -> str:
    """`media-2` -> `media` (workers are numbered); any other name is its service's."""
    return instance.rpartition("-")[0] if instance.startswith("media-") else instance


class RolloutFailed(Exception):
    """The rollout stopped: the message says which instance and why, and what still serves."""


Say = Callable[[str], None]


# ------------------------------------------------------------------------------------------- in `weir up`


def replace_instance(sup: Supervisor, sp: ServiceProcess, settings: RolloutSettings, say: Say,
                     env: dict[str, str] | None = None) -> None:
    """Start sp's successor (with `env` on top of the instance's environment, kept from then on), wait until it is
    ready, swap it in, drain the old one. Raises RolloutFailed (the old one still in place and serving) when the new
    one does not get ready."""
    from weir.up import instance_ready

    generation = sp.generation + 1
    own = sup.own_socket(sp.name, generation)
    extra_env = {**sp.extra_env, **(env or {})}
    privileged = os.geteuid() == 0  # unprivileged, the priority could not come back
    nice = settings.start_nice if privileged else 0
    idle = settings.start_idle and privileged
    cap = _cpu_cap(f"weir-start-{sp.name}-{generation}-{os.getpid()}", settings, say) if privileged else None
    # the gate: where the instance waits, started, for the cap to come off before it takes work (without one, or
    # for a release that knows no gate, the cap comes off once it is ready)
    gate = StartGate(Path(own).with_suffix(".gate")) if cap is not None and own else None
    gate_env = {"WEIR_START_GATE": str(gate.path)} if gate is not None else {}
    with sup.lock:
        if sup.stopping.is_set():
            if cap is not None:
                cap.remove()
            if gate is not None:
                gate.close()
            raise RolloutFailed(f"{sp.name}: `weir up` is stopping; nothing was started")
        proc, pump = sup.spawn(sp.name, sp.module, sp.port, {**extra_env, **gate_env}, own, nice=nice, idle=idle,
                               cap=cap)
        sup.starting.add(proc)

    def full_speed() -> None:
        if cap is not None:
            cap.release()
        if nice or idle:
            normal_priority(proc.pid)

    try:
        capped = f", its CPU capped at {settings.start_cpu_share:g} of one until then" if cap else ""
        say(f"{sp.name}: started pid {proc.pid} beside pid {sp.proc.pid}; waiting for it to be ready "
            f"(at most {settings.ready_timeout_seconds:g} s){capped}")
        t0 = time.monotonic()
        problem = ""
        uncapped = False
        while not instance_ready(sp.url, own, settings.probe_timeout_seconds):
            if proc.poll() is not None:
                problem = f"exited with {proc.returncode} before it was ready"
            elif time.monotonic() - t0 > settings.ready_timeout_seconds:
                problem = (f"was not ready after {settings.ready_timeout_seconds:g} s "
                           "(WEIR_ROLLOUT_READY_TIMEOUT_SECONDS)")
            if problem:
                _stop(proc, settings.stop_timeout_seconds)
                pump.join(timeout=1)
                said = sup.said_last(proc.pid)
                raise RolloutFailed(f"{sp.name}: the new instance (pid {proc.pid}) {problem}; it is stopped and the "
                                    f"old one (pid {sp.proc.pid}) keeps serving"
                                    + (f". Its last words: {said}" if said else ""))
            if cap is not None and not uncapped and time.monotonic() - t0 > settings.start_cap_seconds:
                full_speed()
                uncapped = True
                say(f"{sp.name}: pid {proc.pid} not at its gate after {settings.start_cap_seconds:g} s "
                    "(WEIR_ROLLOUT_START_CAP_SECONDS): its CPU no longer capped, it finishes its start at full speed")
            if gate is not None and not gate.passed:
                if (conn := gate.arrived(settings.probe_interval_seconds)) is not None:
                    full_speed()
                    uncapped = True
                    gate.let_through(conn)
                    say(f"{sp.name}: pid {proc.pid} started after {time.monotonic() - t0:.1f} s: its CPU no longer "
                        "capped, it takes work")
            else:
                time.sleep(settings.probe_interval_seconds)
        full_speed()
        with sup.lock:  # from here `weir up` tends the new one, and no longer sees the old one
            old, old_pump = sp.proc, sp.pump
            sp.proc, sp.pump, sp.own_socket, sp.generation, sp.extra_env = proc, pump, own, generation, extra_env
            sp.started_at, sp.quick_deaths, sp.restart_at, sp.given_up = time.monotonic(), 0, None, False
    finally:
        if cap is not None:  # released already once ready; here when it was not (stopped, or an error)
            cap.release()
        if gate is not None:
            gate.close()
        with sup.lock:
            sup.starting.discard(proc)
    ready_s = time.monotonic() - t0
    say(f"{sp.name}: pid {proc.pid} ready after {ready_s:.1f} s; draining pid {old.pid}")
    t1 = time.monotonic()
    if not _stop(old, settings.drain_timeout_seconds):
        say(f"{sp.name}: pid {old.pid} did not exit within {settings.drain_timeout_seconds:g} s of SIGTERM "
            f"(WEIR_ROLLOUT_DRAIN_TIMEOUT_SECONDS): killed")
    old_pump.join(timeout=1)
    sup.last_words.pop(old.pid, None)
    say(f"{sp.name}: pid {old.pid} exited ({old.returncode}) after {time.monotonic() - t1:.1f} s of draining")


def _cpu_cap(name: str, settings: RolloutSettings, say: Say) -> CpuCap | None:
    if settings.start_cpu_share <= 0:
        return None
    try:
        return CpuCap.create(name, settings.start_cpu_share)
    except CpuCapUnavailable as exc:
        say(f"the new instance's CPU is not capped ({exc}): it starts niced only")
        return None


def autogroup_nice(pid: int | str) -> int | None:
    """The nice of the CPU autogroup `pid` runs in (one per session: `weir up` starts each service in its own), or
    None without autogroups (kernel.sched_autogroup_enabled=0, or no /proc)."""
    try:
        return int(Path(f"/proc/{pid}/autogroup").read_text().split()[-1])
    except (OSError, ValueError, IndexError):
        return None


def set_autogroup_nice(pid: int | str, nice: int) -> None:
    """With autogroups on (Linux's default), the scheduler shares the CPUs between sessions first and a thread's own
    nice only counts within its session: a service in a session of its own is deprioritised only by its
    autogroup's nice (sched(7)). Nothing to do without autogroups."""
    if autogroup_nice(pid) is None:
        return
    with contextlib.suppress(OSError):  # raising it needs no privilege; lowering below 0 does
        Path(f"/proc/{pid}/autogroup").write_text(str(nice))


def normal_priority(pgid: int) -> None:
    """Every thread of every process in the group (the instance's own session: ffmpeg's too) back to the normal
    policy at the nice of `weir up` (which the instances it started first have). Policy and nice are per thread on
    Linux; a thread started meanwhile by one not yet set back inherits the old ones, hence the passes until one
    finds nothing to change."""
    nice = os.getpriority(os.PRIO_PROCESS, 0)
    set_autogroup_nice(pgid, 0)  # its session's share of the CPUs, as a new session gets (the others' sessions)
    for _ in range(5):
        changed = False
        for pid in (int(name) for name in os.listdir("/proc") if name.isdigit()):
            with contextlib.suppress(OSError):  # the process or thread ended meanwhile
                if os.getpgid(pid) != pgid:
                    continue
                for tid in (int(name) for name in os.listdir(f"/proc/{pid}/task")):
                    with contextlib.suppress(OSError):
                        if os.sched_getscheduler(tid) != os.SCHED_OTHER:
                            os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
                            changed = True
                        if os.getpriority(os.PRIO_PROCESS, tid) != nice:
                            os.setpriority(os.PRIO_PROCESS, tid, nice)
                            changed = True
        if not changed:
            return


def _stop(proc: subprocess.Popen[bytes], within: float) -> bool:
    """SIGTERM, then SIGKILL after `within` s; False when it had to be killed."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(within)
        return True
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return False


def roll_out(sup: Supervisor, services: Sequence[str], settings: RolloutSettings, say: Say,
             env: dict[str, str] | None = None) -> None:
    """Every instance of each service in turn; raises RolloutFailed at the first that fails (the rest untouched)."""
    for service in services:
        instances = sup.instances(service)
        if not instances:
            known = sorted({service_of(sp.name) for sp in sup.procs})
            raise RolloutFailed(f"no service {service!r} in this stack (it runs {', '.join(known)})")
        t0 = time.monotonic()
        for sp in instances:
            replace_instance(sup, sp, settings, say, env)
        say(f"{service}: rolled out ({len(instances)} instance(s)) in {time.monotonic() - t0:.1f} s")


class ControlServer:
    """`weir up`'s control socket: requests handled one at a time, each answered with its progress, all on one
    thread that lives as long as `weir up`: a process started from a thread gets its parent-death signal when that
    thread ends (PR_SET_PDEATHSIG is per thread), so a thread per request would stop every new instance it made."""

    def __init__(self, path: Path, sup: Supervisor, log: Say) -> None:
        self.path = path
        self.sup = sup
        self.log = log
        control = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                control.handle(self.rfile.readline(), self.wfile)

        path.unlink(missing_ok=True)
        self.server = socketserver.UnixStreamServer(str(path), Handler)
        path.chmod(0o600)
        self.thread = threading.Thread(target=self.server.serve_forever, name="weir-control", daemon=True)

    def start(self) -> ControlServer:
        self.thread.start()
        return self

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.path.unlink(missing_ok=True)

    def handle(self, line: bytes, out: Any) -> None:
        def send(message: dict[str, Any]) -> None:
            with contextlib.suppress(OSError):  # the client went away: the rollout goes on to a consistent end
                out.write(json.dumps(message).encode() + b"\n")
                out.flush()

        def say(text: str) -> None:
            self.log(f"{'rollout':>8} | {text}")
            send({"say": text})

        try:
            request = json.loads(line)
            services = [str(s) for s in request["services"]]
            settings = RolloutSettings(**request.get("settings", {}))
            env = {str(k): str(v) for k, v in request.get("env", {}).items()}
        except (ValueError, KeyError, TypeError) as exc:
            send({"ok": False, "message": f"not a rollout request: {exc}"})
            return
        try:
            roll_out(self.sup, services, settings, say, env)
        except RolloutFailed as exc:
            self.log(f"{'rollout':>8} | failed: {exc}")
            send({"ok": False, "message": str(exc)})
        except Exception as exc:  # the supervisor keeps running whatever a rollout meets
            self.log(f"{'rollout':>8} | failed: {exc!r}")
            send({"ok": False, "message": f"{type(exc).__name__}: {exc}"})
        else:
            send({"ok": True, "message": f"rolled out {', '.join(services)}"})


# -------------------------------------------------------------------------------------------- the command


def ensure_migrate_requests(warn: Say) -> bool:
    """net.ipv4.tcp_migrate_req=1: when an old instance stops listening, the connections already in its accept
    queue are handed to the new instance on the same port, not reset. True when it is (or was made) set."""
    try:
        if MIGRATE_REQ.read_text().strip() == "1":
            return True
        MIGRATE_REQ.write_text("1\n")
        return True
    except OSError as exc:
        warn(f"warning: could not set net.ipv4.tcp_migrate_req=1 ({exc.strerror or exc}): a connection that reaches "
             "an old instance's port in the instant it stops listening is reset. As root: "
             "sysctl -w net.ipv4.tcp_migrate_req=1 (Linux 5.14+)")
        return False


def request_rollout(control_socket: Path, services: Sequence[str], settings: RolloutSettings, out: Say,
                    env: dict[str, str] | None = None) -> int:
    """Ask the running `weir up` for the rollout and print its progress; 0 when every instance was replaced."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        try:
            sock.connect(str(control_socket))
        except OSError as exc:
            out(f"cannot reach `weir up` at {control_socket}: {exc.strerror or exc} (is it running?)")
            return 2
        request = {"services": list(services), "settings": settings.model_dump(exclude={"migrate_requests"}),
                   "env": env or {}}
        sock.sendall(json.dumps(request).encode() + b"\n")
        with sock.makefile("rb") as answers:
            for raw in answers:
                answer = json.loads(raw)
                if "say" in answer:
                    out(str(answer["say"]))
                    continue
                out(str(answer["message"]))
                return 0 if answer["ok"] else 1
    out("`weir up` closed the control socket before the rollout ended (did it stop?)")
    return 1


def rollout_command(services: Sequence[str], *, every: bool, stack_json: Path, settings: RolloutSettings,
                    out: Say, env: dict[str, str] | None = None) -> int:
    try:
        stack = json.loads(stack_json.read_text())
    except (OSError, ValueError):
        out(f"no running `weir up` here: cannot read {stack_json}")
        return 2
    if "control_socket" not in stack:
        out(f"{stack_json} names no control socket: the `weir up` that wrote it predates `weir rollout`")
        return 2
    if every:
        services = list(dict.fromkeys(service_of(name) for name in stack["services"]))
    if not services:
        out("name a service (api, auth, encode, media, sweep), or --all")
        return 2
    if settings.migrate_requests:
        ensure_migrate_requests(out)
    return request_rollout(Path(stack["control_socket"]), services, settings, out, env)
