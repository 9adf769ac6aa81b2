"""Every service's messaging runtime: one FastStream `NatsBroker`, on the one nats-py connection of the process.

The broker owns the connection (`broker.connection` is the client everything else uses), runs every subscriber and
writes the AsyncAPI document. FastStream defaults changed on purpose (ENGINEERING.md): streams never declared by a
subscriber (`no_declare`), an invalid request answered at once (`ErrorReplies`), broker logs at WARNING, replies in
the AsyncAPI document (`declare_reply`), trace context only with tracing on (durable consumers, which pull with
nats-py, make their spans themselves). Tools use `tool_broker`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from typing import Any, TypeVar

import asyncpg
from faststream import BaseMiddleware, PublishCommand
from faststream.message import StreamMessage
from faststream.nats import JStream, NatsBroker
from faststream.nats.opentelemetry import NatsTelemetryMiddleware
from faststream.specification import AsyncAPI, Specification
from pydantic import BaseModel, ConfigDict, ValidationError

from shared import natsconn, tracing
from shared.bus import UNKNOWN_VERSION, VERSION_HEADER, sender_version
from shared.natsconn import ConnectionWatch, inbox_prefix
from shared.release import VERSION
from shared.settings import CommonSettings

# the tolerant closed sets, where services look for them
from shared.tolerant import FALLBACK_KEYWORD as FALLBACK_KEYWORD
from shared.tolerant import Fallback as Fallback
from shared.tolerant import unknown_as as unknown_as

log = logging.getLogger("weir.messaging")


class ReplyError(BaseModel):
    """What a request/reply handler answers instead of its reply when the request cannot be served.

    Read tolerantly: unknown fields are ignored, and `code` is an open set (a caller acts on `status`, shows `code`
    and `detail`), so a code a newer responder adds is read as it is."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    status: int
    code: str
    detail: str


class ErrorReply(BaseModel):
    """The whole reply of a refused request: `{"error": {status, code, detail}}` (unknown fields ignored)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    error: ReplyError


class UnreadableReply(RuntimeError):
    """A reply this release cannot read (a newer responder's that broke its contract, or a broken one): the caller
    answers 503, as for a responder that does not answer. `sender`: the responder's release, "unknown" before 1.1.0;
    `why`: what could not be read (fields and messages, never values)."""

    def __init__(self, subject: str, sender: str = UNKNOWN_VERSION, why: str = "") -> None:
        super().__init__(f"unreadable reply on {subject} (this release {VERSION}, the sender's {sender})"
                         + (f": {why}" if why else ""))
        self.subject = subject
        self.sender = sender
        self.why = why


M = TypeVar("M", bound=BaseModel)


def why_unreadable(exc: Exception) -> str:
    """What could not be read, for a log line: the fields and messages, never the values sent (a credential)."""
    if isinstance(exc, ValidationError):
        return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}"
                         for e in exc.errors(include_url=False, include_context=False, include_input=False)[:3])[:300]
    return f"{type(exc).__name__}: {str(exc)[:200]}"


def unreadable_reply(subject: str, headers: Mapping[str, str] | None, why: Exception | str, *,
                     outcome: str = "") -> UnreadableReply:
    """The one log line of a reply that cannot be read (the subject, this release and the sender's, what the caller
    does instead when it says, what could not be read); returns the UnreadableReply for the caller to raise."""
    sender = sender_version(headers)
    reason = why if isinstance(why, str) else why_unreadable(why)
    log.warning("unreadable reply on %s: this release %s, the sender's %s%s: %s", subject, VERSION, sender,
                f"; {outcome}" if outcome else "", reason)
    return UnreadableReply(subject, sender, reason)


def read_reply(model: type[M], data: bytes, subject: str, headers: Mapping[str, str] | None = None, *,
               outcome: str = "") -> M:
    """`data` as `model`, or UnreadableReply after one log line (`unreadable_reply`; never the reply's content).
    `headers`: the reply's, whose Weir-Version names the sender's release."""
    try:
        return model.model_validate_json(data)
    except ValidationError as exc:
        raise unreadable_reply(subject, headers, exc, outcome=outcome) from None


class RequestRefused(Exception):
    """The responder answered a refusal (`ErrorReply`): its status, code and detail, for the caller to pass on."""

    def __init__(self, error: ReplyError) -> None:
        super().__init__(f"{error.status} {error.code}: {error.detail}")
        self.error = error


_ERROR_START = b'{"error"'  # every error reply starts so (ErrorReply's only field); no reply model has that field


def refusal_in(data: bytes, subject: str, headers: Mapping[str, str] | None = None) -> ReplyError | None:
    """The refusal a reply is, or None when it is a reply (read by the caller's model)."""
    if data.startswith(_ERROR_START):
        return read_reply(ErrorReply, data, subject, headers).error
    return None


async def ask(nc: Any, subject: str, request: BaseModel, result: type[M], *, timeout: float,
              resend_if_lost: bool = False) -> M:
    """One request/reply on the process's connection (`natsconn.request`): the reply as `result`, RequestRefused
    for a refusal, UnreadableReply for what this release cannot read. `resend_if_lost` only for a read."""
    msg = await natsconn.request(None, nc, subject, request.model_dump_json().encode(), timeout=timeout,
                                 headers=dict(VERSION_HEADER), resend_if_lost=resend_if_lost)
    refused = refusal_in(msg.data, subject, msg.headers)
    if refused is not None:
        raise RequestRefused(refused)
    return read_reply(result, msg.data, subject, msg.headers)


class _ShownByCaller(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("unreadable reply on ")


@contextlib.contextmanager
def unreadable_shown_by_caller() -> Iterator[None]:
    """For a CLI that prints an UnreadableReply as its one error line: the log line would say it twice."""
    quiet = _ShownByCaller()
    log.addFilter(quiet)
    try:
        yield
    finally:
        log.removeFilter(quiet)


def error_reply(status: int, code: str, detail: str) -> ErrorReply:
    return ErrorReply(error=ReplyError(status=status, code=code, detail=detail[:2000]))


class Refused(Exception):
    """An operation's refusal of its request (status, stable code, detail), answered as its ErrorReply."""

    def __init__(self, status: int, code: str, detail: str) -> None:
        super().__init__(detail)
        self.reply = error_reply(status, code, detail)


Operand = TypeVar("Operand")
Req = TypeVar("Req", bound=BaseModel)
Rep = TypeVar("Rep", bound=BaseModel)


async def answer_on_pool(service: str, pool: Any, operation: Callable[[Operand, Any, Req], Awaitable[Rep]],
                         operand: Operand, request: Req) -> Rep | ErrorReply:
    """A request/reply operation run on one pooled connection (`operation(operand, conn, request)`). A refusal, or a
    failure, is answered at once, never left to the caller's timeout: `Refused` as itself, a value PostgreSQL cannot
    store (a NUL, say) 400 `validation_error`, anything else (the database down or failing) 503 `unavailable`."""
    try:
        async with pool.acquire() as conn:
            return await operation(operand, conn, request)
    except Refused as refusal:
        return refusal.reply
    except asyncpg.DataError as exc:
        return error_reply(400, "validation_error", f"a value cannot be stored: {type(exc).__name__}")
    except Exception as exc:
        log.exception("%s failed", operation.__name__)
        return error_reply(503, "unavailable", f"{service} could not complete {operation.__name__}: "
                                               f"{type(exc).__name__}")


def error_in(body: bytes) -> ErrorReply | None:
    """The refusal a reply carries (`{"error": ...}`), or None when the reply is not one.

    For a caller whose reply model did not validate: a refusal is an answer (the request was read and refused),
    anything else is a reply it cannot read."""
    try:
        return ErrorReply.model_validate_json(body)
    except ValidationError:
        return None


class ErrorReplies(BaseMiddleware):
    """A request whose body does not validate gets a `validation_error` reply at once (never silence).

    Only messages that expect a reply are answered; an event that fails validation is the consumer's to park."""

    async def consume_scope(
        self, call_next: Callable[[StreamMessage[Any]], Awaitable[Any]], msg: StreamMessage[Any]
    ) -> Any:
        try:
            return await call_next(msg)
        except ValidationError as exc:
            if not msg.reply_to:
                raise
            detail = str(exc.errors(include_url=False, include_context=False))
            # the values sent stay out of the log line: a request may carry a credential
            logged = str(exc.errors(include_url=False, include_context=False, include_input=False))
            log.info("refused a request on %s: %s", getattr(msg.raw_message, "subject", "?"), logged[:300])
            return error_reply(400, "validation_error", detail)


class VersionHeader(BaseMiddleware):
    """Every message the broker sends (publishes, requests, a handler's reply) carries the sender's release
    (`Weir-Version`), unless the message names one itself."""

    async def publish_scope(self, call_next: Callable[[PublishCommand], Awaitable[Any]], cmd: PublishCommand) -> Any:
        cmd.add_headers(VERSION_HEADER, override=False)
        return await call_next(cmd)


def servers(settings: CommonSettings) -> list[str]:
    return [s.strip() for s in settings.nats_url.split(",") if s.strip()]


class _NotBroken(logging.Filter):
    """FastStream logs every error the server reports as "Connection broken", with a traceback; a permissions
    violation leaves the connection up, and the connection's watch logs it (identity, subject) and counts it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "permissions violation" not in record.getMessage().lower()


def _broker_logger(name: str) -> logging.Logger:
    logger = logging.getLogger(f"weir.{name}.broker")
    if not any(isinstance(f, _NotBroken) for f in logger.filters):
        logger.addFilter(_NotBroken())
    return logger


def make_broker(settings: CommonSettings, *, name: str, identity: str | None = None,
                watch: ConnectionWatch | None = None, **kwargs: Any) -> NatsBroker:
    """The service's broker: every server of WEIR_NATS_URL, reconnecting for ever, Weir's logger at WARNING, as its
    bus identity (WEIR_NATS_NKEY_SEED, its own reply inbox prefix, TLS when configured: shared/natsconn.py), its
    errors told to `watch` (`kwargs` add to or override these options)."""
    options: dict[str, Any] = {
        "name": f"weir-{name}",
        "security": natsconn.security(settings, identity or name),
        "inbox_prefix": inbox_prefix(natsconn.identity(settings, identity or name)),
        "max_reconnect_attempts": -1,
        "reconnect_time_wait": 0.5,  # nats-py takes seconds as a float
        "graceful_timeout": settings.shutdown_grace_seconds,
        "logger": _broker_logger(name),
        "log_level": logging.DEBUG,  # per-message lines only when the service logs at DEBUG
        # tracing: the telemetry middleware outermost, so a refused request's answer is in its span
        "middlewares": ((NatsTelemetryMiddleware(), ErrorReplies, VersionHeader) if tracing.enabled()
                        else (ErrorReplies, VersionHeader)),
        "description": f"Weir's {name} service",
    }
    if watch is not None:
        options["error_cb"] = watch.error_cb
        if watch.probe is None:
            watch.probe = natsconn.tls_probe(settings, servers(settings)[0])
    return NatsBroker(servers(settings), **(options | kwargs))


@contextlib.asynccontextmanager
async def tool_broker(settings: CommonSettings, name: str, *, fail_fast: bool = False,
                      identity: str = "operator") -> AsyncIterator[NatsBroker]:
    """A started broker for a tool (the `weir` CLI): its publishers and `request` work at once; a subscriber declared
    on it afterwards needs `await subscriber.start()`. Closed (drained) on exit.

    `fail_fast`: when no server answers, the first connect fails within seconds instead of trying for ever (and a
    lost connection is not re-established), for a tool that has something else to do without NATS."""
    # nats-py's first connect gives up only once every server is past max_reconnect_attempts (each tried twice here,
    # reconnect_time_wait apart); allow_reconnect=False alone does not stop it
    options: dict[str, Any] = (
        {"allow_reconnect": False, "max_reconnect_attempts": 1, "connect_timeout": 5} if fail_fast else {}
    )
    watch = ConnectionWatch(natsconn.identity(settings, identity), caller_says=fail_fast)
    broker = make_broker(settings, name=name, identity=identity, watch=watch, **options)
    try:
        # connects (refused at once when the server refuses the identity); the publishers' producers come with it
        await watch.connected(broker.start())
        natsconn.require_tls(settings, broker.connection)
        watch.attach(broker.connection)
        yield broker
    finally:
        try:
            await broker.stop()
        except Exception as exc:  # what the tool did is done (or failed on its own): a failed drain changes neither
            log.warning("closing the %s broker: %r", name, exc)


# where a request/reply subject's answer goes: the reply subject each request names (its caller's inbox)
REPLY_ADDRESS = "{reply_to}"


def declare_reply(broker: NatsBroker, subject: str, reply: Any) -> None:
    """The reply of a request subject, in the AsyncAPI document (FastStream documents what a subscriber receives,
    not what it answers): a publisher that is never published to, whose schema is the reply's (a model, or a union
    such as `Answer | ErrorReply`)."""
    broker.publisher(REPLY_ADDRESS, title=f"{subject}:reply", schema=reply,
                     description=f"the answer to each {subject} request, on the request's own reply subject")


def no_declare(stream: str) -> JStream:
    """A stream a subscriber reads but never creates or changes (streams come from `weir streams apply`)."""
    return JStream(stream, declare=False)


def asyncapi_specification(*brokers: NatsBroker, service: str, description: str = "") -> Specification:
    """FastStream's AsyncAPI 3 specification of everything the broker's handlers and publishers declare (what
    FastStream's own HTML renderer takes: the `/asyncapi` page). Its info.version is the release (shared/release.py)."""
    return AsyncAPI(*brokers, title=f"weir {service}", version=VERSION, description=description or None,
                    schema_version="3.0.0").to_specification()


def asyncapi_document(*brokers: NatsBroker, service: str, description: str = "") -> dict[str, Any]:
    """The same specification as a JSON document (`/asyncapi.json`)."""
    doc: dict[str, Any] = asyncapi_specification(*brokers, service=service, description=description).to_jsonable()
    return doc
