"""Calling auth over NATS: `auth.check` for edges, and the management operations for the api and the CLI.

Everything goes over the process's one nats-py connection: an edge's checks through `CheckSender` (a reply inbox of
its own, the one path on the api's every request), the management operations and the CLI's checks through nats-py's
request. auth answers each request with its reply model, or with an `ErrorReply` (`{"error": {status, code,
detail}}`) that arrives here as `AuthError`; a request nobody answers is a TimeoutError or NoRespondersError.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from faststream.nats import NatsBroker
from nats.aio.client import NO_RESPONDERS_STATUS
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.errors import NoRespondersError
from nats.js import api
from pydantic import BaseModel, TypeAdapter, ValidationError

from shared import natsconn
from shared.authcheck import (
    CHECK_SUBJECT,
    MANAGE_OPERATIONS,
    RESENDABLE_OPERATIONS,
    SENT_AT_HEADER,
    AccountCreated,
    AppCreated,
    CheckDecision,
    CheckReply,
    CheckRequest,
    CreateAccount,
    CreateApp,
    manage_subject,
)
from shared.bus import VERSION_HEADER
from shared.messaging import RequestRefused, ask, read_reply, refusal_in, unreadable_reply
from shared.natsconn import ConnectionWatch, PermissionRefused, connection_number, lost_in_reconnect

M = TypeVar("M", bound=BaseModel)
_ERROR = b'{"error"'  # every error reply starts so (ErrorReply's only field); no reply model has that field


class AuthError(RequestRefused):
    """auth answered with a refusal or an error (status, code, detail)."""


def _refused(data: bytes, subject: str = CHECK_SUBJECT, headers: Mapping[str, str] | None = None
             ) -> AuthError | None:
    error = refusal_in(data, subject, headers)
    return None if error is None else AuthError(error)


async def check(nc: NATS, request: CheckRequest, *, timeout: float = 2.0) -> CheckReply:
    return await check_payload(nc, request.model_dump_json().encode(), timeout=timeout)


async def check_payload(nc: NATS, payload: bytes, *, timeout: float = 2.0) -> CheckReply:
    """`check` for an edge that encodes the CheckRequest itself (the api's guard, once per HTTP request)."""
    msg = await nc.request(CHECK_SUBJECT, payload, timeout=timeout, headers=VERSION_HEADER)
    return check_reply(msg.data, msg.headers)


def sends_while_reconnecting(down_since: float, now: float, budget: float) -> bool:
    """A check made while the connection is being made again is sent (nats-py holds it and sends it on the new
    connection) during the first `budget` seconds since the edge saw the connection down (`down_since`); later ones
    fail at once rather than each wait out its budget while NATS stays away."""
    return now - down_since < budget


def _check_headers() -> dict[str, str]:
    """A check's headers: the edge's release, and when it is sent (auth counts the check's wait from it)."""
    return {**VERSION_HEADER, SENT_AT_HEADER: str(int(time.time() * 1000))}


class _Check:
    """A check waiting for its reply: what to send again if its connection drops, and on which connection it went."""

    __slots__ = ("future", "payload", "retried", "sent_on")

    def __init__(self, future: asyncio.Future[Msg], payload: bytes, sent_on: int) -> None:
        self.future = future
        self.payload = payload
        self.sent_on = sent_on
        self.retried = False


class CheckSender:
    """An edge's `auth.check` calls (the api's guard: one per HTTP request), answered on a reply inbox of its own.

    A check costs a future and one publish: the replies arrive on one subscription under the identity's inbox
    prefix, and the checks' deadlines are kept in order and expired by one timer rather than a timer each (a check
    fails between `timeout` and `timeout` plus a tenth of it, at most 100 ms more). When the server refuses the
    subject to this identity, the connection's watch fails the waiting checks at once.

    A node of the cluster dying drops the connection and the replies in flight on it (SPEC 15): at the reconnect
    (the watch's hook) the checks still waiting that went out on the old connection are sent once more, within what
    is left of their own deadline, and so are those made while reconnecting (nats-py holds them for the new one, but
    may still write them to the dead socket: `connection_number`). One still unanswered a quarter of its budget
    after that is sent a last time (a reply can still miss a connection made a moment ago, about 1 in 10 kills of
    a node in tests/faults/test_overload_node_loss.py before): the first answer is taken, a later one dropped.
    """

    def __init__(self, nc: Callable[[], NATS | None], *, timeout: float,
                 watch: Callable[[], ConnectionWatch | None] = lambda: None) -> None:
        self.nc = nc
        self.watch = watch  # the connection's refusals and reconnects
        self.timeout = timeout
        self._waiting: dict[str, _Check] = {}
        self._down_since: float | None = None  # when a check first found the connection down (None: it is up)
        self._hooked: ConnectionWatch | None = None  # the watch whose reconnects send lost checks again
        self._deadlines: deque[tuple[float, str]] = deque()  # in the order the checks were sent: deadlines ascend
        self._expiry: asyncio.TimerHandle | None = None
        self._inbox: str | None = None
        self._inbox_of: NATS | None = None
        self._refusal: asyncio.Future[None] | None = None  # registered with `_refusal_of`, failed when it refuses
        self._refusal_of: ConnectionWatch | None = None
        self._next = 0
        self._again: set[asyncio.Task[None]] = set()  # the last sendings scheduled after a reconnect

    async def check(self, payload: bytes) -> tuple[CheckDecision, dict[str, str]]:
        """auth's decision and limit headers for one encoded CheckRequest (TimeoutError, NatsError,
        NoRespondersError, AuthError or PermissionRefused when there is none)."""
        nc = self.nc()
        loop = asyncio.get_running_loop()
        if nc is None or not self._may_send(nc, loop.time()):
            raise NatsError("no NATS connection")
        inbox = self._inbox if self._inbox_of is nc else await self._subscribe(nc)
        future: asyncio.Future[Msg] = loop.create_future()
        self._next += 1
        token = str(self._next)
        self._waiting[token] = _Check(future, payload, connection_number(nc))
        deadline = loop.time() + self.timeout
        self._deadlines.append((deadline, token))
        if self._expiry is None:
            self._expiry = loop.call_at(deadline, self._expire, loop)
        watch = self.watch()
        if watch is not self._refusal_of or self._refusal is None or self._refusal.done():
            self._watch_refusals(watch, loop)
        if watch is not self._hooked and watch is not None:
            watch.on_reconnect(self._send_lost_again)
            self._hooked = watch
        try:
            await nc.publish(CHECK_SUBJECT, payload, reply=f"{inbox}.{token}",
                             headers=_check_headers())
            reply = await future
            return check_decision(reply.data, reply.headers)
        finally:
            del self._waiting[token]

    def _may_send(self, nc: NATS, now: float) -> bool:
        if nc.is_connected:
            self._down_since = None
            return True
        # nats-py passes through CONNECTING while it makes the new connection (each attempt's handshake) and holds
        # what is published then as well; closed (or never connected): nothing will send it
        if not (nc.is_reconnecting or nc.is_connecting):
            return False
        if self._down_since is None:
            self._down_since = now
        return sends_while_reconnecting(self._down_since, now, self.timeout)

    async def _send_lost_again(self) -> None:
        """At a reconnect: send once more each waiting check whose reply was lost with the old connection, to the
        same reply subject, under its own deadline (the one expiry timer still fails it when that passes)."""
        nc = self.nc()
        if nc is None or self._inbox_of is not nc:  # another connection's inbox: nothing of this one waits
            return
        self._down_since = None
        reconnects = int(nc.stats["reconnects"])
        lost = [token for token, check in self._waiting.items()
                if lost_in_reconnect(check.sent_on, reconnects, check.retried) and not check.future.done()]
        sent = await self._publish_again(nc, lost, first=True)
        if sent:
            asyncio.get_running_loop().call_later(self.timeout / 4, self._send_unanswered_again, sent)

    def _send_unanswered_again(self, tokens: list[str]) -> None:
        task = asyncio.ensure_future(self._send_last_time(tokens))
        self._again.add(task)
        task.add_done_callback(self._again.discard)

    async def _send_last_time(self, tokens: list[str]) -> None:
        nc = self.nc()
        if nc is not None and nc.is_connected and self._inbox_of is nc:
            await self._publish_again(nc, tokens, first=False)

    async def _publish_again(self, nc: NATS, tokens: list[str], *, first: bool) -> list[str]:
        """Send again, to the same reply subject, each of `tokens` still waiting (its deadline stays the first
        sending's); `first`: the sending at the reconnect, which marks the check retried. Returns what was sent."""
        sent = []
        for token in tokens:
            check = self._waiting.get(token)
            if check is None or check.future.done():
                continue
            if first:
                check.retried = True
                check.sent_on = connection_number(nc)
            try:
                # sent now: what auth must not count as queueing is the time the connection was away
                await nc.publish(CHECK_SUBJECT, check.payload, reply=f"{self._inbox}.{token}",
                                 headers=_check_headers())
            except NatsError:  # dropped again, or closed: the rest wait out their deadlines
                break
            sent.append(token)
        watch = self.watch()
        if sent and watch is not None:
            watch.count_retried(CHECK_SUBJECT, len(sent))
        return sent

    async def _subscribe(self, nc: NATS) -> str:
        inbox = nc.new_inbox()
        await nc.subscribe(f"{inbox}.*", cb=self._on_reply)
        self._inbox, self._inbox_of = inbox, nc
        return inbox

    def _watch_refusals(self, watch: ConnectionWatch | None, loop: asyncio.AbstractEventLoop) -> None:
        """One future registered with the connection's watch for all checks (rather than each check's own): when
        the server refuses auth.check to this identity, every waiting check fails at once."""
        if self._refusal is not None and self._refusal_of is not None and not self._refusal.done():
            self._refusal_of.forget(CHECK_SUBJECT, self._refusal)
        self._refusal, self._refusal_of = None, watch
        if watch is not None:
            self._refusal = loop.create_future()
            self._refusal.add_done_callback(self._fail_waiting)
            watch.fail_waiting(CHECK_SUBJECT, self._refusal)

    def _fail_waiting(self, refusal: asyncio.Future[None]) -> None:
        exc = None if refusal.cancelled() else refusal.exception()
        if not isinstance(exc, PermissionRefused):
            return
        for check in self._waiting.values():
            if not check.future.done():
                check.future.set_exception(PermissionRefused(exc.identity, exc.operation, exc.subject))

    async def _on_reply(self, msg: Msg) -> None:
        check = self._waiting.get(msg.subject.rsplit(".", 1)[1])
        if check is None or check.future.done():  # too late: it timed out (or its other reply came first)
            return
        future = check.future
        if msg.headers and msg.headers.get(api.Header.STATUS) == NO_RESPONDERS_STATUS:
            future.set_exception(NoRespondersError())
        else:
            future.set_result(msg)

    def _expire(self, loop: asyncio.AbstractEventLoop) -> None:
        """Fail the checks whose deadline has passed; come back at the next deadline, at most ten times a timeout."""
        now = loop.time()
        while self._deadlines and self._deadlines[0][0] <= now:
            _, token = self._deadlines.popleft()
            check = self._waiting.get(token)
            if check is not None and not check.future.done():
                check.future.set_exception(TimeoutError(f"auth did not answer within {self.timeout} s"))
        self._expiry = None
        if self._deadlines:
            later = max(self._deadlines[0][0], now + min(0.1, self.timeout / 10))
            self._expiry = loop.call_at(later, self._expire, loop)


def check_reply(data: bytes, headers: Mapping[str, str] | None = None) -> CheckReply:
    """auth.check's answer: a CheckReply, AuthError when auth could not decide, or UnreadableReply (`headers`: the
    reply's, naming auth's release in the log line of one that cannot be read)."""
    refused = _refused(data, CHECK_SUBJECT, headers)
    if refused is not None:
        raise refused
    return read_reply(CheckReply, data, CHECK_SUBJECT, headers)


# ---- an edge's reading of a CheckReply: the part before its headers is remembered.
# Of a reply's JSON only the rate-limit headers change from one request of an identity to the next: the one field
# CheckReply adds to CheckDecision, written last (the model's order, which auth's template follows). The rest, a
# CheckDecision, is validated once and remembered by its bytes; the headers are validated on their own. A reply not
# shaped so is validated whole.
(_HEADERS,) = CheckReply.model_fields.keys() - CheckDecision.model_fields.keys()
if list(CheckReply.model_fields)[-1] != _HEADERS:
    raise ImportError(f"CheckReply's {_HEADERS!r} must be its last field (check_decision reads it apart)")
_HEADERS_FIELD = b',"' + _HEADERS.encode() + b'":'
_LIMIT_HEADERS: TypeAdapter[dict[str, str]] = TypeAdapter(CheckReply.model_fields[_HEADERS].annotation or dict)
_REMEMBERED = 1024  # distinct decisions kept (a few per identity in use); all forgotten at once when full
_decisions: dict[bytes, CheckDecision] = {}


def check_decision(data: bytes, msg_headers: Mapping[str, str] | None = None) -> tuple[CheckDecision, dict[str, str]]:
    """auth.check's answer as its decision and its limit headers, or AuthError when auth could not decide
    (`msg_headers`: the reply message's, read only for the log line of a reply that cannot be read)."""
    cut = data.rfind(_HEADERS_FIELD)
    if cut < 0 or not data.endswith(b"}") or data.startswith(_ERROR):
        reply = check_reply(data, msg_headers)
        return reply, getattr(reply, _HEADERS)
    try:
        headers = _LIMIT_HEADERS.validate_json(data[cut + len(_HEADERS_FIELD):-1])
    except ValidationError:  # not the last field: what follows it is more than one JSON value
        reply = check_reply(data, msg_headers)
        return reply, getattr(reply, _HEADERS)
    head = data[:cut] + b"}"
    decision = _decisions.get(head)
    if decision is None:
        try:
            decision = CheckDecision.model_validate_json(head)
        except ValidationError:  # read whole, or UnreadableReply
            reply = check_reply(data, msg_headers)
            return reply, getattr(reply, _HEADERS)
        if len(_decisions) >= _REMEMBERED:
            _decisions.clear()
        _decisions[head] = decision
    return decision, headers


async def manage(nc: NATS, operation: str, request: BaseModel, result: type[M], *, timeout: float = 5.0) -> M:
    """One management operation (`shared.authcheck.MANAGE_OPERATIONS`): its reply as `result`, or AuthError
    (UnreadableReply for a reply this release cannot read)."""
    try:
        return await ask(nc, manage_subject(operation), request, result, timeout=timeout,
                         resend_if_lost=operation in RESENDABLE_OPERATIONS)
    except RequestRefused as refused:
        raise AuthError(refused.error) from None


async def manage_raw(nc: NATS, operation: str, request: BaseModel, *, timeout: float = 5.0) -> Any:
    """`manage` for a caller that wants the reply as JSON values, not a model."""
    msg = await _manage(nc, operation, request, timeout)
    try:
        return json.loads(msg.data)
    except ValueError as exc:
        raise unreadable_reply(manage_subject(operation), msg.headers, exc) from None


async def _manage(nc: NATS, operation: str, request: BaseModel, timeout: float) -> Msg:
    msg = await natsconn.request(None, nc, manage_subject(operation), request.model_dump_json().encode(),
                                 timeout=timeout, headers=dict(VERSION_HEADER),
                                 resend_if_lost=operation in RESENDABLE_OPERATIONS)
    refused = _refused(msg.data, manage_subject(operation), msg.headers)
    if refused is not None:
        raise refused
    return msg


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
    for operation, (request_model, reply) in MANAGE_OPERATIONS.items():
        subject = manage_subject(operation)
        broker.publisher(subject, title=f"{subject}:request", schema=request_model,
                         description=f"request/reply: answered with {reply.__name__}, or ErrorReply")
