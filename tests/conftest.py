"""The session's real servers: the same devstack code `weir up` uses, on free ports in a temp dir."""

from __future__ import annotations

import contextlib
import os
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import asyncpg
import pytest
from nats.aio.client import Client as NATS
from rich.console import Console

from shared import db
from shared.bus import connect
from shared.devstack.addresses import StackAddresses
from shared.devstack.stack import DevStack
from shared.identities import Identity, Right
from shared.settings import CommonSettings
from tests import secretlogs
from tests.secretlogs import pytest_sessionfinish, secret_log_roots  # noqa: F401  (no secret in any log line)
from weir.up import prepare

# the suite's own clients play every party (a forged event, a stream read, a manage request): one identity that may
# do anything, which only tests have. Services never use it: each connects as itself.
HARNESS = Identity(name="harness", role="harness", description="the test suite's own clients",
                   publish=(Right(">", "tests publish as anyone"),), subscribe=(Right(">", "tests read anything"),),
                   responds=True)


@pytest.fixture
def wide_console(monkeypatch: pytest.MonkeyPatch) -> None:
    """`weir contracts` run in-process (CliRunner) prints 240 columns wide. A rich Console fixes its width when it is
    made, at import, from that moment's COLUMNS (CI's is 80), so a COLUMNS given to invoke() would not count."""
    from weir import contracts_cli
    monkeypatch.setattr(contracts_cli, "console", Console(width=240))


@pytest.fixture(scope="session")
def stack() -> Iterator[StackAddresses]:
    """Embedded servers; or, with WEIR_TEST_EXTERNAL=1, the servers named by WEIR_NATS_URL and friends."""
    if os.environ.get("WEIR_TEST_EXTERNAL") == "1":
        ext = CommonSettings()
        yield StackAddresses(
            nats_url=ext.nats_url, database_url=ext.database_url, s3_endpoint=ext.s3_endpoint,
            s3_bucket=ext.s3_bucket, s3_access_key=ext.s3_access_key,
            s3_secret_key=ext.s3_secret_key.get_secret_value(), s3_region=ext.s3_region,
        )
        return
    with tempfile.TemporaryDirectory(prefix="weir-test-") as tmp:
        # NATS with every identity's permissions on (shared/identities.py): a service process started with
        # stack_env connects as itself; the suite's own clients are `harness`
        dev = DevStack(Path(tmp) / "servers", durable=False, nats_identities_dir=Path(tmp) / "nats",
                       harness_identities=(HARNESS,))
        try:
            addresses = dev.start()
            _register_secrets(addresses)
            yield addresses
        finally:
            dev.stop()


def _register_secrets(stack: StackAddresses) -> None:
    """The stack's own secrets, which no log line of the run may show (tests/secretlogs.py)."""
    secretlogs.register_secret(stack.s3_secret_key, "the storage's secret key")
    password = asyncpg_password(stack.database_url)
    secretlogs.register_secret(password, "the database password")
    for name, seed_file in stack.nats_identities.items():
        secretlogs.register_secret(Path(seed_file).read_text().strip(), f"the NATS seed of {name}")


def asyncpg_password(url: str) -> str | None:
    from urllib.parse import urlsplit

    return urlsplit(url.split(",")[0]).password


def seeds_dir(stack: StackAddresses) -> str:
    """Where the session's identities' seeds are ("" when NATS lets anyone in: external servers)."""
    return str(Path(next(iter(stack.nats_identities.values()))).parent) if stack.nats_identities else ""


@pytest.fixture(scope="session")
def stack_env(stack: StackAddresses) -> dict[str, str]:
    """The variables a service process needs to reach the session's servers: `python -m services.<name>` connects
    to NATS as `<name>`, the `weir` CLI as `operator` (their seeds from WEIR_NATS_NKEY_SEED_DIR)."""
    return {
        "WEIR_NATS_NKEY_SEED_DIR": seeds_dir(stack),
        "WEIR_NATS_URL": stack.nats_url,
        "WEIR_DATABASE_URL": stack.database_url,
        "WEIR_S3_ENDPOINT": stack.s3_endpoint,
        "WEIR_S3_BUCKET": stack.s3_bucket,
        "WEIR_S3_ACCESS_KEY": stack.s3_access_key,
        "WEIR_S3_SECRET_KEY": stack.s3_secret_key,
        "WEIR_S3_REGION": stack.s3_region,
        # every api instance takes due imports from the shared videos table: the session's apis take none, so that
        # a test's imports are taken by its own module's apis, with its settings (tests/integration/test_imports.py)
        "WEIR_IMPORT_CONCURRENCY": "0",
    }


@pytest.fixture(scope="session")
def settings(stack: StackAddresses) -> CommonSettings:
    return CommonSettings(
        nats_nkey_seed_dir=seeds_dir(stack),
        nats_identity=HARNESS.name if stack.nats_identities else "",
        nats_url=stack.nats_url,
        database_url=stack.database_url,
        s3_endpoint=stack.s3_endpoint,
        s3_bucket=stack.s3_bucket,
        s3_access_key=stack.s3_access_key,
        s3_secret_key=stack.s3_secret_key,  # type: ignore[arg-type]
        s3_region=stack.s3_region,
    )


@pytest.fixture(scope="session")
async def prepared(settings: CommonSettings) -> CommonSettings:
    """Streams applied, every service migrated, bucket present: what `weir up` does before services start."""
    await prepare(settings)
    return settings


@pytest.fixture
async def nc(prepared: CommonSettings) -> AsyncIterator[NATS]:
    client = await connect(prepared, name="test")
    yield client
    await client.close()


@contextlib.asynccontextmanager
async def fresh_schema(database_url: str, service: str, max_size: int = 10) -> AsyncIterator[tuple[str, asyncpg.Pool]]:
    """A fresh schema migrated as `service`'s (its own tables and the bus's outbox and inbox), and a pool on it."""
    schema = f"t_{uuid.uuid4().hex[:12]}"
    conn = await asyncpg.connect(database_url)
    try:
        await db.migrate(conn, service, schema=schema)
    finally:
        await conn.close()
    pool = await db.create_pool(database_url, schema=schema, max_size=max_size)
    try:
        yield schema, pool
    finally:
        await pool.close()


@pytest.fixture
async def schema_pool(prepared: CommonSettings) -> AsyncIterator[tuple[str, asyncpg.Pool]]:
    """A fresh schema with the bus tables (outbox, inbox), as any service has, and a pool on it."""
    async with fresh_schema(prepared.database_url, "bustest") as made:
        yield made


FAULTS = Path(__file__).parent / "faults"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The fault tests (tests/faults) are marked `faults`: `make test` runs them after the rest, one at a time, since
    each kills servers under load and bounds the recovery in time (the rest runs in two workers)."""
    for item in items:
        if item.path.is_relative_to(FAULTS):
            item.add_marker(pytest.mark.faults)


def pytest_configure(config: pytest.Config) -> None:
    os.environ.setdefault("WEIR_LOG_LEVEL", "WARNING")
