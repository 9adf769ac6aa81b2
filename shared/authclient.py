"""Calling auth over NATS: `auth.check` for edges, and the management operations for the api and the CLI."""

from __future__ import annotations

import json
from typing import Any, TypeVar

from nats.aio.client import Client as NATS
from pydantic import BaseModel

from shared.authcheck import (
    CHECK_SUBJECT,
    MANAGE_PREFIX,
    AccountCreated,
    AppCreated,
    CheckReply,
    CheckRequest,
    CreateAccount,
    CreateApp,
    ManageError,
)

M = TypeVar("M", bound=BaseModel)


class AuthError(Exception):
    """auth answered with a refusal or an error (status, code, detail)."""

    def __init__(self, error: ManageError) -> None:
        super().__init__(f"{error.status} {error.code}: {error.detail}")
        self.error = error


async def check(nc: NATS, request: CheckRequest, *, timeout: float = 2.0) -> CheckReply:
    msg = await nc.request(CHECK_SUBJECT, request.model_dump_json().encode(), timeout=timeout)
    if msg.data.startswith(b'{"error"'):
        raise AuthError(ManageError.model_validate(json.loads(msg.data)["error"]))
    return CheckReply.model_validate_json(msg.data)


async def manage(nc: NATS, operation: str, request: BaseModel, result: type[M], *, timeout: float = 5.0) -> M:
    raw = await manage_raw(nc, operation, request, timeout=timeout)
    return result.model_validate(raw)


async def manage_raw(nc: NATS, operation: str, request: BaseModel, *, timeout: float = 5.0) -> Any:
    msg = await nc.request(f"{MANAGE_PREFIX}.{operation}", request.model_dump_json().encode(), timeout=timeout)
    body = json.loads(msg.data)
    if not body.get("ok"):
        raise AuthError(ManageError.model_validate(body["error"]))
    return body["result"]


async def create_account_with_app(
    nc: NATS, name: str, *, allowed_origins: tuple[str, ...] = ()
) -> tuple[AccountCreated, AppCreated]:
    """A new account (its first user and account token) and one app with its key pair."""
    account = await manage(nc, "account.create", CreateAccount(name=name), AccountCreated)
    app = await manage(nc, "app.create", CreateApp(user_id=account.user_id, account_id=account.account_id, name=name,
                                                   allowed_origins=allowed_origins), AppCreated)
    return account, app
