"""Calling auth over NATS: `auth.check` for edges, and the management operations for the api and the CLI.

One path: nats-py's own request, on the process's one connection. (A reply inbox of Weir's own saved 17 us of CPU
per check in process, but made no measurable difference to the api figure: bench/RESULTS.md, issue 12.) auth
answers each request with its reply model, or with an `ErrorReply` (`{"error": {status, code, detail}}`) that
arrives here as `AuthError`; a request nobody answers is nats-py's TimeoutError or NoRespondersError.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

from faststream.nats import NatsBroker
from nats.aio.client import Client as NATS
from pydantic import BaseModel

from shared.authcheck import (
    CHECK_SUBJECT,
    MANAGE_OPERATIONS,
    AccountCreated,
    AppCreated,
    CheckReply,
    CheckRequest,
    CreateAccount,
    CreateApp,
    ManageError,
    manage_subject,
)
from shared.messaging import ErrorReply

M = TypeVar("M", bound=BaseModel)
_ERROR = b'{"error"'  # every error reply starts so (ErrorReply's only field); no reply model has that field


class AuthError(Exception):
    """auth answered with a refusal or an error (status, code, detail)."""

    def __init__(self, error: ManageError) -> None:
        super().__init__(f"{error.status} {error.code}: {error.detail}")
        self.error = error


def _refused(data: bytes) -> AuthError | None:
    if data.startswith(_ERROR):
        return AuthError(ErrorReply.model_validate_json(data).error)
    return None


async def check(nc: NATS, request: CheckRequest, *, timeout: float = 2.0) -> CheckReply:
    return await check_payload(nc, request.model_dump_json().encode(), timeout=timeout)


async def check_payload(nc: NATS, payload: bytes, *, timeout: float = 2.0) -> CheckReply:
    """`check` for an edge that encodes the CheckRequest itself (the api's guard, once per HTTP request)."""
    msg = await nc.request(CHECK_SUBJECT, payload, timeout=timeout)
    return check_reply(msg.data)


def check_reply(data: bytes) -> CheckReply:
    """auth.check's answer: a CheckReply, or AuthError when auth could not decide."""
    refused = _refused(data)
    if refused is not None:
        raise refused
    return CheckReply.model_validate_json(data)


async def manage(nc: NATS, operation: str, request: BaseModel, result: type[M], *, timeout: float = 5.0) -> M:
    """One management operation (`shared.authcheck.MANAGE_OPERATIONS`): its reply as `result`, or AuthError."""
    return result.model_validate_json(await _manage(nc, operation, request, timeout))


async def manage_raw(nc: NATS, operation: str, request: BaseModel, *, timeout: float = 5.0) -> Any:
    """`manage` for a caller that wants the reply as JSON values, not a model."""
    return json.loads(await _manage(nc, operation, request, timeout))


async def _manage(nc: NATS, operation: str, request: BaseModel, timeout: float) -> bytes:
    msg = await nc.request(manage_subject(operation), request.model_dump_json().encode(), timeout=timeout)
    refused = _refused(msg.data)
    if refused is not None:
        raise refused
    data: bytes = msg.data
    return data


async def create_account_with_app(
    nc: NATS, name: str, *, allowed_origins: tuple[str, ...] = ()
) -> tuple[AccountCreated, AppCreated]:
    """A new account (its first user and account token) and one app with its key pair."""
    account = await manage(nc, "account.create", CreateAccount(name=name), AccountCreated)
    app = await manage(nc, "app.create", CreateApp(user_id=account.user_id, account_id=account.account_id, name=name,
                                                   allowed_origins=allowed_origins), AppCreated)
    return account, app


def declare_auth_requests(broker: NatsBroker) -> None:
    """What an edge asks auth, in the edge's AsyncAPI document: `auth.check` and each `auth.manage.<op>` with its
    request's schema (the calls themselves go over nats-py's request above, one per API request)."""
    broker.publisher(CHECK_SUBJECT, title=f"{CHECK_SUBJECT}:request", schema=CheckRequest,
                     description="request/reply: answered with CheckReply, or ErrorReply when auth cannot decide")
    for operation, (request, reply) in MANAGE_OPERATIONS.items():
        subject = manage_subject(operation)
        broker.publisher(subject, title=f"{subject}:request", schema=request,
                         description=f"request/reply: answered with {reply.__name__}, or ErrorReply")
