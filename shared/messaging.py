"""Every service's messaging runtime: one FastStream `NatsBroker`, on the one nats-py connection of the process.

The broker owns the connection (`broker.connection` is the nats-py client everything else uses), runs every
subscriber, publishes replies, and writes the service's AsyncAPI document from what its handlers declare.

FastStream's defaults that Weir changes on purpose (ENGINEERING.md, pitfalls):
- streams are never declared by a subscriber (`no_declare`): `weir streams apply` is the one place;
- a request/reply handler whose input fails validation would send no reply, and the caller could only time out:
  `ErrorReplies` answers it at once with a `validation_error` problem;
- the broker logs every message at INFO ("Received", "Processed"): its logger is Weir's own, at WARNING.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from faststream import BaseMiddleware
from faststream.message import StreamMessage
from faststream.nats import JStream, NatsBroker
from faststream.specification import AsyncAPI
from pydantic import BaseModel, ConfigDict, ValidationError

from shared.settings import CommonSettings

log = logging.getLogger("weir.messaging")


class ReplyError(BaseModel):
    """What a request/reply handler answers instead of its reply when the request cannot be served."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    status: int
    code: str
    detail: str


class ErrorReply(BaseModel):
    """The whole reply of a refused request: `{"error": {status, code, detail}}`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    error: ReplyError


def error_reply(status: int, code: str, detail: str) -> ErrorReply:
    return ErrorReply(error=ReplyError(status=status, code=code, detail=detail[:2000]))


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
            log.info("refused a request on %s: %s", getattr(msg.raw_message, "subject", "?"), detail[:300])
            return error_reply(400, "validation_error", detail)


def servers(settings: CommonSettings) -> list[str]:
    return [s.strip() for s in settings.nats_url.split(",") if s.strip()]


def make_broker(settings: CommonSettings, *, name: str, **kwargs: Any) -> NatsBroker:
    """The service's broker: every server of WEIR_NATS_URL, reconnecting for ever, Weir's logger at WARNING."""
    return NatsBroker(
        servers(settings),
        name=f"weir-{name}",
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.5,  # type: ignore[arg-type]  # nats-py takes seconds as a float
        graceful_timeout=settings.shutdown_grace_seconds,
        logger=logging.getLogger(f"weir.{name}.broker"),
        log_level=logging.DEBUG,  # per-message lines only when the service logs at DEBUG
        middlewares=(ErrorReplies,),
        description=f"Weir's {name} service",
        **kwargs,
    )


def no_declare(stream: str) -> JStream:
    """A stream a subscriber reads but never creates or changes (streams come from `weir streams apply`)."""
    return JStream(stream, declare=False)


def asyncapi_document(broker: NatsBroker, *, service: str, description: str = "") -> dict[str, Any]:
    """FastStream's AsyncAPI 3 document of everything the broker's handlers and publishers declare."""
    spec = AsyncAPI(broker, title=f"weir {service}", version="1", description=description or None,
                    schema_version="3.0.0")
    doc: dict[str, Any] = spec.to_specification().to_jsonable()
    return doc
