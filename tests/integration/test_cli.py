"""The `weir` commands an operator runs: config, streams apply, migrate, replay, events check."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from nats.aio.client import Client as NATS
from nats.js import api

from services.auth.settings import AuthSettings
from shared.bus import HDR_MSG_ID, HDR_REPROCESS, HDR_TYPE, HDR_VERSION, replay_subject
from shared.events import Envelope
from shared.settings import CommonSettings
from shared.streams import STREAMS
from tests.integration.bushelpers import replayable_reader, video_created
from weir.cli import SERVICE_SETTINGS, TOOL_SETTINGS


def weir(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "weir.cli", *args], capture_output=True, text=True, timeout=120,
        env={**os.environ, **(env or {})},
    )


def test_config_prints_every_setting_with_default_and_current() -> None:
    result = weir("config", "--json", env={"WEIR_LIMIT_KEY_PER_MINUTE": "7"})
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    auth = {r["variable"]: r for r in rows if r["service"] == "auth"}
    assert set(auth) == {f"WEIR_{name.upper()}" for name in AuthSettings.model_fields}
    default = AuthSettings.model_fields["limit_key_per_minute"].default
    assert auth["WEIR_LIMIT_KEY_PER_MINUTE"]["default"] == str(default)
    assert auth["WEIR_LIMIT_KEY_PER_MINUTE"]["current"] == "7"
    assert auth["WEIR_INTERNAL_TOKEN"]["current"] in {"(set)", "(unset)"}  # never the secret itself
    # a number under a token-like name is no secret
    assert auth["WEIR_LIMIT_UPLOAD_TOKEN_PER_MINUTE"]["current"] == str(
        AuthSettings.model_fields["limit_upload_token_per_minute"].default)
    assert {r["service"] for r in rows} == {*SERVICE_SETTINGS, *TOOL_SETTINGS}
    tools = {r["variable"] for r in rows if r["service"] in TOOL_SETTINGS}
    assert {"WEIR_ROLLOUT_READY_TIMEOUT_SECONDS", "WEIR_DLQ_REDRIVE_WAIT_SECONDS", "WEIR_EDGE_MAXCONN"} <= tools
    unknown = weir("config", "--service", "nope")
    assert unknown.returncode == 2 and "one of: auth" in unknown.stderr, unknown.stderr


def test_config_shows_a_running_stacks_addresses(tmp_path: Path) -> None:
    """`current` is what a command run here would use: the stack file's addresses where the environment sets none."""
    (tmp_path / "stack.json").write_text(json.dumps({"nats_url": "nats://127.0.0.1:25999"}))
    result = subprocess.run([sys.executable, "-m", "weir.cli", "config", "--service", "api", "--json"],
                            capture_output=True, text=True, timeout=120,
                            env={**clean_env(), "PYTHONPATH": ROOT, "WEIR_STACK": str(tmp_path / "stack.json")})
    assert result.returncode == 0, result.stderr
    rows = {r["variable"]: r for r in json.loads(result.stdout)}
    assert rows["WEIR_NATS_URL"]["current"] == "nats://127.0.0.1:25999"


def test_streams_apply_and_migrate_are_idempotent(stack_env: dict[str, str], prepared: CommonSettings) -> None:
    first = weir("streams", "apply", env=stack_env)
    assert first.returncode == 0, first.stderr
    assert all(f"updated {s.name}" in first.stdout for s in STREAMS)  # the session already created them
    migrated = weir("migrate", env=stack_env)
    assert migrated.returncode == 0 and "nothing to apply" in migrated.stdout, migrated.stdout + migrated.stderr


def test_replay_dry_run_counts_the_slice(stack_env: dict[str, str], prepared: CommonSettings) -> None:
    future = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
    result = weir(
        "replay", "--stream", "VIDEOS", "--subject", "video.created", "--since", future, "--dry-run", env=stack_env
    )
    assert result.returncode == 0, result.stderr
    assert "0 events of video.created on VIDEOS" in result.stdout
    bad = weir("replay", "--stream", "NOPE", "--subject", "x.y", "--since", future, env=stack_env)
    assert bad.returncode == 2 and "no stream" in bad.stdout


async def test_replay_delivers_the_slice_through_its_publisher(stack_env: dict[str, str], nc: NATS) -> None:
    """`weir replay` publishes each copy on replay.<consumer>.<type>, JetStream-acknowledged, with its headers."""
    import asyncio

    js = nc.jetstream()
    async with replayable_reader(js, "VIDEOS", "video.created", "cli_replay") as durable:
        since = datetime.now(UTC).isoformat()
        event = video_created()
        written_by = "0.9.0"  # a release other than this one: the copy names the release that wrote the event
        await js.publish(event.type, event.to_bytes(), headers={HDR_MSG_ID: event.id, HDR_VERSION: written_by})
        result = await asyncio.to_thread(weir, "replay", "--stream", "VIDEOS", "--subject", "video.created",
                                         "--since", since, "--to", durable, "--reprocess", env=stack_env)
        assert result.returncode == 0, result.stdout + result.stderr
        assert "1 events of video.created on VIDEOS" in result.stdout and "(reprocess)" in result.stdout
        copy = await js.get_last_msg("REPLAY", replay_subject(durable, "video.created"))
        assert Envelope.from_bytes(copy.data).id == event.id and copy.headers is not None
        assert copy.headers[HDR_TYPE] == "video.created" and copy.headers[HDR_REPROCESS] == "1"
        assert copy.headers[HDR_MSG_ID].startswith("replay-") and copy.headers[HDR_VERSION] == written_by


async def test_replay_refuses_a_slice_that_selects_nothing_and_a_reader_that_takes_no_copy(
        stack_env: dict[str, str], nc: NATS) -> None:
    """Typos are said, not answered "0 events": a subject no contract has, an event type kept on another stream, an
    end before the start, a consumer that does not read the type; a reader without a replay durable (an operator's
    publisher durable) is named and skipped by default, refused when named."""
    import asyncio

    since = datetime.now(UTC).isoformat()
    earlier = (datetime.now(UTC) - timedelta(hours=1)).isoformat()

    async def replay(*args: str) -> subprocess.CompletedProcess[str]:
        return await asyncio.to_thread(weir, "replay", "--since", since, *args, env=stack_env)

    refusals = {
        ("--stream", "VIDEOS", "--subject", "nope.thing", "--dry-run"): "'nope.thing' is no event type",
        ("--stream", "ENCODE", "--subject", "upload.completed", "--dry-run"): "upload.completed events are on stream "
                                                                              "VIDEOS, not ENCODE",
        ("--stream", "VIDEOS", "--subject", "video.created", "--until", earlier): "is before --since",
        ("--stream", "VIDEOS", "--subject", "upload.completed", "--to", "encode_deletions"): "encode_deletions does "
                                                                                           "not read upload.completed",
    }
    for args, said in refusals.items():
        result = await replay(*args)
        assert result.returncode == 2 and said in result.stdout, (args, result.stdout + result.stderr)
    js = nc.jetstream()
    plain = f"cli_plain_{uuid.uuid4().hex[:10]}"  # reads video.created, takes no replays
    await js.add_consumer("VIDEOS", api.ConsumerConfig(durable_name=plain, filter_subject="video.created.*",
                                                       deliver_policy=api.DeliverPolicy.NEW,
                                                       ack_policy=api.AckPolicy.EXPLICIT))
    try:
        dry = await replay("--stream", "VIDEOS", "--subject", "video.created", "--dry-run")
        assert dry.returncode == 0 and f"not to {plain}" in dry.stdout.replace("\n", ""), dry.stdout
        named = await replay("--stream", "VIDEOS", "--subject", "video.created", "--to", plain)
        assert named.returncode == 2 and f"{plain} takes no replays" in named.stdout, named.stdout
    finally:
        await js.delete_consumer("VIDEOS", plain)


def test_events_check_passes_on_the_committed_catalog() -> None:
    result = weir("events", "check")
    assert result.returncode == 0, result.stdout + result.stderr


async def test_accounts_apps_and_keys_from_the_cli(stack_env: dict[str, str], prepared: CommonSettings) -> None:
    import asyncio

    from tests.integration.authhelpers import auth_instances

    async with auth_instances(prepared):
        def run(*args: str) -> subprocess.CompletedProcess[str]:
            return weir(*args, env={**stack_env, "COLUMNS": "200"})

        created = await asyncio.to_thread(run, "accounts", "create", "cli-acct")
        assert created.returncode == 0, created.stdout + created.stderr
        token = created.stdout.split("account token (shown once): ")[1].split()[0]
        assert token.startswith("wat_")
        app = await asyncio.to_thread(run, "apps", "create", "cli-app", "--account-token", token)
        assert app.returncode == 0, app.stdout + app.stderr
        made = json.loads(app.stdout)
        assert made["secret_key"].startswith("wsk_") and made["publishable_key"].startswith("wpk_")
        rotated = await asyncio.to_thread(run, "keys", "rotate", made["id"], "--account-token", token)
        assert rotated.returncode == 0 and json.loads(rotated.stdout)["secret_key"] != made["secret_key"]
        listed = await asyncio.to_thread(run, "keys", "list", made["id"], "--account-token", token)
        assert listed.returncode == 0 and made["secret_key_id"] in listed.stdout
        assert made["secret_key"] not in listed.stdout  # prefixes only
        narrow = await asyncio.to_thread(weir, "keys", "list", made["id"], "--account-token", token,
                                         env={**stack_env, "COLUMNS": "60"})
        assert made["secret_key_id"] in narrow.stdout  # whole even so, to copy into `weir keys revoke`
        as_json = await asyncio.to_thread(run, "keys", "list", made["id"], "--account-token", token, "--json")
        assert made["secret_key_id"] in {k["id"] for k in json.loads(as_json.stdout)["keys"]}
        revoked = await asyncio.to_thread(run, "keys", "revoke", json.loads(rotated.stdout)["secret_key_id"],
                                          "--account-token", token)
        assert revoked.returncode == 0 and "revoked" in revoked.stdout
        refused = await asyncio.to_thread(run, "apps", "create", "x", "--account-token", "wat_" + "0" * 32)
        assert refused.returncode == 2 and "invalid_credential" in refused.stdout


async def test_the_clis_refused_tokens_do_not_spend_the_local_addresss_budget(
        stack_env: dict[str, str], prepared: CommonSettings) -> None:
    """The CLI's management calls are limited under an address key of their own: its rejected account tokens refuse
    its own next calls (429), never the requests of 127.0.0.1 (a browser on the operator's machine, an edge)."""
    import asyncio

    from shared.authcheck import CheckRequest
    from shared.authclient import check, create_account_with_app
    from shared.bus import connect
    from tests.integration.authhelpers import auth_instances

    budget = 2
    async with auth_instances(prepared, limit_auth_failure_per_minute=budget):
        nc = await connect(prepared, name="test-cli-peer")
        try:
            account, _ = await create_account_with_app(nc, "cli-peer")
            answers = [await asyncio.to_thread(weir, "apps", "create", "x", "--account-token", "wat_" + "1" * 32,
                                               env={**stack_env, "COLUMNS": "300"}) for _ in range(budget + 1)]
            assert [a.returncode for a in answers] == [2] * (budget + 1), [a.stdout for a in answers]
            assert "rate_limited" in answers[-1].stdout, answers[-1].stdout
            local = await check(nc, CheckRequest(authorization=f"Bearer {account.account_token}", peer="127.0.0.1",
                                                 route_class="management", route="GET /v1/apps"))
            assert local.allowed, local
        finally:
            await nc.close()


def test_a_command_finds_a_stack_elsewhere_by_weir_stack(stack_env: dict[str, str], prepared: CommonSettings,
                                                          tmp_path: Path) -> None:
    """`weir up --data-dir D` writes D/stack.json: a command run from anywhere reads it through WEIR_STACK."""
    (tmp_path / "stack.json").write_text(json.dumps({"nats_url": stack_env["WEIR_NATS_URL"]}))
    env = {k: v for k, v in stack_env.items() if k != "WEIR_NATS_URL"}
    future = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
    args = ("replay", "--stream", "VIDEOS", "--subject", "video.created", "--since", future, "--dry-run")
    found = subprocess.run([sys.executable, "-m", "weir.cli", *args], capture_output=True, text=True, timeout=120,
                           cwd=tmp_path.parent, env={**clean_env(), **env, "PYTHONPATH": ROOT,
                                                     "WEIR_STACK": str(tmp_path / "stack.json")})
    assert found.returncode == 0 and "0 events of video.created" in found.stdout, found.stdout + found.stderr


@pytest.mark.parametrize("command", [
    ("accounts", "create", "nobody"), ("streams", "apply"),
    ("replay", "--stream", "VIDEOS", "--subject", "video.created", "--since", "2026-01-01T00:00:00Z", "--dry-run"),
    ("rebuild", "api-status"),
])
def test_a_command_with_no_stack_says_so_at_once(tmp_path: Path, command: tuple[str, ...]) -> None:
    """No NATS (nor PostgreSQL) where the command looks: a one-line reason and exit 1 within seconds, never
    retrying for ever, no traceback."""
    ports = []
    for _ in range(2):  # ports nothing listens on
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    url = f"nats://127.0.0.1:{ports[0]}"
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "weir.cli", *command], capture_output=True,
                            text=True, timeout=60, cwd=tmp_path,
                            env={**clean_env(), "PYTHONPATH": ROOT, "WEIR_NATS_URL": url, "COLUMNS": "300",
                                 "WEIR_DATABASE_URL": f"postgresql://weir@127.0.0.1:{ports[1]}/weir"})
    assert result.returncode == 1, result.stdout + result.stderr
    said = "PostgreSQL does not answer" if command[0] == "rebuild" else f"NATS does not answer at {url}"
    assert said in result.stdout and "WEIR_STACK" in result.stdout, result.stdout
    assert "Traceback" not in result.stdout + result.stderr
    assert "Connect call failed" not in result.stderr, result.stderr  # said once, by the command
    assert time.monotonic() - started < 30


def test_trace_finds_the_traces_of_a_stack_elsewhere(tmp_path: Path) -> None:
    """`weir up --data-dir D` has its services write D/traces: `weir trace` looks there through WEIR_STACK."""
    (tmp_path / "stack.json").write_text("{}")
    result = subprocess.run([sys.executable, "-m", "weir.cli", "trace", str(uuid.uuid4())], capture_output=True,
                            text=True, timeout=60, env={**clean_env(), "PYTHONPATH": ROOT,
                                                        "WEIR_STACK": str(tmp_path / "stack.json")})
    assert result.returncode == 1 and f"no trace files in {tmp_path / 'traces'}" in result.stderr, result.stderr


def clean_env() -> dict[str, str]:
    """This process's environment without Weir's own variables (a command finds the stack by itself)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("WEIR_")}


ROOT = str(Path(__file__).resolve().parents[2])
