"""Settings every Weir service shares: the addresses of NATS, PostgreSQL and S3, and the bus's numbers.

Each service extends `CommonSettings` with its own numbers (SPEC section 8); all read `WEIR_*` variables.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared.overload.domain import Policy as ShedPolicy


class CommonSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="WEIR_", extra="ignore", frozen=True)

    nats_url: str = Field("nats://127.0.0.1:4222", description="NATS server(s) with JetStream, comma-separated")
    nats_nkey_seed: str = Field("", description="file of this process's NKEY user seed (its bus identity; unset: "
                                "connect without credentials, which a server with identities refuses)")
    nats_nkey_seed_dir: str = Field("", description="a directory of seeds named <identity>.nk, as `weir up` writes "
                                    "them: the process takes its own identity's (WEIR_NATS_NKEY_SEED wins)")
    nats_identity: str = Field("", description="the identity the seed belongs to, for logs and the reply inbox prefix "
                               "_INBOX.<identity> (unset: the service's name)")
    nats_teams_file: str = Field("deploy/nats/teams.json", description="the outside teams and their accounts, as "
                                 "`weir nats publisher` keeps them: `weir streams apply` makes each team's durables "
                                 "from it (missing: the teams unknown, no team durable made or removed)")
    nats_tls_ca: str = Field("", description="CA certificate file to verify the NATS server by (set: TLS)")
    nats_tls_cert: str = Field("", description="client certificate file, where the server asks for one")
    nats_tls_key: str = Field("", description="the client certificate's key file")
    database_url: str = Field("postgresql://postgres@127.0.0.1:5432/weir", description="PostgreSQL DSN")
    s3_endpoint: str = Field("http://127.0.0.1:8333", description="S3-compatible endpoint")
    s3_bucket: str = Field("weir", description="bucket for sources and renditions")
    s3_access_key: str = Field("weir", description="S3 access key id")
    s3_secret_key: SecretStr = Field(SecretStr("weir-secret-key"), description="S3 secret key")
    s3_region: str = Field("us-east-1", description="S3 region name")

    http_host: str = Field("127.0.0.1", description="address the service's HTTP server binds")
    http_port: int = Field(0, description="port of the service's HTTP server (0: any free port); bound with "
                           "SO_REUSEPORT, so a new instance can listen beside the old during a rollout")
    http_unix_socket: str = Field("", description="a path where this instance also answers HTTP, its own (the port "
                                  "may be shared), once it listens on the port: its supervisor asks this very "
                                  "instance whether it is ready")
    http_listen_when_ready: bool = Field(False, description="take connections on the shared port (and the Unix "
                                         "socket) only once ready: a new instance that never gets ready never serves "
                                         "a client (`weir up` sets it)")
    http_ready_poll_seconds: float = Field(0.2, gt=0, description="with http_listen_when_ready: how often the "
                                           "instance checks its own readiness before it listens")
    start_gate: str = Field("", description="a Unix socket where the instance, once connected and before it takes "
                            "any work (subscriptions, pulls, the port), waits to be let through: `weir rollout` "
                            "lifts the CPU cap of its start there (weir/cpucap.py); empty: no gate")
    start_gate_timeout_seconds: float = Field(60.0, gt=0, description="the longest wait at the start gate; then the "
                                              "instance goes on (its supervisor stops one that never gets ready)")
    http_drain_seconds: float = Field(5.0, ge=0, description="on SIGTERM, after the port stops taking connections: how "
                                      "long open connections still get answers (each saying Connection: close, so "
                                      "the client reconnects to the instance beside) before the rest are closed")
    http_close_spread_seconds: float = Field(0.0, ge=0, description="while draining: each open connection is closed "
                                             "after its first answer past a delay of its own, drawn within this "
                                             "many seconds (at most http_drain_seconds), so that clients reconnect "
                                             "to the instance beside a few at a time (0: every answer closes)")
    http_keep_alive_seconds: int = Field(75, ge=1, description="how long an idle kept-alive HTTP connection stays "
                                         "open: longer than the idle timeout of a load balancer or client pool in "
                                         "front (60 s on common ones), so that they close it first; a request sent "
                                         "on a connection the server is closing at that moment fails unanswered")
    log_level: str = Field("INFO", description="logging level")
    log_format: Literal["text", "json"] = Field("text", description="log lines as text, or as JSON objects (service, "
                                                "level, trace id, event or request id: shared/logs.py)")
    traces_dir: str = Field("", description="where spans are written as OTLP JSON lines, <service>-<pid>.jsonl, for "
                            "`weir trace` (unset: no files; OTEL_EXPORTER_OTLP_ENDPOINT, when set, wins: OTLP over "
                            "HTTP; neither: tracing is off)")
    trace_reads_per_second: float = Field(1.0, ge=0, description="reads (GET, HEAD, OPTIONS) whose new traces "
                                          "are recorded in each second, before trace_read_ratio applies "
                                          "(shared/tracing.py)")
    trace_read_ratio: float = Field(0.01, ge=0, le=1, description="share of the further reads of a second whose new "
                                    "traces are recorded (1: every read); writes, events and jobs are always recorded")
    internal_token: SecretStr = Field(SecretStr(""), description="secret shared by Weir's own services and edges;"
                                      " operators present it for /settings (unset: /settings is not served)")

    stream_replicas: int = Field(1, ge=1, le=5, description="JetStream replicas per stream (3 in a cluster)")
    stream_max_age_seconds: int = Field(30 * 86400, description="how long streams keep events")
    stream_duplicate_window_seconds: int = Field(120, description="JetStream de-duplication window")

    outbox_batch_size: int = Field(500, ge=1, description="rows the relay publishes per transaction")
    outbox_poll_seconds: float = Field(1.0, gt=0, description="relay poll interval when no NOTIFY arrives")
    outbox_linger_ms: float = Field(50, ge=0, description="how long a relay that found nothing stays awake, looking "
                                    "again every outbox_recheck_ms, before it sleeps: while it is awake writers skip "
                                    "NOTIFY, whose database-wide lock would keep their commits from sharing a flush")
    outbox_recheck_ms: float = Field(5, gt=0, description="how soon an awake relay looks again after a drain that "
                                     "found less than a batch (or nothing, while it lingers): rows gather meanwhile, "
                                     "so that a drain's queries and acks serve several")
    outbox_keep_sent_seconds: int = Field(86400, description="how long sent outbox rows are kept")
    outbox_transport: Literal["table", "wal"] = Field(
        "table", description="where a write puts its events: `table`, a row of the outbox table; `wal`, a "
        "transactional message in PostgreSQL's WAL (pg_logical_emit_message, needs wal_level=logical), read by one "
        "relay per schema from a logical replication slot (shared/walrelay.py; bench.bus shows what each costs). "
        "Either way the relay drains the outbox table too, where writers of an earlier release still put rows")
    consumer_max_deliver: int = Field(5, ge=1, description="delivery attempts before a message is parked")
    consumer_nak_delay_seconds: float = Field(1.0, ge=0, description="delay before a failed message returns")
    consumer_ack_wait_seconds: float = Field(30.0, gt=0, description="time a handler has before redelivery")
    consumer_batch: int = Field(64, ge=1, description="messages fetched per pull")
    consumer_concurrency: int = Field(16, ge=1, description="fetched batches a consumer holds queued"
                                      " in its lanes before it pulls again")
    consumer_lanes: int = Field(4, ge=1, description="lanes deliveries queue in, by entity;"
                                " each applies its queue in one transaction")
    consumer_fetch_wait_seconds: float = Field(1.0, gt=0, description="how long each pull request waits on the"
                                               " server (shared/pull.py; the document's PullSub timeout): messages"
                                               " that arrive meanwhile come at once; a stopping consumer waits this"
                                               " long at most for its open requests to end")
    bus_publish_timeout_seconds: float = Field(5.0, gt=0, description="time a JetStream publish waits for its"
                                               " PubAck (outbox relay, dead-letter parking)")
    events_legacy_subjects: bool = Field(False, description="also publish each public event on its bare type (a "
                                         "marked copy beside `<type>.<account_id>`), for a consumer of the release "
                                         "before 1.1.0 whose durable `weir streams apply` does not widen (one Weir "
                                         "does not declare); it costs Weir's consumers, which read the bare type "
                                         "too, most of their throughput while on (bench.bus)")
    db_pool_max: int = Field(10, ge=1, description="database connections per service process")
    shutdown_grace_seconds: float = Field(10.0, description="time to drain in-flight messages on SIGTERM")
    metrics_refresh_seconds: float = Field(5.0, gt=0, description="how often /metrics' gauges read from elsewhere "
                                           "(JetStream consumer info, the outbox, the farm) are refreshed")
    large_output_height: int = Field(1440, gt=0, description="developer outputs this tall or taller (1440p, 2160p): "
                                     "at most one of them runs on a worker at a time (media admits by it, encode "
                                     "orders its offers by it)")
    web_assets_dir: Path = Field(Path(__file__).resolve().parents[1] / "web" / "node_modules",
                                 description="the npm packages of the /docs and /asyncapi pages (`make install`: "
                                 "npm ci --prefix web; the image sets its own copy)")


class ShedSettings(CommonSettings):
    """The numbers of shedding (SPEC 15), for the services that shed: the api (shared/overload/edge.py) and auth
    (its `auth.check` queue, services/auth/batched.py)."""

    # fixed, at 48 requests at once, with one ceiling below the reserve: of the policies measured it kept the goodput
    # at 4x the capacity (0.60-0.98 of 1x, 0.98 in the last runs) with every internal request answered, where `off`
    # let every request queue and the stepped ones gave the slots to the dearest writes (bench/RESULTS.md,
    # 2026-12-06 20:43 and 2026-12-07 04:34)
    shed_policy: ShedPolicy = Field(
        "fixed", description="how the api's concurrency limit moves: fixed (stays at shed_initial_limit; what waits "
        "past the queueing-delay target is refused), gradient (adaptive, by the latency of admitted requests), codel "
        "(by the event loop's queueing delay), off (nothing shed, in the api or auth); bench/overload.py compares "
        "them")
    shed_reserve_share: float = Field(0.2, ge=0, lt=1, description="share of the capacity that internal and "
                                      "management traffic keeps: lower priorities never take it")
    shed_priority_step: float = Field(0.0, ge=0, lt=1, description="how much lower (a share of the limit) each "
                                      "priority below upload completion stops: other writes, then reads (0: they "
                                      "share one ceiling, a burst's waiting requests still get slots by priority and "
                                      "are refused lowest first; 0.1: reads stop first, Stripe's order, at the cost of "
                                      "goodput measured in bench/RESULTS.md, 12-06 20:43)")
    shed_initial_limit: float = Field(48, gt=0, description="the api's concurrency limit at start (fixed's "
                                      "limit): about what one api instance answers within its latency on 2 cores")
    shed_min_limit: float = Field(4, gt=0, description="the lowest the concurrency limit goes")
    shed_max_limit: float = Field(1024, gt=0, description="the highest the concurrency limit goes")
    shed_tolerance: float = Field(1.5, ge=1, description="gradient: how much slower than their long-term mean the "
                                  "admitted requests may get before the limit shrinks")
    shed_smoothing: float = Field(0.2, gt=0, le=1, description="gradient: weight of each window's new estimate")
    shed_long_windows: int = Field(60, ge=1, description="gradient: memory of the long-term latency, in windows")
    shed_backoff: float = Field(0.9, gt=0, lt=1, description="codel: the factor the limit shrinks by per window "
                                "whose queueing delay stayed above the target")
    shed_target_ms: float = Field(5.0, gt=0, description="the queueing delay allowed to stand (CoDel's target): "
                                  "codel's limit, and auth's queue, where a check that waited longer while the "
                                  "queue has not been empty for a window is answered `overloaded`")
    shed_sender_clock: bool = Field(True, description="auth counts a check's wait from the time the api sent it "
                                    "(its Weir-Sent-At header), so that checks held up in sockets while auth is short "
                                    "of CPU are seen; the hosts' clocks must agree to well within shed_target_ms, as "
                                    "NTP keeps them (off: from auth's own receipt only)")
    shed_window_ms: float = Field(100.0, gt=0, description="how often the limit moves (CoDel's interval), and "
                                  "Retry-After's base")
    # 1 s rather than the window's 100 ms: a rollout's start on 2 cores holds requests for a few hundred ms, which a
    # 100-ms allowance refused (0.4-2 % of the GETs at half load, and some outside the rollouts); a standing queue
    # still gets the 5-ms target at once (bench/RESULTS.md, 2026-12-07 15:45-16:30)
    shed_burst_ms: float = Field(1000.0, gt=0, description="how long a request may wait for a slot (the api) or in "
                                 "auth's check queue while the queue keeps emptying now and then (a burst passing); "
                                 "once it has stood this long, shed_target_ms")


def redact(value: object) -> object:
    """A setting as it may be shown: secrets as set/unset, passwords in URLs masked (DSNs carry them)."""
    if isinstance(value, SecretStr):
        return "(set)" if value.get_secret_value() else "(unset)"
    if isinstance(value, str) and "://" in value and "@" in value:
        return ",".join(_mask_url(part) for part in value.split(","))
    return value


def _mask_url(url: str) -> str:
    scheme, _, rest = url.partition("://")
    userinfo, at, host = rest.rpartition("@")
    if not at or ":" not in userinfo:
        return url
    return f"{scheme}://{userinfo.split(':', 1)[0]}:***@{host}"


STACK_FILE_ENV = "WEIR_STACK"  # the stack file of a `weir up` elsewhere (`--data-dir D`: D/stack.json)


def stack_file() -> Path:
    """The running `weir up`'s stack file a tool reads: WEIR_STACK, else .weir/stack.json."""
    return Path(os.environ.get(STACK_FILE_ENV) or ".weir/stack.json")


def local_stack_settings(stack_json: Path | None = None) -> dict[str, Any]:
    """For a tool run beside `weir up`: the running stack's addresses and internal token (`stack_file()`) where the
    environment sets none, and its identities' seeds (WEIR_NATS_NKEY_SEED_DIR, so the tool connects as itself) where
    the environment names no seed."""
    stack_json = stack_json or stack_file()
    if not stack_json.exists():
        return {}
    info = json.loads(stack_json.read_text())
    overrides: dict[str, Any] = {}
    # the internal token: the operators' routes (/settings, auth's /throttled) ask for it
    for key in ("nats_url", "database_url", "s3_endpoint", "s3_bucket", "internal_token"):
        if f"WEIR_{key.upper()}" not in os.environ and info.get(key):
            overrides[key] = info[key]
    seeds = info.get("nats_identities") or {}
    if seeds and not {"WEIR_NATS_NKEY_SEED", "WEIR_NATS_NKEY_SEED_DIR"} & set(os.environ):
        overrides["nats_nkey_seed_dir"] = str(Path(next(iter(seeds.values()))).parent)
    return overrides
