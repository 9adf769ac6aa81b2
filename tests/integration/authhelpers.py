"""Auth instances in-process against the session's real NATS and PostgreSQL, and what tests do with them."""

from __future__ import annotations

import contextlib
import ipaddress
import random
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from nats.aio.client import Client as NATS

from services.auth.app import SERVICE, AuthParts
from services.auth.checker import Checker
from services.auth.settings import AuthSettings
from shared.authcheck import (
    AccountCreated,
    AppCreated,
    CheckReply,
    CheckRequest,
    MintUploadToken,
    UploadToken,
)
from shared.authclient import check, create_account_with_app, manage
from shared.runtime import Runtime, started
from shared.settings import CommonSettings

TEST_SECRETS = {
    "internal_token": secrets.token_urlsafe(32),
    "key_hash_secret": secrets.token_urlsafe(32),
    "upload_token_secret": secrets.token_urlsafe(32),
}
# windows of an hour: a test never straddles a window boundary by accident, whatever the clock says
LONG_WINDOW = 3600
# a loaded 2-core machine can make the store miss the 25 ms budget; tests of the rules must not flip to local
# windows by accident (the outage test sets its own budget)
STORE_BUDGET_MS = 2000


def auth_settings(base: CommonSettings, **overrides: Any) -> AuthSettings:
    values = {**base.model_dump(), **TEST_SECRETS, "limit_window_seconds": LONG_WINDOW,
              "counter_store_timeout_ms": STORE_BUDGET_MS, **overrides}
    values["s3_secret_key"] = base.s3_secret_key.get_secret_value()
    return AuthSettings.model_validate(values)


@contextlib.asynccontextmanager
async def auth_instances(base: CommonSettings, n: int = 1, **overrides: Any) -> AsyncIterator[list[Runtime]]:
    """`n` auth instances, each with its own connections, as `python -m services.auth` runs them."""
    settings = auth_settings(base, **overrides)
    async with contextlib.AsyncExitStack() as stack:
        # `started` returns once the server has each instance's subscriptions
        yield [await stack.enter_async_context(started(SERVICE, settings)) for _ in range(n)]


def checker(rt: Runtime) -> Checker:
    return rt.parts_of(AuthParts).checker


def fresh_address() -> str:
    """A client address no other test uses (192.0.2.0/24 and 2001:db8::/32 are for documentation)."""
    return str(ipaddress.IPv4Address(int(ipaddress.IPv4Address("10.0.0.0")) + random.randrange(1, 2**24)))


@dataclass
class DemoApp:
    account: AccountCreated
    app: AppCreated


async def new_app(nc: NATS, name: str = "app") -> DemoApp:
    account, app = await create_account_with_app(nc, f"{name}-{secrets.token_hex(4)}")
    return DemoApp(account, app)


async def mint(nc: NATS, demo: DemoApp, video_id: str) -> str:
    token = await manage(
        nc, "token.mint",
        MintUploadToken(video_id=video_id, app_id=demo.app.id, key_id=demo.app.secret_key_id), UploadToken,
    )
    return token.upload_token


def request(
    credential: str | None = None,
    *,
    peer: str,
    route_class: str = "secret",
    internal: str | None = None,
    forwarded_for: str | None = None,
    video_id: str | None = None,
    operation: str | None = None,
) -> CheckRequest:
    return CheckRequest(
        authorization=f"Bearer {credential}" if credential else None,
        internal_token=internal,
        peer=peer,
        forwarded_for=forwarded_for,
        route_class=route_class,
        route=f"test {route_class}",
        video_id=video_id,
        operation=operation,
    )


async def ask(nc: NATS, req: CheckRequest) -> CheckReply:
    return await check(nc, req, timeout=10)
