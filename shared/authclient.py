"""Calling auth over NATS: `auth.check` for edges, and the management operations for the api and the CLI.

One path: nats-py's own request, on the process's one connection. (A reply inbox of Weir's own saved 17 us of CPU
per check in process, but made no measurable difference to the api figure: bench/RESULTS.md, issue 12.) auth
answers each request with its reply model, or with an `ErrorReply` (`{"error": {status, code, detail}}`) that
arrives here as `AuthError`; a request nobody answers is nats-py's TimeoutError or NoRespondersError.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any, TypeVar

from faststream.nats import NatsBroker
from nats.aio.client import Client as NATS
from nats.errors import Error as NatsError
from nats.errors import NoRespondersError
from pydantic import BaseModel

from shared.authcheck import (
    CHECK_BATCH_SUBJECT,
    CHECK_SUBJECT,
    LINE,
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
from shared.natsconn import BusWatch, request

M = TypeVar("M", bound=BaseModel)
SINGLY_SECONDS = 30.0  # after auth.check.batch had no responders, how long checks go one by one
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


class CheckSender:
    """An edge's `auth.check` calls, with what its requests ask in one event-loop turn sent as one message.

    Under load an edge's requests reach their guard together (uvicorn starts each connection's request in the turn
    its bytes arrive); each request's payload waits only until the end of that turn, and then all of them go to
    `auth.check.batch` as one request, whose reply answers them in order. One request alone goes to `auth.check`
    as before. The point is the edge's CPU: a NATS request costs its event loop a write, a read and the wake-ups
    in between, once per batch instead of once per check (bench/RESULTS.md, issue 12). An auth that does not serve
    `auth.check.batch` yet (no responders) is asked one request at a time.
    """

    def __init__(self, nc: Callable[[], NATS | None], *, timeout: float, max_batch: int = 128,
                 watch: Callable[[], BusWatch | None] = lambda: None) -> None:
        self.nc = nc
        self.watch = watch  # the connection's refusals: a refused subject fails its checks at once
        self.timeout = timeout
        self.max_batch = max_batch
        self._waiting: list[tuple[bytes, asyncio.Future[bytes]]] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._singly_until = 0.0  # no batch responder was there: ask one at a time until then

    async def check(self, payload: bytes) -> CheckReply:
        """auth's decision for one encoded CheckRequest (TimeoutError, NatsError or AuthError when there is none)."""
        if self.max_batch == 1:
            nc = self.nc()
            if nc is None or not nc.is_connected:
                raise NatsError("no NATS connection")
            reply = await request(self.watch(), nc, CHECK_SUBJECT, payload, timeout=self.timeout)
            return check_reply(reply.data)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[bytes] = loop.create_future()
        if not self._waiting:
            loop.call_soon(self._send_waiting)
        self._waiting.append((payload, future))
        return check_reply(await future)

    def _send_waiting(self) -> None:
        waiting, self._waiting = self._waiting, []
        for start in range(0, len(waiting), self.max_batch):
            task = asyncio.ensure_future(self._send(waiting[start : start + self.max_batch]))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _send(self, batch: list[tuple[bytes, asyncio.Future[bytes]]]) -> None:
        # a subject refused to this identity fails the batch at once (BusWatch), not after the timeout
        watch = self.watch()
        if watch is not None:
            for subject in (CHECK_SUBJECT, CHECK_BATCH_SUBJECT):
                for _, future in batch:
                    watch.fail_waiting(subject, future)
        try:
            await self._ask(batch)
        finally:
            if watch is not None:
                for subject in (CHECK_SUBJECT, CHECK_BATCH_SUBJECT):
                    for _, future in batch:
                        watch.forget(subject, future)

    async def _ask(self, batch: list[tuple[bytes, asyncio.Future[bytes]]]) -> None:
        try:
            nc = self.nc()
            if nc is None or not nc.is_connected:
                raise NatsError("no NATS connection")
            if len(batch) > 1 and time.monotonic() >= self._singly_until:
                try:
                    msg = await nc.request(CHECK_BATCH_SUBJECT, LINE.join(p for p, _ in batch), timeout=self.timeout)
                except NoRespondersError:
                    self._singly_until = time.monotonic() + SINGLY_SECONDS
                else:
                    replies = msg.data.split(LINE)
                    if len(replies) != len(batch):
                        raise NatsError(f"auth answered {len(replies)} checks of {len(batch)}")
                    for (_, future), reply in zip(batch, replies, strict=True):
                        if not future.done():
                            future.set_result(reply)
                    return
            answers = await asyncio.gather(
                *(nc.request(CHECK_SUBJECT, p, timeout=self.timeout) for p, _ in batch), return_exceptions=True)
            for (_, future), answer in zip(batch, answers, strict=True):
                if future.done():
                    continue
                if isinstance(answer, BaseException):
                    future.set_exception(answer)
                else:
                    future.set_result(answer.data)
        except Exception as exc:
            for _, future in batch:
                if not future.done():
                    future.set_exception(exc)


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
    broker.publisher(CHECK_BATCH_SUBJECT, title=f"{CHECK_BATCH_SUBJECT}:request", schema=bytes,
                     description="request/reply: several CheckRequests (JSON), one per line, sent together when "
                     "they were asked in the same event-loop turn; answered by their replies, one per line, in order")
    for operation, (request_model, reply) in MANAGE_OPERATIONS.items():
        subject = manage_subject(operation)
        broker.publisher(subject, title=f"{subject}:request", schema=request_model,
                         description=f"request/reply: answered with {reply.__name__}, or ErrorReply")
