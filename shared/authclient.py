"""Calling auth over NATS: `auth.check` for edges, and the management operations for the api and the CLI."""

from __future__ import annotations

import asyncio
import itertools
import json
import weakref
from typing import Any, TypeVar

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
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
from shared.natswire import WireConnection

M = TypeVar("M", bound=BaseModel)


class AuthError(Exception):
    """auth answered with a refusal or an error (status, code, detail)."""

    def __init__(self, error: ManageError) -> None:
        super().__init__(f"{error.status} {error.code}: {error.detail}")
        self.error = error


async def check(nc: NATS, request: CheckRequest, *, timeout: float = 2.0) -> CheckReply:
    return await check_payload(nc, request.model_dump_json().encode(), timeout=timeout)


async def check_payload(nc: NATS, payload: bytes, *, timeout: float = 2.0) -> CheckReply:
    """`check` for an edge that encodes the CheckRequest itself (the api's guard, once per HTTP request)."""
    msg = await _inbox_of(nc).request(nc, CHECK_SUBJECT, payload, timeout)
    return check_reply(msg.data)


async def check_payload_wire(wire: WireConnection, payload: bytes, *, timeout: float = 2.0) -> CheckReply:
    """`check_payload` over the lean connection (shared/natswire.py); its errors are WireError's."""
    return check_reply(await wire.request(CHECK_SUBJECT, payload, timeout))


def check_reply(data: bytes) -> CheckReply:
    """auth.check's answer: a CheckReply, or AuthError when auth could not decide."""
    if data.startswith(b'{"error"'):
        raise AuthError(ManageError.model_validate(json.loads(data)["error"]))
    return CheckReply.model_validate_json(data)


class _ReplyInbox:
    """nc.request's shared-inbox pattern for the per-request hot path, without its per-request costs: a counter for
    the reply token (nats-py adds a NUID and two random bytes, one getrandom syscall per request) and one timer
    instead of asyncio.wait_for. Errors are nc.request's: nats TimeoutError, NoRespondersError."""

    def __init__(self) -> None:  # no reference to the connection: it is the key of `_inboxes`, a weak one
        self.prefix = ""
        self.waiting: dict[str, asyncio.Future[Msg]] = {}
        self.tokens = itertools.count()
        self.ready = False
        self.subscribing: asyncio.Future[None] | None = None

    async def _subscribe(self, nc: NATS) -> None:
        # the prefix is a fresh inbox (random, like nc.request's); the counter only tells this inbox's replies apart
        prefix = nc.new_inbox() + "."
        await nc.subscribe(prefix + "*", cb=self._on_reply)
        self.prefix, self.ready = prefix, True

    async def _ensure_subscribed(self, nc: NATS) -> None:
        if self.subscribing is None:
            self.subscribing = asyncio.ensure_future(self._subscribe(nc))
        try:
            await asyncio.shield(self.subscribing)
        finally:
            if not self.ready and self.subscribing.done():
                self.subscribing = None  # it failed: the next request tries again

    async def _on_reply(self, msg: Msg) -> None:
        future = self.waiting.get(msg.subject[len(self.prefix):])
        if future is not None and not future.done():
            future.set_result(msg)

    async def request(self, nc: NATS, subject: str, payload: bytes, timeout: float) -> Msg:
        if not self.ready:
            await self._ensure_subscribed(nc)
        token = str(next(self.tokens))
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Msg] = loop.create_future()
        self.waiting[token] = future
        timer = loop.call_later(timeout, _expire, future)
        try:
            await nc.publish(subject, payload, reply=self.prefix + token)
            msg = await future
        finally:
            timer.cancel()
            del self.waiting[token]
        if msg.headers and msg.headers.get("Status") == "503":
            raise NoRespondersError
        return msg


def _expire(future: asyncio.Future[Msg]) -> None:
    if not future.done():
        future.set_exception(NatsTimeoutError())


_inboxes: weakref.WeakKeyDictionary[NATS, _ReplyInbox] = weakref.WeakKeyDictionary()


def _inbox_of(nc: NATS) -> _ReplyInbox:
    inbox = _inboxes.get(nc)
    if inbox is None:
        inbox = _inboxes[nc] = _ReplyInbox()
    return inbox


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
