"""What the server refuses, as Weir's processes meet it, on a real nats-server with the generated configuration.

A service (or the `weir` CLI) that cannot authenticate exits non-zero within seconds and says why. A permission
violation is logged with identity and subject, counted on /metrics, and a request to that subject fails at once
(`PermissionRefused`), not after its timeout: nats-py's request, the outbox relay (keeping its row) and auth's
`CheckSender` alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from faststream.nats import NatsBroker

from shared.authcheck import AccountCreated, CreateAccount
from shared.authclient import CheckSender, manage
from shared.bus import subscriptions_in_place
from shared.devstack.addresses import StackAddresses
from shared.events import Envelope, UploadCompleted, new_event
from shared.messaging import make_broker
from shared.metrics import Metrics
from shared.natsauth import new_seed
from shared.natsconn import MAX_SUBJECT_LABELS, OTHER_SUBJECTS, ConnectionWatch, PermissionRefused, request
from shared.outbox import enqueue
from shared.publishers import EventPublishers, Outgoing
from shared.settings import CommonSettings
from tests.conftest import fresh_schema
from tests.integration.bushelpers import relay_for
from tests.integration.identityhelpers import IdentityServer, connected, identity_server, wait_until_ready

pytestmark = pytest.mark.timeout(120)
AT_ONCE = 1.0  # a refusal's answer: one round trip to the server, far below the timeouts below
LONG = 10.0  # what a request, a publish or a check would wait without the refusal
START_BUDGET = 20.0  # a process's imports on a busy machine, then one refused connect (it takes ~2 s idle)
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[IdentityServer]:
    with identity_server(tmp_path_factory.mktemp("bus-refusals")) as started:
        yield started


@pytest.fixture(scope="module")
async def ready(server: IdentityServer) -> IdentityServer:
    """Up, with the streams applied by the operator: what is refused below would otherwise be stored."""
    await wait_until_ready(server)
    return server


def as_identity(server: IdentityServer, name: str) -> CommonSettings:
    return CommonSettings(nats_url=server.url, stream_replicas=1, nats_nkey_seed=str(server.seeds[name]),
                          nats_identity=name)


@contextlib.asynccontextmanager
async def watched_broker(
    server: IdentityServer, name: str
) -> AsyncIterator[tuple[NatsBroker, ConnectionWatch, Metrics]]:
    """`name`'s broker as a service connects it: through a ConnectionWatch that counts on the service's Metrics."""
    metrics = Metrics(name)
    watch = ConnectionWatch(name, metrics)
    broker = make_broker(as_identity(server, name), name=name, watch=watch)
    try:
        await watch.connected(broker.connect())
        yield broker, watch, metrics
    finally:
        await broker.stop()


_SAMPLE = re.compile(r'^weir_nats_permission_violations_total\{(?P<labels>[^}]*)\} (?P<value>\S+)$')


def violations(metrics: Metrics, name: str, subject: str, operation: str = "publish") -> float:
    """The count of `name`'s refused `operation`s on `subject`, read from its line as /metrics renders it."""
    wanted = {"identity": name, "operation": operation, "service": name, "subject": subject}
    for line in metrics.render().splitlines():
        sample = _SAMPLE.match(line)
        if sample and dict(re.findall(r'(\w+)="([^"]*)"', sample["labels"])) == wanted:
            return float(sample["value"])
    raise AssertionError(f"no {wanted} in {metrics.render()}")


def logged(caplog: pytest.LogCaptureFixture, *parts: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if all(p in r.getMessage() for p in parts)]


# --------------------------------------------------------------------------------------- who may not connect


def run_process(args: list[str], env: dict[str, str], cwd: Path) -> tuple[int, str, float]:
    """A process run to its end (killed past the budget): its exit code, what it printed, how long it ran."""
    started = time.monotonic()
    proc = subprocess.Popen(args, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        out, _ = proc.communicate(timeout=START_BUDGET)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError(f"{args} still running after {START_BUDGET} s (retrying?): {out.decode()[-3000:]}") \
            from None
    return proc.returncode, out.decode(errors="replace"), time.monotonic() - started


def process_env(server: IdentityServer, **weir: str) -> dict[str, str]:
    """The environment of a Weir process pointed at the server: no seed of any kind unless given (the session's
    WEIR_NATS_NKEY_SEED_DIR, if the caller's environment has one, is cleared); PostgreSQL is never reached."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("WEIR_")}
    return {**base, "PYTHONUNBUFFERED": "1", "WEIR_LOG_LEVEL": "INFO", "WEIR_NATS_URL": server.url,
            "WEIR_NATS_NKEY_SEED": "", "WEIR_NATS_NKEY_SEED_DIR": "", "WEIR_HTTP_PORT": "0",
            "WEIR_DATABASE_URL": "postgresql://nobody@127.0.0.1:1/never",
            **{f"WEIR_{k.upper()}": v for k, v in weir.items()}}


def stranger_seed(directory: Path) -> Path:
    path = directory / "stranger.nk"
    path.write_bytes(new_seed() + b"\n")
    path.chmod(0o600)
    return path


@pytest.mark.parametrize("case", ["no seed", "unknown seed"])
def test_a_service_that_is_refused_exits_at_start_and_says_why(ready: IdentityServer, tmp_path: Path,
                                                               case: str) -> None:
    seed = {"nats_nkey_seed": str(stranger_seed(tmp_path))} if case == "unknown seed" else {}
    code, out, took = run_process([sys.executable, "-m", "services.media"], process_env(ready, **seed), ROOT)
    assert code == 3, out  # shared/runtime.py main(): refused, not crashed (1) nor retrying (no exit)
    assert "authorization violation" in out.lower(), out
    assert "media cannot start" in out, out
    assert out.lower().count("authorization violation (check") <= 2, out  # one refusal said, not a retry loop
    assert took < START_BUDGET


@pytest.mark.parametrize("case", ["not there", "not a seed"])
def test_a_service_whose_seed_file_will_not_do_exits_at_start_naming_the_setting(ready: IdentityServer,
                                                                                  tmp_path: Path, case: str) -> None:
    seed = tmp_path / "nowhere" / "media.nk"
    if case == "not a seed":
        seed = tmp_path / "media.nk"
        seed.write_text("SUnotaseed\n")
    code, out, _ = run_process([sys.executable, "-m", "services.media"],
                               process_env(ready, nats_nkey_seed=str(seed)), ROOT)
    assert code == 3, out
    assert "WEIR_NATS_NKEY_SEED" in out and str(seed) in out, out
    assert ("does not hold an NKEY seed" if case == "not a seed" else "not a readable file") in out, out
    assert "Traceback" not in out, out


def weir_cli(ready: IdentityServer, tmp_path: Path, *args: str) -> tuple[int, str, float]:
    """`weir ...` (the console script) from a directory with no .weir/stack.json, without a seed."""
    return run_process([str(Path(sys.executable).parent / "weir"), *args], process_env(ready), tmp_path)


def test_the_cli_without_a_seed_fails_at_once_saying_why(ready: IdentityServer, tmp_path: Path) -> None:
    code, out, took = weir_cli(ready, tmp_path, "streams", "apply")
    assert code != 0, out
    said = [line for line in out.splitlines() if "NATS refused identity 'operator': authorization violation" in line]
    assert said and "WEIR_NATS_NKEY_SEED" in said[0], out  # the watch's line: the reason and the setting to check
    assert took < START_BUDGET


def test_the_cli_without_a_seed_prints_no_traceback(ready: IdentityServer, tmp_path: Path) -> None:
    code, out, _ = weir_cli(ready, tmp_path, "streams", "apply")
    assert code == 3, out
    assert "Traceback" not in out, out
    assert len(out.strip().splitlines()) <= 3, out


# --------------------------------------------------------------------------------------- what an identity may not do


async def test_a_request_outside_the_identitys_rights_fails_at_once_logged_and_counted(
    ready: IdentityServer, caplog: pytest.LogCaptureFixture
) -> None:
    subject = "auth.manage.account.create"
    caplog.set_level(logging.WARNING, logger="weir.nats")
    async with watched_broker(ready, "auth") as (auth, _, _), watched_broker(ready, "media") as (media, watch, metrics):
        heard: list[bytes] = []

        @auth.subscriber(subject, queue="auth")
        async def create(body: bytes) -> bytes:  # auth would make the account: it never hears of it
            heard.append(body)
            return b'{"account_id":"a1"}'

        await auth.start()
        await subscriptions_in_place(auth.connection)
        started = time.monotonic()
        with pytest.raises(PermissionRefused) as refused:
            await request(watch, media.connection, subject, b'{"name":"mallory"}', timeout=LONG)
        assert time.monotonic() - started < AT_ONCE
        assert (refused.value.identity, refused.value.operation, refused.value.subject) == ("media", "publish to",
                                                                                           subject)
        assert logged(caplog, "permission violation", "'media'", f"'{subject}'"), caplog.text
        assert violations(metrics, "media", subject) == 1
        await subscriptions_in_place(auth.connection)
        assert heard == []
        assert media.connection.is_connected  # a refused publish leaves the connection as it was

        # again: counted again, and a subject spelled in capitals is matched (nats-py lower-cases the server's text)
        js_subject = "$JS.API.STREAM.DELETE.VIDEOS"
        with pytest.raises(PermissionRefused, match=r"'media' may not publish to '\$JS\.API\.STREAM\.DELETE\.VIDEOS'"):
            await request(watch, media.connection, js_subject, b"", timeout=LONG)
        with pytest.raises(PermissionRefused):
            await request(watch, media.connection, subject, b"{}", timeout=LONG)
        assert violations(metrics, "media", subject) == 2
        assert violations(metrics, "media", js_subject) == 1
        assert logged(caplog, "'media'", f"'{js_subject}'"), caplog.text
    async with connected(ready, "operator") as operator:
        assert (await operator.nc.jetstream().stream_info("VIDEOS")).config.name == "VIDEOS"  # still there


async def test_a_refused_subscription_is_logged_and_counted(ready: IdentityServer,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="weir.nats")
    async with watched_broker(ready, "media") as (media, _, metrics):
        await media.connection.subscribe("_INBOX.api.>")  # another identity's replies
        deadline = time.monotonic() + 5
        while not logged(caplog, "'media' may not subscribe to", "'_inbox.api.>'"):
            assert time.monotonic() < deadline, caplog.text
            await asyncio.sleep(0.02)
        assert violations(metrics, "media", "_inbox.api.>", "subscribe") == 1


async def test_subjects_with_ids_do_not_grow_metrics_without_end(ready: IdentityServer) -> None:
    """Each refused subject is its own series up to MAX_SUBJECT_LABELS; past them the count goes on as "(other)"
    (a refused inbox or JetStream ack subject carries an id: one series each would never stop growing)."""
    extra = 5
    async with watched_broker(ready, "media") as (media, watch, metrics):
        for i in range(MAX_SUBJECT_LABELS + extra):
            await media.connection.publish(f"_INBOX.api.forged.{i}", b"{}")
        deadline = time.monotonic() + 10
        while metrics.value("nats_permission_violations_total", identity="media", operation="publish",
                            subject=OTHER_SUBJECTS) < extra:
            assert time.monotonic() < deadline, metrics.render()
            await asyncio.sleep(0.02)
        series = [line for line in metrics.render().splitlines()
                  if line.startswith("weir_nats_permission_violations_total{")]
        assert len(series) == MAX_SUBJECT_LABELS + 1, series
        assert violations(metrics, "media", OTHER_SUBJECTS) == extra
        assert len(watch.last_violation) == MAX_SUBJECT_LABELS
        assert f"_inbox.api.forged.{MAX_SUBJECT_LABELS + extra - 1}" in watch.last_violation  # the latest kept


def upload_completed(video_id: str) -> Envelope:
    return new_event(UploadCompleted(video_id=video_id, app_id="app1", account_id="acct1", key_id="key1",
                                     object_key=f"uploads/{video_id}", size=10, content_type="video/mp4",
                                     source_height=720), source="media", subject=video_id)


async def test_the_relay_keeps_a_row_it_may_not_publish_and_says_why(
    ready: IdentityServer, stack: StackAddresses, caplog: pytest.LogCaptureFixture
) -> None:
    """`media` relaying an `upload.completed` (api's event): the publish is refused at once, not after the publish
    timeout; the row stays unsent (nothing lost) and the relay's warning says which identity may not publish what."""
    caplog.set_level(logging.WARNING)
    settings = CommonSettings(nats_url=ready.url, database_url=stack.database_url, bus_publish_timeout_seconds=LONG)
    async with fresh_schema(stack.database_url, "bustest") as (schema, pool), \
            watched_broker(ready, "media") as (media, watch, metrics):
        publishers = EventPublishers(media, ("upload.completed",), timeout=LONG, watch=watch)
        await media.start()
        forged = upload_completed("v-relay")
        async with pool.acquire() as conn:
            await enqueue(conn, forged)
        relay = relay_for(pool, publishers, schema, settings)
        started = time.monotonic()
        assert await relay.drain_once() == 0
        assert time.monotonic() - started < AT_ONCE
        async with pool.acquire() as conn:
            row = await conn.fetchrow("SELECT sent_at FROM outbox WHERE id = $1", forged.id)
        assert row is not None and row["sent_at"] is None  # kept for a later try
        assert logged(caplog, f"outbox relay ({schema}): 1 of 1 not acked", "PermissionRefused",
                      "'media' may not publish to 'upload.completed.acct1'"), caplog.text
        assert violations(metrics, "media", "upload.completed.acct1") == 1  # its account's subject

        # the publishers' own result, the same way: PermissionRefused at once
        started = time.monotonic()
        (result,) = await publishers.publish_in_order([Outgoing("upload.completed", forged.to_bytes(), forged.id)])
        assert isinstance(result, PermissionRefused), result
        assert time.monotonic() - started < AT_ONCE
        assert await relay.pending() == 1
    async with connected(ready, "operator") as operator:
        assert (await operator.nc.jetstream().stream_info("VIDEOS")).state.messages == 0


async def test_auth_checks_from_an_identity_that_may_not_send_them_fail_at_once(ready: IdentityServer) -> None:
    async with watched_broker(ready, "auth") as (auth, _, _), watched_broker(ready, "media") as (media, watch, metrics):
        heard: list[bytes] = []

        @auth.subscriber("auth.check", queue="auth")
        async def check(body: bytes) -> bytes:
            heard.append(body)
            return b'{"allowed":true}'

        await auth.start()
        await subscriptions_in_place(auth.connection)
        sender = CheckSender(lambda: media.connection, timeout=LONG, watch=lambda: watch)
        started = time.monotonic()
        with pytest.raises(PermissionRefused, match=r"'media' may not publish to 'auth\.check'"):
            await sender.check(b"{}")
        assert time.monotonic() - started < AT_ONCE
        # several at once: each fails at once
        started = time.monotonic()
        results = await asyncio.gather(*(sender.check(b"{}") for _ in range(3)), return_exceptions=True)
        assert all(isinstance(r, PermissionRefused) for r in results), results
        assert time.monotonic() - started < AT_ONCE
        counted = [line for line in metrics.render().splitlines()
                   if line.startswith("weir_nats_permission_violations_total")]
        assert counted, metrics.render()
        await subscriptions_in_place(auth.connection)
        assert heard == []


async def test_a_management_request_through_the_connection_s_own_watch_fails_at_once(
    ready: IdentityServer, caplog: pytest.LogCaptureFixture
) -> None:
    """authclient's management calls (and the api's encode.status) go through natsconn.request without naming a
    watch: the connection's own (attached when it connected) fails them at once. The refusal is logged once, by the
    watch, not also as a "broken" connection with a traceback by FastStream."""
    caplog.set_level(logging.WARNING)
    async with watched_broker(ready, "media") as (media, _, metrics):
        started = time.monotonic()
        with pytest.raises(PermissionRefused, match=r"'media' may not publish to 'auth\.manage\.account\.create'"):
            await manage(media.connection, "account.create", CreateAccount(name="nobody"), AccountCreated,
                         timeout=LONG)
        assert time.monotonic() - started < AT_ONCE
        assert violations(metrics, "media", "auth.manage.account.create")
        await asyncio.sleep(0.1)
    assert not [r for r in caplog.records if "Connection broken" in r.getMessage()], caplog.text
    assert [r for r in caplog.records if r.name == "weir.nats" and "may not publish to" in r.getMessage()]
