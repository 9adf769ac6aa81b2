"""The `weir` commands an operator runs: config, streams apply, migrate, replay, events check."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta

from services.auth.settings import AuthSettings
from shared.settings import CommonSettings
from shared.streams import STREAMS


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
    assert {r["service"] for r in rows} == {"auth", "api", "encode", "media", "sweep"}


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
        revoked = await asyncio.to_thread(run, "keys", "revoke", json.loads(rotated.stdout)["secret_key_id"],
                                          "--account-token", token)
        assert revoked.returncode == 0 and "revoked" in revoked.stdout
        refused = await asyncio.to_thread(run, "apps", "create", "x", "--account-token", "wat_" + "0" * 32)
        assert refused.returncode == 2 and "invalid_credential" in refused.stdout
