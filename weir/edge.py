"""The edge (SPEC 15, opt-in: `weir up --edge`, compose's `edge` profile): HAProxy in front of the api's instances,
refusing what they cannot answer in time before it reaches their Python event loop.

Why: under 4x load the api's own shedder answers a refusal in 22-32 ms at p99 (its event loop is busy with the
admitted requests), HAProxy in 3-4 ms, with as much goodput at the same limit (bench/RESULTS.md, 2026-12-07). The
api's shedder stays behind it, for its priorities and where no edge runs.

Everything here is derived from the api's routes and settings, so it moves with them:
- at most `edge_maxconn` requests at once to each api instance; one that finds no slot waits for one (a burst
  passes), but is answered 503 `overloaded` with Retry-After (the api's own body) at once when `edge_queue_max`
  requests per instance wait already (a standing overload), and after `edge_queue_ms` of waiting in any case;
- `shed_reserve_share` of those slots kept for requests with Weir's internal token (read from HAProxy's environment,
  as the services read it: the config holds no secret; compared by SHA-256 digest);
- the operations routes (/healthz, /readyz, /metrics, /version, ...) never limited;
- refusals on the routes any page reads (the SDK's, the player's) carry CORS headers, as the api's own do;
- X-Forwarded-For added: auth reads it from the edge's address (WEIR_TRUSTED_PROXIES);
- every answer HAProxy makes itself is a problem body; with no api instance up it is 503 `unavailable`;
- an admin port: /metrics (HAProxy's Prometheus exporter), /healthz, /readyz, which `weir status` reads.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
from pydantic import Field

from shared.overload.domain import retry_after_seconds
from shared.overload.edge import INTERNAL_HEADER, OVERLOADED_DETAIL
from shared.problems import problem_body
from shared.settings import ShedSettings

TOKEN_ENV = "WEIR_INTERNAL_TOKEN"  # HAProxy reads the internal token from its environment, as the services do
LOCAL_SOURCE = "127.0.0.2"  # where `weir up --edge`'s HAProxy connects to the api from (edge_config: `source`)
PUBLIC, INTERNAL, OPERATIONS, INSTANCES = "api", "internal", "operations", "instances"  # the config's backends
LIMITED = (PUBLIC, INTERNAL)  # the backends whose requests wait for a slot: their own 503s are the edge's refusals
UNAVAILABLE_FILE, OVERLOADED_FILE = "unavailable.json", "overloaded.json"  # bodies of answers the config returns
# what HAProxy answers itself, by status: the code, the detail (503 is the refusal: queue full)
ERRORS: dict[int, tuple[str, str]] = {
    400: ("validation_error", "the request is not HTTP the edge can read"),
    408: ("validation_error", "the request did not arrive in time"),
    500: ("unavailable", "the edge failed to handle the request"),
    502: ("unavailable", "the api closed the connection without an answer; retry"),
    503: ("overloaded", OVERLOADED_DETAIL),
    504: ("unavailable", "the api did not answer in time"),
}
DOWN_DETAIL = "no api instance is up; retry after the Retry-After seconds"


class EdgeSettings(ShedSettings):
    """The edge's numbers (its reserve share and Retry-After are the api shedder's own)."""

    edge_maxconn: int = Field(48, ge=2, description="requests at once to each api instance through the edge; more "
                              "wait for a slot (bench/RESULTS.md, 2026-12-07)")
    edge_queue_max: int = Field(8, ge=1, description="requests per api instance that may wait for a slot: one more "
                                "is answered 503 overloaded at once")
    edge_queue_ms: int = Field(50, ge=1, description="how long a request waits at the edge for a slot before it is "
                               "answered 503 overloaded")
    edge_threads: int = Field(1, ge=1, description="HAProxy's threads (one refuses ~20,000 requests/s)")
    edge_access_log: bool = Field(False, description="a line per request on HAProxy's standard output (weir up: "
                                  "its haproxy.log), with its timings and how it ended")


@dataclass(frozen=True)
class EdgePaths:
    """Where the api's answers differ at the edge, from its routes: never limited, and readable from any page."""

    operations: frozenset[str]
    operations_patterns: tuple[str, ...]
    open_prefixes: tuple[str, ...]
    open_patterns: tuple[str, ...]


def api_paths() -> EdgePaths:
    """The api's own route table (services/api/guard.py), read from its app without servers."""
    from services.api.app import offline_app
    from services.api.guard import RouteTable

    table = RouteTable.of(offline_app())
    return EdgePaths(operations=table.operations_paths,
                     operations_patterns=tuple(p.pattern for p in table.operations_patterns),
                     open_prefixes=("/sdk/",), open_patterns=tuple(p.pattern for p in table.player_patterns))


def _quoted(pattern: str) -> str:
    if "'" in pattern:
        raise ValueError(f"a route pattern with a quote cannot go in HAProxy's config: {pattern!r}")
    return f"'{pattern}'"


def _compact(value: object) -> str:
    return json.dumps(value, separators=(",", ":"))


def _http_file(status: int, code: str, detail: str, retry_after: int | None) -> str:
    body = json.dumps(problem_body(status, code, detail))
    head = f"HTTP/1.1 {status} {problem_body(status, code, detail)['title']}\r\n"
    head += "content-type: application/problem+json\r\ncache-control: no-store\r\n"
    if retry_after is not None:
        head += f"retry-after: {retry_after}\r\n"
    return f"{head}content-length: {len(body)}\r\n\r\n{body}"


def error_files(settings: EdgeSettings) -> dict[str, str]:
    """The files the config names (file name -> content): HAProxy's own answers as problem bodies."""
    retry = retry_after_seconds(settings.shed_window_ms / 1000)
    files = {f"{status}.http": _http_file(status, code, detail, retry if status in (502, 503, 504) else None)
             for status, (code, detail) in ERRORS.items()}
    files[UNAVAILABLE_FILE] = json.dumps(problem_body(503, "unavailable", DOWN_DETAIL))
    files[OVERLOADED_FILE] = json.dumps(problem_body(503, "overloaded", OVERLOADED_DETAIL))
    return files


def edge_config(*, bind: str, admin_bind: str, apis: Sequence[str], files_dir: str, settings: EdgeSettings,
                paths: EdgePaths, cors_expose: str, source: str = "", replicas: int = 0) -> str:
    """HAProxy's config: `apis` are the api instances' host:port, `files_dir` where `error_files` are; `source`: the
    address the edge connects to them from (on one machine, 127.0.0.2: auth trusts its X-Forwarded-For, not that of
    the clients on 127.0.0.1). `replicas`: instead, `apis` is one name that DNS resolves to up to that many
    instances (compose's `api` service), found again as they come and go.

    A request whose connection to an instance failed (it died, or closed a kept-alive connection) is sent again; with
    no instance up, each backend's backup server is the edge's own `unavailable` frontend, which answers 503
    `unavailable` (HAProxy's 503 errorfile is the refusal: it also answers a queue timeout, which is overload)."""
    reserve = max(1, round(settings.edge_maxconn * settings.shed_reserve_share))
    retry = retry_after_seconds(settings.shed_window_ms / 1000)
    errors = "".join(f"    errorfile {status} {files_dir}/{status}.http\n" for status in ERRORS)
    operations = " ".join(sorted(paths.operations))
    acls = f"    acl operations path {operations}\n" if operations else ""
    acls += "".join(f"    acl operations path_reg {_quoted(p)}\n" for p in paths.operations_patterns)
    open_ = "".join(f"    acl open path_beg {p}\n" for p in paths.open_prefixes)
    open_ += "".join(f"    acl open path_reg {_quoted(p)}\n" for p in paths.open_patterns)
    open_ += "    http-request set-var(txn.open) bool(true) if open\n"
    unavailable = f"abns@weir-edge-unavailable-{admin_bind.rsplit(':', 1)[-1]}"
    check = "check inter 2s fall 2 rise 1 observe layer4 error-limit 1 on-error mark-down"

    if replicas and len(apis) != 1:
        raise ValueError("with replicas, one name that DNS resolves to the api's instances")

    def servers(backend: str, maxconn: int | None, backup: bool = True) -> str:
        """Each instance's entry: the public one checks it, the others follow (by DNS: each checks)."""
        limit = (f" maxconn {maxconn}" if maxconn else "") + (f" source {source}" if source else "")
        if replicas:
            lines = (f"    server-template {backend}- {replicas} {apis[0]}{limit} resolvers dns init-addr none "
                     f"{check}\n")
        else:
            lines = "".join(f"    server {backend}-{i} {api}{limit} "
                            f"{check if backend == PUBLIC else f'track {PUBLIC}/{PUBLIC}-{i}'}\n"
                            for i, api in enumerate(apis, 1))
        return lines + (f"    server unavailable {unavailable} backup\n" if backup else "")

    def cors(condition: str) -> str:
        return (f'    http-after-response set-header access-control-allow-origin "*" if {condition}\n'
                f'    http-after-response set-header access-control-expose-headers "{cors_expose}" if {condition}\n')

    up = f"{{ nbsrv({INSTANCES}) gt 0 }}"
    ready = _compact({"status": "ready", "checks": {"api": "ok"}})
    down = _compact(problem_body(503, "unavailable", "no api instance is up") | {"checks": {"api": "down"}})
    missing = _compact(problem_body(404, "not_found", "the admin port serves /metrics, /healthz, /readyz"))
    json_return = "http-request return status {} content-type application/{}json string {}"
    header = INTERNAL_HEADER.decode()
    backends = "    option httpchk GET /readyz\n    http-response set-var(txn.api) bool(true)\n"
    waiting = settings.edge_queue_max * (replicas or len(apis))

    def refuse_at_once(backend: str) -> str:  # a standing queue: the next request is refused without waiting
        return (f"    http-request return status 503 content-type application/problem+json file {files_dir}/"
                f"{OVERLOADED_FILE} hdr retry-after {retry} if {{ queue({backend}) ge {waiting} }}\n")

    resolvers = "resolvers dns\n    parse-resolv-conf\n    hold valid 10s\n" if replicas else ""
    return f"""# Weir's edge (weir/edge.py): generated from the api's routes and settings; `weir edge config` writes it
global
    maxconn {max(4096, 8 * settings.edge_maxconn * len(apis))}
    nbthread {settings.edge_threads}
{"    log stdout format raw local0" if settings.edge_access_log else ""}
defaults
    mode http
{"    log global" if settings.edge_access_log else ""}
{"    option httplog" if settings.edge_access_log else ""}
    option forwardfor
    option http-keep-alive
    option redispatch 1
    retries 2
    http-reuse always
    timeout connect 2s
    timeout client 60s
    timeout server 60s
    timeout http-request 10s
    timeout http-keep-alive 60s
    timeout queue {settings.edge_queue_ms}ms
{errors}frontend edge
    bind {bind}
{acls}{open_}    acl internal req.hdr({header}) -m len gt 0
    # the token compared by digest (no timing of the token itself), with the one in HAProxy's environment
    http-request set-var(txn.digest) req.hdr({header}),sha2(256),hex if internal
    acl internal_token str("${{{TOKEN_ENV}}}"),sha2(256),hex,strcmp(txn.digest) eq 0
    use_backend {OPERATIONS} if operations
    use_backend {INTERNAL} if internal internal_token
    default_backend {PUBLIC}
    # the edge's own refusals on the routes any page reads carry CORS headers (the api's answers carry their own)
{cors("{ var(txn.open) -m bool } !{ var(txn.api) -m bool }")}frontend unavailable
    bind {unavailable}
{open_}    http-request return status 503 content-type application/problem+json file {files_dir}/{UNAVAILABLE_FILE} \
hdr retry-after {retry}
{cors("{ var(txn.open) -m bool }")}frontend admin
    bind {admin_bind}
    http-request use-service prometheus-exporter if {{ path /metrics }}
    {json_return.format(200, "", _quoted('{"status":"ok"}'))} if {{ path /healthz }}
    {json_return.format(200, "", _quoted(ready))} if {{ path /readyz }} {up}
    {json_return.format(503, "problem+", _quoted(down))} if {{ path /readyz }}
    {json_return.format(404, "problem+", _quoted(missing))}
{resolvers}backend {PUBLIC}
{backends}{refuse_at_once(PUBLIC)}{servers(PUBLIC, settings.edge_maxconn - reserve)}backend {INTERNAL}
{backends}{refuse_at_once(INTERNAL)}{servers(INTERNAL, reserve)}backend {OPERATIONS}
{backends}{servers(OPERATIONS, None)}backend {INSTANCES}
    # no traffic: how many api instances are up (the other backends count their backup as usable)
    option httpchk GET /readyz
{servers(INSTANCES, None, backup=False)}"""


@dataclass(frozen=True)
class EdgeLoad:
    """From the edge's /metrics: the requests it refused since it started (503s of the limited backends that no api
    instance sent), its slots to the api, and the requests in them and waiting for one now."""

    refused: int
    slots: float | None
    in_flight: float | None
    waiting: float | None


def edge_load(exposition: str) -> EdgeLoad:
    from prometheus_client.parser import text_string_to_metric_families

    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if (sample.labels.get("proxy") not in LIMITED or sample.labels.get("code", "5xx") != "5xx"
                    or math.isnan(sample.value)):  # (a server without maxconn: its limit is NaN)
                continue
            sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
    refused = sums.get("haproxy_backend_http_responses_total", 0) - sums.get("haproxy_server_http_responses_total", 0)
    return EdgeLoad(refused=int(refused), slots=sums.get("haproxy_server_limit_sessions"),
                    in_flight=sums.get("haproxy_backend_current_sessions"),
                    waiting=sums.get("haproxy_backend_current_queue"))


@dataclass
class Edge:
    """A running HAProxy: its process, public URL and admin URL."""

    proc: subprocess.Popen[bytes]
    url: str
    admin_url: str
    config: Path

    def stop(self, timeout: float = 5.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


CONFIG_FILE, FILES_DIR = "haproxy.cfg", "weir"  # the config, and the folder beside it with the files it names


def edge_files(*, bind: str, admin_bind: str, apis: Sequence[str], files_dir: str, settings: EdgeSettings,
               source: str = "", replicas: int = 0) -> dict[str, str]:
    """The config and the files it names (path relative to the config's folder -> content); `files_dir` is where
    HAProxy will find FILES_DIR."""
    from services.api.guard import CORS_EXPOSE

    config = edge_config(bind=bind, admin_bind=admin_bind, apis=apis, files_dir=files_dir, settings=settings,
                         paths=api_paths(), cors_expose=CORS_EXPOSE.decode(), source=source, replicas=replicas)
    return {CONFIG_FILE: config, **{f"{FILES_DIR}/{name}": text for name, text in error_files(settings).items()}}


# compose.yaml's `edge` service (profile `edge`): in front of the api's replicas, found by the service's name
COMPOSE = {"bind": ":8080", "admin_bind": ":8404", "apis": ("api:8080",), "replicas": 2,
           "files_dir": f"/usr/local/etc/haproxy/{FILES_DIR}"}
COMPOSE_DIR = Path("deploy/edge")


def write_files(folder: Path, files: dict[str, str]) -> Path:
    """`edge_files` written under `folder`; the config's path."""
    for name, text in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    return folder / CONFIG_FILE


def start_edge(workdir: Path, *, port: int, admin_port: int, apis: Sequence[str], token: str,
               settings: EdgeSettings, source: str = "", preexec_fn: Callable[[], None] | None = None,
               log: Path | None = None, timeout: float = 10.0) -> Edge:
    """HAProxy on 127.0.0.1:`port` in front of `apis`, started, and ready once an api instance is up."""
    config = write_files(workdir, edge_files(bind=f"127.0.0.1:{port}", admin_bind=f"127.0.0.1:{admin_port}",
                                             apis=apis, files_dir=str((workdir / FILES_DIR).absolute()),
                                             settings=settings, source=source))
    out = (log or workdir / "haproxy.log").open("ab")
    env = {**os.environ, TOKEN_ENV: token}
    proc = subprocess.Popen(["haproxy", "-f", str(config), "-db"], stdout=out, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, env=env, preexec_fn=preexec_fn)
    out.close()
    edge = Edge(proc, f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin_port}", config)
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{edge.admin_url}/readyz", timeout=1.0, trust_env=False).status_code == 200:
                return edge
        time.sleep(0.05)
    edge.stop()
    raise RuntimeError(f"haproxy did not become ready in {timeout:.0f} s (its log: {log or workdir / 'haproxy.log'})")
