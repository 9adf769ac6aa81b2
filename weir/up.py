"""`weir up`: the embedded servers, the streams and migrations, then every service as its own process."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx

from shared import db
from shared.devstack.addresses import StackAddresses
from shared.devstack.errors import DevStackError
from shared.devstack.natsserver import IDENTITIES_FILE, identities_config, reload_identities
from shared.devstack.ports import free_port, port_is_free
from shared.devstack.processes import pid_alive
from shared.devstack.runfiles import read_pid_file
from shared.devstack.stack import DevStack
from shared.identities import IDENTITIES
from shared.messaging import tool_broker
from shared.settings import CommonSettings
from shared.storage import apply_bucket_cors, ensure_bucket, s3_client
from shared.streams import apply_streams
from weir.cpucap import CpuCap
from weir.edge import LOCAL_SOURCE, Edge, EdgeSettings, start_edge
from weir.natsdeploy import CredentialsError, StackTeams, stack_teams
from weir.readerdurables import apply_reader_durables
from weir.rollout import ControlServer, autogroup_nice, set_autogroup_nice
from weir.supervise import GiveUp, SuperviseSettings, after_death

SERVICES = ("auth", "api", "encode", "sweep", "webhooks")  # plus `media` workers, counted separately
SECRET_NAMES = ("WEIR_INTERNAL_TOKEN", "WEIR_KEY_HASH_SECRET", "WEIR_UPLOAD_TOKEN_SECRET")
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    # a service must not outlive a `weir up` that was killed -9
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _child_setup(nice: int, idle: bool = False, cap: CpuCap | None = None) -> Callable[[], None]:
    def setup() -> None:  # runs in the child after its setsid (start_new_session): its autogroup is its own
        _die_with_parent()
        if cap is not None:  # its CPU capped until ready (weir/cpucap.py)
            cap.join()
        if idle:  # runs only when a CPU has nothing else to run (SCHED_IDLE), until set back
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        if nice:
            os.nice(nice)
            set_autogroup_nice("self", min((autogroup_nice("self") or 0) + nice, 19))

    return setup




def load_or_create_secrets(path: Path) -> dict[str, str]:
    """Secrets the services share, kept under .weir so a restart keeps keys and tokens valid."""
    stored: dict[str, str] = json.loads(path.read_text()) if path.exists() else {}
    for name in SECRET_NAMES:
        if os.environ.get(name):
            stored[name] = os.environ[name]
        stored.setdefault(name, secrets.token_urlsafe(48))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(stored, indent=2))
    path.chmod(0o600)
    return stored


async def prepare(settings: CommonSettings) -> list[str]:
    """Streams from the one declaration, every service's migrations, the bucket and its CORS rules."""
    done: list[str] = []
    async with tool_broker(settings, "cli") as broker:  # stream management is JetStream's API, on its connection
        done += await apply_streams(broker.connection.jetstream(), settings)
        # every service's durable, made or widened to this release's subjects before any service starts
        from shared.consumer import apply_service_durables  # here, not at the top: only `weir up` needs it

        done += await apply_service_durables(broker.connection.jetstream(), settings)
        # the publishers' durables (the stack's own, the teams'): the operator makes them, never their readers
        done += await apply_reader_durables(broker.connection.jetstream(), settings)
    import asyncpg

    conn = await asyncpg.connect(settings.database_url)
    try:
        for service in db.SCHEMAS:
            done += await db.migrate(conn, service)
    finally:
        await conn.close()
    async with s3_client(settings) as s3:
        if await ensure_bucket(s3, settings.s3_bucket):
            done.append(f"created bucket {settings.s3_bucket}")
        if await apply_bucket_cors(s3, settings.s3_bucket):
            done.append(f"set CORS rules of bucket {settings.s3_bucket}")
    return done


def demo_origins(api_url: str) -> tuple[str, ...]:
    """The demo app's allowed origins: the api's own (its /demo page), by address and by name."""
    port = api_url.rsplit(":", 1)[1]
    return (f"http://127.0.0.1:{port}", f"http://localhost:{port}")


def demo_credentials(settings: CommonSettings, path: Path, origins: tuple[str, ...]) -> dict[str, Any]:
    """A demo account, app and key pair, made once per data dir and kept for later runs. The app allows the api's
    origins (its /demo page); when the api's address moved since, the account gets a new app that allows the new
    one (the old app's keys stay valid for whatever used them)."""
    demo: dict[str, Any] | None = json.loads(path.read_text()) if path.exists() else None
    if demo is None or tuple(demo.get("allowed_origins", ())) != origins:
        demo = asyncio.run(provision_demo(settings, origins, demo))
        path.write_text(json.dumps(demo, indent=2))
        path.chmod(0o600)
    return demo


async def provision_demo(settings: CommonSettings, origins: tuple[str, ...],
                         before: dict[str, Any] | None) -> dict[str, Any]:
    from shared.authcheck import AppCreated, CreateApp
    from shared.authclient import create_account_with_app, manage

    async with tool_broker(settings, "up") as broker:
        if before and before.get("user_id") and before.get("account_id"):
            account = {k: before[k] for k in ("account_token", "user_id", "account_id")}
            app = await manage(broker.connection, "app.create", CreateApp(
                user_id=before["user_id"], account_id=before["account_id"], name="demo", allowed_origins=origins),
                AppCreated)
        else:
            created, app = await create_account_with_app(broker.connection, "demo", allowed_origins=origins)
            account = {"account_token": created.account_token, "user_id": created.user_id,
                       "account_id": created.account_id}
    return {**account, "app_id": app.id, "secret_key": app.secret_key, "publishable_key": app.publishable_key,
            "allowed_origins": list(origins)}


DEMO_RECEIVER_PATH = "/demo/receiver"


def register_demo_webhook(api_url: str, demo: dict[str, Any], path: Path) -> str:
    """The demo app's endpoint for the demo page's receiver (the api's own `POST /demo/receiver`), made through the
    public API with the app's secret key as a developer would, once per app: kept in `path` (mode 0600) with its
    signing secret, which only the api reads; pointed at the api's address again when it moved, turned on again when
    it was disabled. Returns what was done."""
    url = f"{api_url}{DEMO_RECEIVER_PATH}"
    kept: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    with httpx.Client(base_url=api_url, timeout=10, trust_env=False,
                      headers={"Authorization": f"Bearer {demo['secret_key']}"}) as http:
        if kept.get("app_id") == demo["app_id"] and kept.get("endpoint_id") and kept.get("secret"):
            r = http.get(f"/v1/webhooks/{kept['endpoint_id']}")
            if r.status_code == 200:
                shown = r.json()
                if shown["url"] == url and shown["enabled"]:
                    return f"endpoint {kept['endpoint_id']} delivers to {url}"
                http.patch(f"/v1/webhooks/{kept['endpoint_id']}", json={"url": url, "enabled": True}
                           ).raise_for_status()
                return f"endpoint {kept['endpoint_id']} delivers to {url} again"
            if r.status_code != 404:
                r.raise_for_status()
        r = http.post("/v1/webhooks", json={"url": url, "events": ["*"],
                                            "description": "the demo page's receiver (weir up)"})
        r.raise_for_status()
        made = r.json()
    _write_stack(path, {"app_id": demo["app_id"], "endpoint_id": made["id"], "url": url, "secret": made["secret"]})
    return f"made endpoint {made['id']}, delivering to {url}"


@dataclass
class ServiceProcess:
    name: str
    port: int
    proc: subprocess.Popen[bytes]
    pump: threading.Thread
    module: str = ""
    extra_env: dict[str, str] = field(default_factory=dict)
    started_at: float = field(default_factory=time.monotonic)
    quick_deaths: int = 0  # in a row (weir/supervise.py)
    restart_at: float | None = None  # dead, and to be started again then
    given_up: bool = False
    own_socket: str = ""  # this instance's own HTTP address (a Unix socket), beside the shared port
    generation: int = 0  # how many times `weir rollout` replaced it

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


LAST_WORDS = 6  # lines of a process's output kept to say why it died (a settings error is 3-4 lines)


def _pump(stream: IO[bytes], prefix: str, out: Callable[[str], None], last: collections.deque[str]) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace").rstrip()
        out(f"{prefix} | {line}")
        if line.strip():
            last.append(line)


@dataclass
class Supervisor:
    """The service processes of `weir up`: started, tended (started again when they die), replaced one at a time
    (`weir rollout`, from another thread: `lock` keeps `tend` off a process while it is swapped), stopped."""

    env: dict[str, str]
    out: Callable[[str], None] = print
    procs: list[ServiceProcess] = field(default_factory=list)
    policy: SuperviseSettings = field(default_factory=SuperviseSettings)
    run_dir: Path | None = None  # where each instance's own socket is (None: none, probes go to the port)
    lock: threading.RLock = field(default_factory=threading.RLock)
    starting: set[subprocess.Popen[bytes]] = field(default_factory=set)  # new instances of a rollout, not yet swapped
    last_words: dict[int, collections.deque[str]] = field(default_factory=dict)  # by pid: its output's last lines
    stopping: threading.Event = field(default_factory=threading.Event)  # `stop` began: no rollout starts anything

    def own_socket(self, name: str, generation: int) -> str:
        return str(self.run_dir / f"{name}.{generation}.sock") if self.run_dir is not None else ""

    def spawn(self, name: str, module: str, port: int, extra_env: dict[str, str], own_socket: str = "",
              nice: int = 0, idle: bool = False, cap: CpuCap | None = None
              ) -> tuple[subprocess.Popen[bytes], threading.Thread]:
        """The service's process (its own session and process group), its output pumped into `out`; `nice`: its
        CPU priority lowered by that much, `idle`: under SCHED_IDLE, `cap`: in that CPU-capped cgroup (a rollout's
        new instance while it starts)."""
        env = {**self.env, "WEIR_HTTP_PORT": str(port), **extra_env}
        if own_socket:  # the instance takes connections on the shared port only once ready (SPEC 11)
            env.update({"WEIR_HTTP_UNIX_SOCKET": own_socket, "WEIR_HTTP_LISTEN_WHEN_READY": "true"})
        proc = subprocess.Popen(
            [sys.executable, "-m", module],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=_child_setup(nice, idle, cap),
            start_new_session=True,  # Ctrl-C reaches `weir up`, which stops the services in order
        )
        assert proc.stdout is not None
        last = self.last_words[proc.pid] = collections.deque(maxlen=LAST_WORDS)
        pump = threading.Thread(target=_pump, args=(proc.stdout, f"{name:>8}", self.out, last), daemon=True)
        pump.start()
        return proc, pump

    def said_last(self, pid: int) -> str:
        """What a process printed last (credentials masked), in one line: why an instance that died did."""
        from shared.logs import Redactor

        lines = self.last_words.pop(pid, ())
        return Redactor()(" / ".join(line.strip() for line in lines))

    def start(self, name: str, module: str, port: int, extra_env: dict[str, str] | None = None) -> ServiceProcess:
        own = self.own_socket(name, 0)
        proc, pump = self.spawn(name, module, port, extra_env or {}, own)
        sp = ServiceProcess(name, port, proc, pump, module, dict(extra_env or {}), own_socket=own)
        with self.lock:
            self.procs.append(sp)
        return sp

    def instances(self, service: str) -> list[ServiceProcess]:
        """The processes of a service: `api`, or its workers `media-1`, `media-2` ..."""
        return [sp for sp in self.procs if sp.name == service
                or (sp.name.startswith(f"{service}-") and sp.name[len(service) + 1:].isdigit())]

    def pids(self) -> dict[str, int]:
        with self.lock:
            return {sp.name: sp.proc.pid for sp in self.procs}

    def tend(self, now: float | None = None) -> bool:
        """Restart what died (after its backoff), or give up on it (weir/supervise.py). True when a process was
        started again (its pid changed)."""
        with self.lock:
            return self._tend(time.monotonic() if now is None else now)

    def _tend(self, now: float) -> bool:
        restarted = False
        for sp in self.procs:
            if sp.given_up or sp.proc.poll() is None:
                continue
            if sp.restart_at is None:
                decision = after_death(now - sp.started_at, sp.quick_deaths, self.policy)
                if isinstance(decision, GiveUp):
                    sp.given_up = True
                    self.out(f"{'weir':>8} | {sp.name} exited with {sp.proc.returncode}: {decision.reason}")
                    continue
                sp.quick_deaths = decision.quick_deaths
                sp.restart_at = now + decision.delay_s
                self.out(f"{'weir':>8} | {sp.name} exited with {sp.proc.returncode}; starting it again in "
                         f"{decision.delay_s:g} s" + (f" (quick death {sp.quick_deaths} of at most "
                                                      f"{self.policy.max_quick_deaths})" if sp.quick_deaths else ""))
            if sp.restart_at <= now:
                sp.pump.join(timeout=1)
                sp.proc, sp.pump = self.spawn(sp.name, sp.module, sp.port, sp.extra_env, sp.own_socket)
                sp.started_at, sp.restart_at, restarted = now, None, True
                self.out(f"{'weir':>8} | {sp.name} started again (pid {sp.proc.pid})")
        return restarted

    def wait_ready(self, timeout: float = 60.0, names: tuple[str, ...] | None = None) -> None:
        deadline = time.monotonic() + timeout
        pending = [sp for sp in self.procs if names is None or sp.name in names]
        while pending:
            for sp in list(pending):
                if sp.proc.poll() is not None:
                    raise RuntimeError(f"{sp.name} exited with {sp.proc.returncode} before it was ready")
                if instance_ready(sp.url, sp.own_socket):
                    pending.remove(sp)
            if pending and time.monotonic() > deadline:
                raise TimeoutError(f"not ready after {timeout:.0f} s: {', '.join(p.name for p in pending)}")
            if pending:
                time.sleep(0.05)

    def stop(self, timeout: float = 15.0) -> None:
        with self.lock:
            self.stopping.set()
            for proc in self.starting:  # a rollout's new instance, not swapped in yet
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
        for sp in self.procs:
            if sp.proc.poll() is None:
                sp.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for sp in self.procs:
            try:
                sp.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                sp.proc.kill()
                sp.proc.wait()
            sp.pump.join(timeout=2)
        self.procs.clear()


def instance_ready(url: str, own_socket: str = "", timeout: float = 2.0) -> bool:
    """/readyz of this very instance: through its own socket when it has one (the port may be another's too). Plain
    HTTP on this machine: no TLS context (loading the CA bundle costs ~40 ms of CPU a probe), no proxies."""
    transport = httpx.HTTPTransport(uds=own_socket or None, verify=False)
    try:
        with httpx.Client(timeout=timeout, transport=transport, verify=False, trust_env=False) as client:
            return client.get(f"{url}/readyz").status_code == 200
    except httpx.HTTPError:
        return False


def run_dir(data_dir: Path) -> Path:
    """Where `weir up` keeps its sockets (each instance's own, the control socket): under the data dir, unless that
    path is too long for a Unix socket's address (108 bytes), then a private temp dir."""
    folder = (data_dir / "run").absolute()
    if len(str(folder)) > 80:
        folder = Path(tempfile.mkdtemp(prefix="weir-run-"))
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o700)
    return folder


def service_env(addresses: StackAddresses | None, secrets_: dict[str, str]) -> dict[str, str]:
    env = dict(os.environ)
    env.update(secrets_)
    if addresses is not None:
        env.update(
            {
                "WEIR_NATS_URL": addresses.nats_url,
                "WEIR_DATABASE_URL": addresses.database_url,
                "WEIR_S3_ENDPOINT": addresses.s3_endpoint,
                "WEIR_S3_BUCKET": addresses.s3_bucket,
                "WEIR_S3_ACCESS_KEY": addresses.s3_access_key,
                "WEIR_S3_SECRET_KEY": addresses.s3_secret_key,
                "WEIR_S3_REGION": addresses.s3_region,
            }
        )
        if addresses.nats_identities:  # each service connects as itself: <its name>.nk in the seeds' directory
            env["WEIR_NATS_NKEY_SEED_DIR"] = str(Path(next(iter(addresses.nats_identities.values()))).parent)
    env["PYTHONUNBUFFERED"] = "1"
    # the demo's receivers and a developer's own are on this machine: deliver to loopback and private addresses
    # (link-local and multicast stay refused); a deployment leaves it off (SPEC 13)
    env.setdefault("WEIR_WEBHOOK_ALLOW_PRIVATE", "1")
    env.setdefault("WEIR_IMPORT_ALLOW_PRIVATE", "1")  # and import files a developer serves on this machine
    return env


def seed_files(addresses: StackAddresses | None, settings: CommonSettings) -> dict[str, str]:
    """Each identity's seed file: the embedded stack's, or (external) those in WEIR_NATS_NKEY_SEED_DIR."""
    if addresses is not None:
        return dict(addresses.nats_identities)
    if settings.nats_nkey_seed_dir:
        folder = Path(settings.nats_nkey_seed_dir)
        return {name: str(folder / f"{name}.nk") for name in IDENTITIES if (folder / f"{name}.nk").is_file()}
    return {}


def up(data_dir: Path, *, media: int, external: bool, api_port: int | None, out: Callable[[str], None],
       nats_cluster: int = 1, edge: bool = False) -> int:
    t0 = time.monotonic()
    data_dir.mkdir(parents=True, exist_ok=True)
    stack: DevStack | None = None
    supervisor: Supervisor | None = None
    front: Edge | None = None
    control: ControlServer | None = None
    sockets_dir: Path | None = None
    stopping = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        stopping.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        secrets_ = load_or_create_secrets(data_dir / "secrets.json")
        # the outside teams' file (WEIR_NATS_TEAMS_FILE, default deploy/nats/teams.json from here): the one `weir nats
        # publisher` writes; the same path for the durables (prepare) and for `weir nats publisher` (stack.json)
        teams_file = teams_file_of(dict(os.environ))
        addresses: StackAddresses | None = None
        if not external:
            try:
                teams = stack_teams(teams_file)
            except CredentialsError as exc:
                out(f"{'servers':>8} | the outside teams cannot be admitted: {exc}")
                return 1
            out(f"{'servers':>8} | {teams.summary()}")
            # NATS admits only Weir's identities, each with its NKEY seed in .weir/nats/ (SPEC 7, who may use the bus),
            # and the teams of the teams file, each with the seed `weir nats publisher` made beside it
            stack = DevStack(data_dir / "servers", log=lambda line: out(f"{'servers':>8} | {line}"),
                             nats_identities_dir=data_dir / "nats", nats_cluster=nats_cluster,
                             extra_identities=teams.identities, extra_seeds=teams.seeds)
            addresses = stack.start()
            servers_ready = time.monotonic() - t0
            out(f"{'servers':>8} | ready in {servers_ready:.1f} s ({_timings(stack)})")
        env = service_env(addresses, secrets_)
        env["WEIR_NATS_TEAMS_FILE"] = str(teams_file)
        if nats_cluster > 1:  # every stream on every node (R3 at most: JetStream's own limit is 5, 3 is the norm)
            env.setdefault("WEIR_STREAM_REPLICAS", str(min(3, nats_cluster)))
        if "OTEL_EXPORTER_OTLP_ENDPOINT" not in env:  # traces to files that `weir trace` reads
            env.setdefault("WEIR_TRACES_DIR", str((data_dir / "traces").absolute()))
        settings = _settings_from(env)
        for line in asyncio.run(prepare(settings)):
            out(f"{'prepare':>8} | {line}")
        sockets_dir = run_dir(data_dir)
        supervisor = Supervisor(env=env, out=out, run_dir=sockets_dir)
        api_port = api_port or int(env.get("WEIR_HTTP_PORT_API", "0") or 0) or _stable_api_port()
        api_url = f"http://127.0.0.1:{api_port}"  # the public address: the api's own, or the edge's in front of it
        edge_port = api_port if edge else 0
        if edge:  # the api on a port of its own; auth reads X-Forwarded-For from the edge's address only
            api_port = free_port()
            env["WEIR_TRUSTED_PROXIES"] = ",".join(filter(None, (env.get("WEIR_TRUSTED_PROXIES"), LOCAL_SOURCE)))
        # the api starts last: its /demo page needs the demo app's publishable key, which auth makes, and its
        # index page links to the other services' pages
        for name in SERVICES:
            if name != "api":
                supervisor.start(name, f"services.{name}", free_port())
        # one slot per worker is kept for first-party jobs: a worker of one slot (half of 2 cores) would never take a
        # developer upload, so the embedded stack gives its workers at least two unless told otherwise
        slots = env.get("WEIR_MEDIA_SLOTS") or str(max(2, (os.cpu_count() or 1) // 2))
        for i in range(media):
            supervisor.start(f"media-{i + 1}", "services.media", free_port(),
                             {"WEIR_MEDIA_WORKER_ID": f"media-{i + 1}", "WEIR_MEDIA_SLOTS": slots})
        supervisor.wait_ready(names=("auth",))
        demo = demo_credentials(settings, data_dir / "demo.json", demo_origins(api_url))
        pages = ",".join(f"{sp.name}={sp.url}" for sp in supervisor.procs)
        demo_webhook = (data_dir / "demo-webhook.json").absolute()
        supervisor.start("api", "services.api", api_port, {"WEIR_DEMO_PUBLISHABLE_KEY": demo["publishable_key"],
                                                            "WEIR_SERVICE_PAGES": pages,
                                                            "WEIR_DEMO_WEBHOOK_FILE": str(demo_webhook)})
        supervisor.wait_ready()
        if edge:
            front = start_edge(data_dir, port=edge_port, admin_port=free_port(), apis=[f"127.0.0.1:{api_port}"],
                               token=secrets_["WEIR_INTERNAL_TOKEN"], source=LOCAL_SOURCE,
                               settings=EdgeSettings.model_validate(_weir_values(env, EdgeSettings)),
                               preexec_fn=_child_setup(0))
            out(f"{'edge':>8} | haproxy on {api_url} in front of the api ({front.config}; /metrics on "
                f"{front.admin_url})")
        try:  # the demo page's receiver; the stack runs without it
            out(f"{'weir':>8} | demo webhooks: {register_demo_webhook(api_url, demo, demo_webhook)}")
        except (httpx.HTTPError, KeyError, ValueError) as exc:
            out(f"{'weir':>8} | demo webhooks: the demo endpoint could not be registered: {exc}")
        identities = seed_files(addresses, settings)
        info: dict[str, Any] = {
            "api_url": api_url,
            "nats_url": settings.nats_url,
            "nats_identities": identities,
            "nats_servers": stack.nats_servers() if stack is not None else [],
            # `weir nats publisher` adds a team to the running servers: the teams file they admit, their data dir
            "nats_teams_file": str(teams_file),
            "servers_dir": str(stack.data_dir) if stack is not None else "",
            "database_url": settings.database_url,
            "s3_endpoint": settings.s3_endpoint,
            "s3_bucket": settings.s3_bucket,
            "internal_token": secrets_["WEIR_INTERNAL_TOKEN"],
            "demo": {k: demo[k] for k in ("account_token", "app_id", "secret_key", "publishable_key")},
            "demo_url": f"{api_url}/demo",
            "services": {sp.name: sp.url for sp in supervisor.procs},
            "pids": {"weir": os.getpid(), **{sp.name: sp.proc.pid for sp in supervisor.procs}},
        }
        if front is not None:  # `weir status` reads the edge's refusals from its admin port
            info["services"]["edge"] = front.admin_url
            info["edge"] = {"url": api_url, "admin_url": front.admin_url, "pid": front.proc.pid,
                            "config": str(front.config)}
        control = ControlServer(sockets_dir / "control.sock", supervisor, out).start()  # `weir rollout`
        info["control_socket"] = str(control.path)
        stack_json = data_dir / "stack.json"
        _write_stack(stack_json, info)
        ready_s = time.monotonic() - t0
        out(f"{'weir':>8} | stack ready in {ready_s:.1f} s: open {api_url}/ (the demo, the API reference, "
            f"each service's events)")
        out(f"{'weir':>8} | demo {api_url}/demo  API docs {api_url}/docs  events {api_url}/asyncapi")
        out(f"{'weir':>8} | NATS {settings.nats_url}  PostgreSQL {settings.database_url}  S3 {settings.s3_endpoint}")
        if identities:
            out(f"{'weir':>8} | NATS identities' seeds (mode 0600): "
                f"{Path(next(iter(identities.values()))).parent}/<identity>.nk ({', '.join(identities)})")
        out(f"{'weir':>8} | wrote {stack_json}; Ctrl-C stops everything")
        while not stopping.wait(0.2):
            supervisor.tend()
            if front is not None and front.proc.poll() is not None:
                out(f"{'edge':>8} | haproxy exited with {front.proc.returncode}; the api answers on "
                    f"http://127.0.0.1:{api_port} only")
                info.pop("edge")
                info["services"].pop("edge")
                _write_stack(stack_json, info)
                front = None
            pids = {"weir": os.getpid(), **supervisor.pids()}
            if pids != info["pids"]:  # a service started again, or rolled out: its new pid in stack.json
                info["pids"] = pids
                _write_stack(stack_json, info)
        return 0
    finally:
        if front is not None:  # first: nothing new reaches the api while it stops
            front.stop()
        if supervisor is not None:  # first: a rollout under way ends (its new instance stopped), so the control
            supervisor.stop()       # socket's one thread is free to close
        if control is not None:
            control.close()
        if stack is not None:
            stack.stop()
        if sockets_dir is not None:  # only sockets (each instance's, the control one): gone with their processes
            shutil.rmtree(sockets_dir, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            (data_dir / "stack.json").unlink()
        out(f"{'weir':>8} | stopped")


def teams_file_of(env: dict[str, str]) -> Path:
    """The teams file a `weir up` run with `env` admits (WEIR_NATS_TEAMS_FILE, else deploy/nats/teams.json), from
    the current directory."""
    return Path(_settings_from(env).nats_teams_file).absolute()


@dataclass(frozen=True)
class RunningStack:
    """A `weir up` as its stack file (stack.json) describes it."""

    stack_json: Path
    info: dict[str, Any]

    @property
    def teams_file(self) -> Path | None:
        """The teams file its NATS admits (None: a `weir up` of a release that did not say)."""
        return Path(self.info["nats_teams_file"]) if self.info.get("nats_teams_file") else None

    @property
    def servers_dir(self) -> Path | None:
        """Its embedded servers' data dir (None: `weir up --external`, its NATS not its own)."""
        return Path(self.info["servers_dir"]) if self.info.get("servers_dir") else None

    @property
    def nats_names(self) -> list[str]:
        return [str(n["name"]) for n in self.info.get("nats_servers") or [] if n.get("name")]

    def nats_running(self) -> bool:
        """Its NATS is its own and runs: each node's run file names a live process."""
        if self.servers_dir is None or not self.nats_names:
            return False
        pids = [read_pid_file(self.servers_dir / "run" / f"{name}.pid") for name in self.nats_names]
        return all(p is not None and pid_alive(p[0]) for p in pids)


def read_stack(stack_json: Path) -> RunningStack | None:
    """The `weir up` of a stack file; None when there is none (or it is not one `weir up` wrote)."""
    try:
        info = json.loads(stack_json.read_text())
    except (OSError, ValueError):
        return None
    return RunningStack(stack_json, info) if isinstance(info, dict) else None


def admit_teams(stack: RunningStack) -> tuple[StackTeams, list[str]]:
    """Have a running `weir up`'s NATS admit the declared identities and exactly the teams of its teams file (a team
    added, its rights changed, or gone): each node's identities' users written again and reloaded, by SIGHUP to the
    pid of its run file. The identities' connections stay up. Returns the teams and what was done, a line a node.
    Raises CredentialsError (the teams file or a seed) or DevStackError (a node not reloaded)."""
    if stack.teams_file is None or stack.servers_dir is None or not stack.nats_names:
        raise DevStackError(f"{stack.stack_json}: not a `weir up` whose NATS admits the teams of a teams file")
    teams = stack_teams(stack.teams_file)
    seeds = {str(name): Path(path) for name, path in (stack.info.get("nats_identities") or {}).items()}
    missing = [name for name in IDENTITIES if name not in seeds]
    if missing:
        raise DevStackError(f"{stack.stack_json} lists no seed for {', '.join(missing)}")
    config = identities_config([*IDENTITIES.values(), *teams.identities], {**seeds, **teams.seeds})
    done = []
    for name in stack.nats_names:
        pid, server_name = reload_identities(stack.servers_dir, name, config)
        done.append(f"nats-server {name} (pid {pid}, server name {server_name or '?'}) reloaded: it admits the "
                    f"declared identities and {len(teams.teams)} outside team(s) "
                    f"({stack.servers_dir / name / IDENTITIES_FILE})")
    return teams, done


def _write_stack(path: Path, info: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(info, indent=2))
    tmp.chmod(0o600)
    tmp.replace(path)  # readers never see half a file


def _stable_api_port() -> int:
    # the api's address should not move between runs: 8080 when it is free
    return 8080 if port_is_free(8080) else free_port()


def _timings(stack: DevStack) -> str:
    return ", ".join(f"{k} {v:.1f} s" for k, v in stack.timings.items())


def _weir_values(env: dict[str, str], model: type[CommonSettings]) -> dict[str, str]:
    """`model`'s fields among `env`'s WEIR_ variables."""
    values = {k[len("WEIR_"):].lower(): v for k, v in env.items() if k.startswith("WEIR_")}
    return {k: v for k, v in values.items() if k in model.model_fields}


def _settings_from(env: dict[str, str]) -> CommonSettings:
    """The settings the services will read from `env` (validated the same way)."""
    return CommonSettings.model_validate(_weir_values(env, CommonSettings))
