"""What the fault tests (service kills, a PostgreSQL restart, a storage outage) share; no tests here.

`weir_up`: a `weir up` stack in a temp dir, its processes and stack.json, and waiting for a killed service to be
ready again. `Load`: API clients creating, uploading (a clip that encodes) and reading, recording every answer with
what was down when, and retrying 503s as a client should. `delivery`: the counts that say nothing was lost or
doubled, from the streams and every service's tables (outbox, inbox, videos).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import nats
from nats.aio.client import Client as NATS
from nats.js import api as jsapi

from services.api.settings import ApiSettings
from services.api.videos import ENCODE_STATUS_TIMEOUT_S
from services.sweep.trigger import RUN_SUBJECT, RunAccepted, RunRequest, RunUpdate
from shared import authclient, db
from shared.bus import HDR_CONSUMER, HDR_ERROR, HDR_MSG_ID
from shared.devstack.ports import free_port
from shared.devstack.processes import pid_alive
from shared.devstack.stack import DevStack
from shared.events import Envelope
from shared.natsconn import inbox_prefix
from tests.integration.test_encode_helpers import fast_farm
from tests.waiting import TimedOut, stop_process, wait_for, wait_for_sync

# A request's own work on this 2-core machine while ffmpeg encodes beside every service, on top of what it may wait
# on a dependency (the bound below): the one number here that no setting gives.
CPU_SLACK_S = 4.0
# How long `weir up` may take to start a killed service again and see it ready, beyond its backoff (a service's
# start-up on a loaded 2-core machine: imports, connections, migrations, subscriptions).
START_ALLOWANCE_S = 30.0
# a 503 a client retries: a dependency down (`unavailable`), or the api shedding while requests pile up waiting
# for it (`overloaded`, SPEC 15: with auth killed the admitted requests' latency rises and the api's limit falls)
RETRYABLE_503 = ("unavailable", "overloaded")
RETRY_PAUSE_S = 0.2  # a client's pause after a 503 or a refused connection (Retry-After says 1; tests hurry)
OPERATOR = "operator"




@contextlib.contextmanager
def data_root() -> Iterator[Path]:
    """Not pytest's tmp_path: a pytest session started elsewhere resets /tmp/pytest-of-<user> to 0700 at any time,
    and PostgreSQL runs as its own user, which must be able to reach its data directory."""
    with tempfile.TemporaryDirectory(prefix="weir-faults-") as tmp:
        yield Path(tmp)


# ------------------------------------------------------------------------------------------------ settings


def env_of(settings: dict[str, Any]) -> dict[str, str]:
    """Settings (field names) as the WEIR_ variables `weir up` hands every service."""
    return {f"WEIR_{k.upper()}": str(v) for k, v in settings.items()}


def farm_env(*, consumers: bool = True) -> dict[str, str]:
    """The fast farm of the encode tests (heartbeats, rounds, ultrafast x264); with `consumers`, also its short
    consumer ack wait and NAK delay (without: the product's defaults)."""
    settings = fast_farm()
    if not consumers:
        settings = {k: v for k, v in settings.items() if not k.startswith("consumer_")}
    return env_of(settings)


# the load is a few clients of one key from one address: the request limits are not what these tests are about
NO_LIMITS = env_of({f"limit_{rule}_per_minute": 1_000_000 for rule in ("address", "key", "owner", "upload_token")})


def stack_env(**overrides: str) -> dict[str, str]:
    """`weir up`'s environment: this one, no request limits in the way, no daily sweep (runs are the test's)."""
    return {**os.environ, "PYTHONUNBUFFERED": "1", **NO_LIMITS, "WEIR_SWEEP_DAILY_ENABLED": "false", **overrides}


def request_bound_s(env: dict[str, str]) -> float:
    """The longest an API request may take before it counts as hung: the guard's wait for auth.check
    (WEIR_AUTH_TIMEOUT_MS), then the longest wait of a route on a dependency (a management request to auth, minting an
    upload token; encode's status answer), and CPU_SLACK_S."""
    auth_s = ApiSettings(auth_timeout_ms=int(env.get("WEIR_AUTH_TIMEOUT_MS", ApiSettings().auth_timeout_ms))
                         ).auth_timeout_ms / 1000
    manage_s = float(inspect.signature(authclient.manage).parameters["timeout"].default)
    return auth_s + manage_s + ENCODE_STATUS_TIMEOUT_S + CPU_SLACK_S


# ---------------------------------------------------------------------------------------------- weir up


@dataclass
class WeirUp:
    data_dir: Path
    proc: subprocess.Popen[bytes]
    log_path: Path
    info: dict[str, Any]

    @property
    def stack_json(self) -> Path:
        return self.data_dir / "stack.json"

    @property
    def api_url(self) -> str:
        return str(self.info["api_url"])

    @property
    def database_url(self) -> str:
        return str(self.info["database_url"])

    @property
    def secret_key(self) -> str:
        return str(self.info["demo"]["secret_key"])

    def url(self, service: str) -> str:
        return str(self.info["services"][service])

    def pids(self) -> dict[str, int]:
        """The services' pids as stack.json says now (`weir up` rewrites it when it starts one again)."""
        return {k: int(v) for k, v in json.loads(self.stack_json.read_text())["pids"].items()}

    def log_tail(self, lines: int = 80) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def log_lines(self, needle: str) -> list[str]:
        return [line for line in self.log_path.read_text(errors="replace").splitlines() if needle in line]


@contextlib.contextmanager
def weir_up(root: Path, env: dict[str, str], *args: str, keep_log: Path | None = None,
            timeout: float = 120.0) -> Iterator[WeirUp]:
    """`weir up` in `root`/weir, its output in `root`/weir-up.log (copied to `keep_log` at the end, for after the
    test); stopped (SIGTERM, as Ctrl-C) on exit."""
    data_dir = root / "weir"
    log_path = root / "weir-up.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "weir.cli", "up", "--data-dir", str(data_dir), "--api-port", str(free_port()),
             *args],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
    try:
        def tail() -> str:
            return "\n".join(log_path.read_text(errors="replace").splitlines()[-60:])

        def written() -> bool:
            assert proc.poll() is None, f"weir up exited with {proc.returncode}:\n{tail()}"
            return (data_dir / "stack.json").exists()

        try:
            wait_for_sync(written, timeout, "weir up to write stack.json")
        except TimedOut as e:
            raise TimedOut(f"{e}\n{tail()}") from None
        yield WeirUp(data_dir, proc, log_path, json.loads((data_dir / "stack.json").read_text()))
    finally:
        stop_process(proc, 90)
        if keep_log is not None:
            shutil.copyfile(log_path, keep_log)


async def ready(http: httpx.AsyncClient, url: str) -> bool:
    try:
        return (await http.get(f"{url}/readyz", timeout=2.0)).status_code == 200
    except httpx.HTTPError:
        return False


async def all_ready(up: WeirUp) -> dict[str, bool]:
    async with httpx.AsyncClient() as http:
        return {name: await ready(http, url) for name, url in up.info["services"].items()}


async def everything_ready(up: WeirUp) -> bool:
    """True once every service answers /readyz 200."""
    return all((await all_ready(up)).values())


@contextlib.contextmanager
def own_servers(root: Path) -> Iterator[tuple[DevStack, dict[str, str]]]:
    """NATS, PostgreSQL and S3 of the test's own (to stop and start one of them), and the variables that point
    `weir up --external` and its services at them (each identity's seed in `root`/nats)."""
    dev = DevStack(root / "servers", durable=False, nats_identities_dir=root / "nats")
    a = dev.start()
    try:
        yield dev, {"WEIR_NATS_URL": a.nats_url, "WEIR_DATABASE_URL": a.database_url, "WEIR_S3_ENDPOINT": a.s3_endpoint,
                    "WEIR_S3_BUCKET": a.s3_bucket, "WEIR_S3_ACCESS_KEY": a.s3_access_key,
                    "WEIR_S3_SECRET_KEY": a.s3_secret_key, "WEIR_S3_REGION": a.s3_region,
                    "WEIR_NATS_NKEY_SEED_DIR": str(root / "nats")}
    finally:
        dev.stop()


def same_processes(up: WeirUp, before: dict[str, int]) -> None:
    """No service process was started again: the pids of stack.json as before, each alive."""
    now = up.pids()
    assert now == before, f"pids changed: {before} -> {now}:\n{up.log_tail()}"
    assert all(pid_alive(pid) for pid in now.values()), {name: pid_alive(pid) for name, pid in now.items()}
    assert not up.log_lines("starting it again"), up.log_lines("starting it again")


@dataclass(frozen=True)
class Restart:
    service: str
    old_pid: int
    new_pid: int
    restarted_s: float  # from the kill to the new pid in stack.json
    ready_s: float  # from the kill to the new process's /readyz 200


async def kill9_and_wait_restart(up: WeirUp, service: str, *, backoff_ms: int) -> Restart:
    """kill -9 the service; `weir up` starts it again on the same address: its new pid in stack.json, /readyz 200."""
    old = up.pids()[service]
    t0 = time.monotonic()
    os.kill(old, signal.SIGKILL)
    within = backoff_ms / 1000 + START_ALLOWANCE_S
    new = old
    while new == old:
        assert time.monotonic() - t0 < within, f"{service} was not started again within {within:.0f} s:\n" \
                                               f"{up.log_tail()}"
        await asyncio.sleep(0.02)
        with contextlib.suppress(OSError, ValueError, KeyError):
            new = up.pids()[service]
    restarted = time.monotonic() - t0
    async with httpx.AsyncClient() as http:
        while not await ready(http, up.url(service)):
            assert time.monotonic() - t0 < within, f"{service} (pid {new}) not ready within {within:.0f} s:\n" \
                                                   f"{up.log_tail()}"
            await asyncio.sleep(0.05)
    assert not pid_alive(old), f"{service}'s killed pid {old} is still there"
    return Restart(service, old, new, restarted, time.monotonic() - t0)


# ------------------------------------------------------------------------------------------------- load


@dataclass(frozen=True)
class Answer:
    kind: str  # create, initiate, parts, stored_parts, complete, get, list
    outcome: str  # the status ("201", "503"), or the transport error's class ("ConnectError", "ReadTimeout")
    seconds: float
    phases: frozenset[str]  # what was being done to the stack when it was sent and when it was answered

    @property
    def transport_error(self) -> bool:
        return not self.outcome.isdigit()


class Unexpected(Exception):
    """An answer no client should get: the flow it was part of is abandoned (and the test fails on it)."""


@dataclass
class Load:
    """`clients` API clients of one secret key, each doing upload flows with reads between them until stopped.

    A flow: create a video, initiate its upload, part URLs, PUT the part straight to storage, list the stored
    parts, complete; then read the video and the first page of the list. A step that answered 503 (or could not
    reach the api, while the api is what is down) is tried again, as a client should; a flow once started is
    finished even after `stop`, so that every upload is either completed or never begun."""

    api_url: str
    secret_key: str
    source: bytes
    bound_s: float  # the longest any answer may take (request_bound_s)
    clients: int = 3
    pause_s: float = 0.3  # between a client's flows: a steady trickle the 2-core farm keeps up with
    flow_deadline_s: float = 90.0  # a flow still retrying after this long is a failure
    phase: str = "steady"  # set by the test while it breaks something: "kill api", "postgres down" ...
    transport_ok_phases: frozenset[str] = frozenset()  # phases in which the api itself is down
    answers: list[Answer] = field(default_factory=list)
    created: list[str] = field(default_factory=list)
    completed: list[str] = field(default_factory=list)  # complete answered 200
    unexpected: list[str] = field(default_factory=list)
    storage_puts: Counter[str] = field(default_factory=Counter)

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.secret_key}"}

    async def call(self, http: httpx.AsyncClient, kind: str, method: str, path: str,
                   **kw: Any) -> httpx.Response | None:
        """One API request, recorded; None when it got no HTTP answer (recorded with the error's class)."""
        sent_in = self.phase
        t0 = time.monotonic()
        try:
            response: httpx.Response | None = await http.request(method, path, headers=self._headers(), **kw)
        except httpx.TransportError as exc:
            response, outcome = None, type(exc).__name__
        else:
            assert response is not None
            outcome = str(response.status_code)
        answer = Answer(kind, outcome, time.monotonic() - t0, frozenset({sent_in, self.phase}))
        self.answers.append(answer)
        if outcome.endswith("Timeout"):  # no answer within the bound: a hang, whatever was down
            self.unexpected.append(f"{method} {path}: no answer within {self.bound_s:.1f} s ({outcome}, "
                                   f"{sorted(answer.phases)})")
        elif answer.transport_error and not answer.phases & self.transport_ok_phases:
            self.unexpected.append(f"{method} {path}: {outcome} after {answer.seconds:.2f} s ({sorted(answer.phases)})")
        elif response is not None and response.status_code >= 500 and response.status_code != 503:
            self.unexpected.append(f"{method} {path}: {response.status_code} {response.text[:300]} "
                                   f"({sorted(answer.phases)})")
        elif response is not None and response.status_code == 503:
            body = _json(response)
            if body.get("code") not in RETRYABLE_503 or "retry-after" not in response.headers:
                self.unexpected.append(f"{method} {path}: a 503 without code {'/'.join(RETRYABLE_503)} and "
                                       "Retry-After: "
                                       f"{response.headers} {response.text[:300]}")
        return response

    async def until_ok(self, http: httpx.AsyncClient, kind: str, ok: int, method: str, path: str,
                       deadline: float, **kw: Any) -> httpx.Response:
        while True:
            response = await self.call(http, kind, method, path, **kw)
            if response is not None and response.status_code == ok:
                return response
            if response is not None and response.status_code != 503:
                raise Unexpected(f"{method} {path}: {response.status_code} {response.text[:300]}")
            if time.monotonic() > deadline:
                raise Unexpected(f"{method} {path}: still no {ok} after {self.flow_deadline_s:.0f} s")
            await asyncio.sleep(RETRY_PAUSE_S)

    async def flow(self, http: httpx.AsyncClient, storage: httpx.AsyncClient) -> None:
        deadline = time.monotonic() + self.flow_deadline_s
        created = await self.until_ok(http, "create", 201, "POST", "/v1/videos", deadline,
                                      json={"name": f"faults {uuid.uuid4()}"})
        video = created.json()["id"]
        self.created.append(video)
        upload = f"/v1/videos/{video}/upload"
        await self.until_ok(http, "initiate", 200, "POST", upload, deadline, json={"content_type": "video/mp4"})
        parts = await self.until_ok(http, "parts", 200, "POST", f"{upload}/parts", deadline,
                                    json={"part_numbers": [1]})
        put = await storage.put(parts.json()["parts"][0]["url"], content=self.source)
        self.storage_puts[str(put.status_code)] += 1
        if put.status_code != 200:
            raise Unexpected(f"PUT part of {video}: {put.status_code} {put.text[:300]}")
        stored = await self.until_ok(http, "stored_parts", 200, "GET", f"{upload}/parts", deadline)
        if [p["part_number"] for p in stored.json()["parts"]] != [1]:
            raise Unexpected(f"stored parts of {video}: {stored.text[:300]}")
        await self.until_ok(http, "complete", 200, "POST", f"{upload}/complete", deadline,
                            json={"parts": [{"part_number": 1, "etag": put.headers["etag"]}]})
        self.completed.append(video)
        # reads: a 503 is an answer too; nothing to retry
        await self.call(http, "get", "GET", f"/v1/videos/{video}")
        await self.call(http, "list", "GET", "/v1/videos", params={"limit": 5})

    async def storm(self, stop: asyncio.Event, concurrency: int) -> None:
        """Creates back to back from `concurrency` clients, not retried, until `stop`: requests at every stage of
        their way (the guard's auth.check, the insert, the token mint) at the moment something is killed."""
        async with httpx.AsyncClient(base_url=self.api_url, timeout=self.bound_s) as http:
            async def one() -> None:
                while not stop.is_set():
                    if await self.call(http, "storm create", "POST", "/v1/videos", json={"name": "storm"}) is None:
                        await asyncio.sleep(RETRY_PAUSE_S)  # the api is down: no need to spin on refusals

            await asyncio.gather(*(one() for _ in range(concurrency)))

    async def client(self, stop: asyncio.Event) -> None:
        async with httpx.AsyncClient(base_url=self.api_url, timeout=self.bound_s) as http, \
                httpx.AsyncClient(timeout=self.bound_s) as storage:
            while not stop.is_set():
                try:
                    await self.flow(http, storage)
                except Unexpected as exc:
                    self.unexpected.append(str(exc))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.pause_s)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[Load]:
        stop = asyncio.Event()
        tasks = [asyncio.create_task(self.client(stop), name=f"load-{i}") for i in range(self.clients)]
        try:
            yield self
        finally:
            stop.set()
            done, pending = await asyncio.wait(tasks, timeout=self.flow_deadline_s + self.bound_s)
            for task in pending:
                task.cancel()
            for task in done:
                if task.exception() is not None:
                    self.unexpected.append(f"a client failed: {task.exception()!r}")
            if pending:
                self.unexpected.append(f"{len(pending)} client(s) still busy after their flow's deadline")

    async def wait_completions(self, more: int, timeout: float) -> None:
        """Until `more` uploads have completed from now (the load is flowing)."""
        target = len(self.completed) + more
        await wait_for(lambda: len(self.completed) >= target, timeout, f"{more} more completed uploads")

    # ------------------------------------------------------------------------------------------ reporting

    def outcomes(self, phase: str | None = None) -> Counter[str]:
        return Counter(f"{a.kind} {a.outcome}" for a in self.answers if phase is None or phase in a.phases)

    def slowest(self) -> float:
        return max((a.seconds for a in self.answers), default=0.0)

    def table(self) -> str:
        by_phase: dict[str, Counter[str]] = {}
        for a in self.answers:
            phase = " & ".join(sorted(a.phases))
            by_phase.setdefault(phase, Counter())[a.outcome] += 1
        return "\n".join(f"  {phase:<28} {dict(sorted(c.items()))}" for phase, c in sorted(by_phase.items()))


def _json(response: httpx.Response) -> dict[str, Any]:
    try:
        body = response.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


# -------------------------------------------------------------------------------------- the bus as operator


async def operator_nats(up: WeirUp) -> NATS:
    """A connection as `operator` (the `weir` CLI's identity): it reads streams through ephemerals, asks the sweep."""
    seeds: dict[str, str] = up.info["nats_identities"]
    nc: NATS = await nats.connect(str(up.info["nats_url"]).split(","), nkeys_seed=seeds[OPERATOR],
                                  inbox_prefix=inbox_prefix(OPERATOR), name="weir-faults-test")
    return nc


async def stream_events(up: WeirUp, stream: str, subject: str) -> list[tuple[str, Envelope]]:
    """Every message of `subject` in `stream`, as (its Nats-Msg-Id, its envelope), read from the start."""
    nc = await operator_nats(up)
    try:
        js = nc.jetstream()
        name = f"faults_{uuid.uuid4().hex[:12]}"  # a named ephemeral: the operator may create those
        await js.add_consumer(stream, jsapi.ConsumerConfig(
            name=name, filter_subject=subject, deliver_policy=jsapi.DeliverPolicy.ALL,
            ack_policy=jsapi.AckPolicy.NONE, mem_storage=True, inactive_threshold=30.0))
        sub = await js.pull_subscribe_bind(name, stream, inbox_prefix=f"{inbox_prefix(OPERATOR)}.".encode())
        pending = (await sub.consumer_info()).num_pending or 0
        found: list[tuple[str, Envelope]] = []
        while pending > 0:
            msgs = await sub.fetch(min(pending, 256), timeout=5)
            pending -= len(msgs)
            found += [((m.headers or {}).get(HDR_MSG_ID, ""), Envelope.from_bytes(m.data)) for m in msgs]
        await sub.unsubscribe()
        return found
    finally:
        await nc.close()


async def parked(up: WeirUp) -> Counter[str]:
    """What the DLQ holds, by consumer, subject and error (Weir-Consumer, the subject, Weir-Error)."""
    nc = await operator_nats(up)
    try:
        js = nc.jetstream()
        name = f"faults_{uuid.uuid4().hex[:12]}"
        await js.add_consumer("DLQ", jsapi.ConsumerConfig(
            name=name, filter_subject="dlq.>", deliver_policy=jsapi.DeliverPolicy.ALL,
            ack_policy=jsapi.AckPolicy.NONE, mem_storage=True, inactive_threshold=30.0))
        sub = await js.pull_subscribe_bind(name, "DLQ", inbox_prefix=f"{inbox_prefix(OPERATOR)}.".encode())
        pending = (await sub.consumer_info()).num_pending or 0
        found: Counter[str] = Counter()
        while pending > 0:
            msgs = await sub.fetch(min(pending, 256), timeout=5)
            pending -= len(msgs)
            for m in msgs:
                h = m.headers or {}
                found[f"{h.get(HDR_CONSUMER, '?')} {m.subject}: {h.get(HDR_ERROR, '?')[:120]}"] += 1
        await sub.unsubscribe()
        return found
    finally:
        await nc.close()


async def stream_count(up: WeirUp, stream: str) -> int:
    nc = await operator_nats(up)
    try:
        return int((await nc.jetstream().stream_info(stream)).state.messages)
    finally:
        await nc.close()


@dataclass(frozen=True)
class SweepOutcome:
    accepted: RunAccepted
    report: dict[str, Any] | None  # the run's final report, when asked to wait for it


async def sweep_run(up: WeirUp, *, force: bool, timeout: float, wait_report: bool = True) -> SweepOutcome:
    """What `weir sweep run [--force]` does: ask the sweep service (`sweep.run`) until it accepts (a run still holding
    the run lock refuses), then, with `wait_report`, wait for the run's report on the updates inbox."""
    nc = await operator_nats(up)
    try:
        reports: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

        async def on_update(msg: Any) -> None:
            update = RunUpdate.model_validate_json(msg.data)
            if update.kind == "report" and update.report is not None:
                reports.put_nowait(update.report)

        inbox = nc.new_inbox()
        await nc.subscribe(inbox, cb=on_update)
        request = RunRequest(force=force, updates=inbox).model_dump_json().encode()
        deadline = time.monotonic() + timeout
        while True:
            try:
                reply = await nc.request(RUN_SUBJECT, request, timeout=max(0.5, deadline - time.monotonic()))
            except nats.errors.NoRespondersError:
                accepted = RunAccepted(accepted=False, detail="no responders")
            else:
                accepted = RunAccepted.model_validate_json(reply.data)
            if accepted.accepted:
                break
            assert time.monotonic() < deadline, f"the sweep did not accept a run: {accepted.detail}"
            await asyncio.sleep(0.2)
        if not wait_report:
            return SweepOutcome(accepted, None)
        report = await asyncio.wait_for(reports.get(), max(1.0, deadline - time.monotonic()))
        return SweepOutcome(accepted, report)
    finally:
        await nc.close()


# -------------------------------------------------------------------------------------------- the tables


@contextlib.asynccontextmanager
async def database(up: WeirUp) -> AsyncIterator[asyncpg.Connection]:
    conn: asyncpg.Connection = await asyncpg.connect(up.database_url)
    try:
        yield conn
    finally:
        await conn.close()


async def unsent(conn: asyncpg.Connection) -> dict[str, int]:
    """Unsent outbox rows of every service's schema."""
    return {schema: int(await conn.fetchval(f"SELECT count(*) FROM {db.quote_ident(schema)}.outbox"
                                            " WHERE sent_at IS NULL"))
            for schema in sorted(set(db.SCHEMAS.values()))}


@dataclass
class Delivery:
    """What the streams and tables say of every upload that completed (the videos table's recorded files)."""

    recorded: set[str]  # videos whose file the api recorded
    events: list[tuple[str, Envelope]]  # upload.completed in VIDEOS, on its account's subject: (Nats-Msg-Id, envelope)
    copies: list[tuple[str, Envelope]]  # and on the bare type, for consumers of the release before (SPEC 11)
    inbox: dict[str, int]  # encode_uploads' inbox: event id -> times handled
    statuses: Counter[str]  # of the recorded videos
    not_ready: dict[str, str]  # recorded videos not ready: id -> status (and failure)
    renditions: Counter[int]  # renditions per ready video (how many videos have n)
    unsent: dict[str, int]
    dlq: int
    parked: Counter[str]  # what the DLQ holds (parked), when it holds anything
    processing: list[str] = field(default_factory=list)  # the not-ready videos' outputs, results and the workers

    @property
    def event_videos(self) -> Counter[str]:
        return Counter(str(e.data["video_id"]) for _, e in self.events)

    def settled(self) -> bool:
        return (set(self.event_videos) == self.recorded and set(self.inbox) == {e.id for _, e in self.events}
                and not self.not_ready and not any(self.unsent.values()))

    def summary(self) -> str:
        return (f"{len(self.recorded)} uploads recorded, {len(self.events)} upload.completed "
                f"({len(self.event_videos)} videos), {len(self.inbox)} encode inbox rows, statuses "
                f"{dict(self.statuses)}, unsent outbox {self.unsent}, DLQ {self.dlq} {dict(self.parked)}")

    def check(self) -> None:
        """Nothing lost, nothing doubled: one event per recorded upload (and one per Nats-Msg-Id), one inbox row per
        event and each handled once, every such video ready, no outbox row unsent, nothing parked."""
        doubled = {v: n for v, n in self.event_videos.items() if n > 1}
        assert not doubled, f"upload.completed more than once: {doubled}"
        ids = [msg_id for msg_id, _ in self.events]
        assert len(set(ids)) == len(ids) and ids == [e.id for _, e in self.events], "Nats-Msg-Id is the event id"
        assert not self.copies, "a copy on the bare type, with WEIR_EVENTS_LEGACY_SUBJECTS off"
        assert set(self.event_videos) == self.recorded, (
            f"recorded without an event: {sorted(self.recorded - set(self.event_videos))[:10]}; "
            f"an event without a recorded file: {sorted(set(self.event_videos) - self.recorded)[:10]}")
        event_ids = {e.id for _, e in self.events}
        assert set(self.inbox) == event_ids, (
            f"events encode never handled: {sorted(event_ids - set(self.inbox))[:10]}; inbox rows of no event: "
            f"{sorted(set(self.inbox) - event_ids)[:10]}")
        assert all(times == 1 for times in self.inbox.values()), {k: v for k, v in self.inbox.items() if v != 1}
        assert not self.not_ready, ("recorded uploads that did not become ready: "
                                    + "\n".join([str(self.not_ready), *self.processing]))
        assert set(self.renditions) <= {1}, f"renditions per video: {dict(self.renditions)} (one expected)"
        assert not any(self.unsent.values()), f"outbox rows left unsent: {self.unsent}"
        assert self.dlq == 0, f"{self.dlq} messages parked on the DLQ: {dict(self.parked)}"


async def delivery(up: WeirUp, *, explain: bool = True) -> Delivery:
    """What landed; with `explain`, where the videos not ready stand (for a failure's message: a poll skips it)."""
    events = await stream_events(up, "VIDEOS", "upload.completed.*")
    copies = await stream_events(up, "VIDEOS", "upload.completed")
    dlq = await stream_count(up, "DLQ")
    async with database(up) as conn:
        rows = await conn.fetch("SELECT id::text, status, failure_reason, failure_message, renditions"
                                " FROM videos.videos WHERE file_recorded_at IS NOT NULL")
        inbox = {str(r["event_id"]): int(r["times"]) for r in await conn.fetch(
            "SELECT event_id, times FROM encode.inbox WHERE consumer = 'encode_uploads'")}
        waiting = await unsent(conn)
        stuck = [r["id"] for r in rows if r["status"] != "ready"]
        try:
            processing = await processing_of(conn, stuck) if stuck and explain else []
        except asyncpg.PostgresError as exc:  # a stack without media: what could be read is still worth the failure
            processing = [f"where the encoding stands: not read ({exc!r})"]
    return Delivery(
        recorded={r["id"] for r in rows},
        events=events,
        copies=copies,
        inbox=inbox,
        statuses=Counter(r["status"] for r in rows),
        not_ready={r["id"]: f"{r['status']} {r['failure_reason'] or ''} {r['failure_message'] or ''}".strip()
                   for r in rows if r["status"] != "ready"},
        renditions=Counter(len(json.loads(r["renditions"])) for r in rows if r["status"] == "ready"),
        unsent=waiting,
        dlq=dlq,
        parked=await parked(up) if dlq else Counter(),
        processing=processing,
    )


async def processing_of(conn: asyncpg.Connection, videos: list[str]) -> list[str]:
    """Where the videos' encoding stands, for a failure's message: encode's outputs, the workers it knows, and the
    results the media workers recorded (delivered or not)."""
    outputs = await conn.fetch("SELECT * FROM encode.outputs WHERE video_id = ANY($1) ORDER BY video_id, height",
                               videos)
    workers = await conn.fetch("SELECT * FROM encode.workers ORDER BY name")
    results = await conn.fetch("SELECT video_id, output, attempt, recorded_at, delivered_at FROM media.results"
                               " WHERE video_id = ANY($1) ORDER BY video_id, output, attempt", videos)
    now = await conn.fetchval("SELECT now()")
    return [f"now {now}", *(f"output {dict(r)}" for r in outputs), *(f"worker {dict(r)}" for r in workers),
            *(f"result {dict(r)}" for r in results)]


async def settled_delivery(up: WeirUp, timeout: float) -> tuple[Delivery, float]:
    """The counts once everything in flight has landed (or as they are after `timeout` s), and how long that took."""
    t0 = time.monotonic()
    while True:
        found = await delivery(up, explain=False)
        took = time.monotonic() - t0
        if found.settled():
            return found, took
        if took > timeout:
            return await delivery(up), took  # read again, with where the videos not ready stand
        await asyncio.sleep(0.25)


async def encoding_outputs(up: WeirUp, worker: str | None = None) -> list[tuple[str, int, str]]:
    """Outputs encode has out on the farm now: (video, height, worker)."""
    async with database(up) as conn:
        rows = await conn.fetch("SELECT video_id, height, worker FROM encode.outputs WHERE state = 'encoding'"
                                + (" AND worker = $1" if worker else ""), *([worker] if worker else []))
    return [(r["video_id"], r["height"], r["worker"]) for r in rows]
