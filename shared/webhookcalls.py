"""What the api asks the webhooks service over NATS (SPEC 13): one subject per operation, `webhooks.manage.<op>`
(`OPERATIONS`), each a request model and its reply, or `shared.messaging.ErrorReply` (400 a URL or an events list
the service refuses, 404 an endpoint that is not the app's). The app comes from the caller's own `auth.check`: the
webhooks service trusts the api for it (only the api and the operator may send these, SPEC 7's rights).

Read tolerantly (SPEC 11): unknown fields are ignored; a delivery state a newer release adds reads as `pending`.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from faststream.nats import NatsBroker
from nats.aio.client import Client as NATS
from pydantic import BaseModel, ConfigDict, Field

from shared.contracts import WEBHOOKS_MANAGE_PREFIX
from shared.messaging import M, ask, unknown_as

DeliveryStatus = Literal["pending", "delivered", "failed"]
DisabledReason = Literal["gone", "failing", "developer"]
URL_MAX_LENGTH = 2000
DESCRIPTION_MAX_LENGTH = 500
EVENTS_MAX = 64  # entries of an endpoint's events list


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")  # read across processes: unknown fields are ignored


class _AppScoped(_Model):
    app_id: str
    account_id: str


class _OneEndpoint(_AppScoped):
    endpoint_id: str


# --- requests


class CreateEndpoint(_AppScoped):
    url: str = Field(max_length=URL_MAX_LENGTH)
    events: list[str] = Field(max_length=EVENTS_MAX)
    description: str = Field("", max_length=DESCRIPTION_MAX_LENGTH)


class ListEndpoints(_AppScoped):
    pass


class GetEndpoint(_OneEndpoint):
    pass


class UpdateEndpoint(_OneEndpoint):
    """Only the fields given change; `enabled: true` turns a disabled endpoint back on (its failures forgotten)."""

    url: str | None = Field(None, max_length=URL_MAX_LENGTH)
    events: list[str] | None = Field(None, max_length=EVENTS_MAX)
    description: str | None = Field(None, max_length=DESCRIPTION_MAX_LENGTH)
    enabled: bool | None = None


class DeleteEndpoint(_OneEndpoint):
    pass


class RotateSecret(_OneEndpoint):
    pass


class ListDeliveries(_OneEndpoint):
    status: Annotated[DeliveryStatus | None, unknown_as(None)] = None
    cursor: str | None = Field(None, max_length=200)
    limit: int = Field(50, ge=1, le=200)


class Replay(_OneEndpoint):
    since: datetime
    until: datetime | None = None
    types: list[str] | None = Field(None, max_length=EVENTS_MAX)


# --- replies


class EndpointView(_Model):
    id: str
    url: str
    events: list[str]
    description: str = ""
    enabled: bool = True
    disabled_reason: Annotated[DisabledReason | None, unknown_as("developer")] = None
    disabled_at: datetime | None = None
    failing_since: datetime | None = Field(None, description="its first failed attempt since its last success")
    created_at: datetime
    secret_rotated_at: datetime | None = None


class EndpointCreated(_Model):
    endpoint: EndpointView
    secret: str = Field(description="the signing secret (whsec_...), shown this once")


class EndpointList(_Model):
    endpoints: list[EndpointView]


class EndpointDeleted(_Model):
    id: str


class SecretRotated(_Model):
    secret: str = Field(description="the new signing secret, shown this once")
    previous_signs_until: datetime = Field(description="until when the previous secret still signs beside it")


class AttemptView(_Model):
    at: datetime
    status_code: int | None = None
    error: str | None = None
    latency_ms: float
    address: str = ""


class DeliveryView(_Model):
    id: str
    event_id: str = Field(description="the event's id, sent as webhook-id (the same on every retry and replay)")
    event_type: str
    video_id: str | None = None
    status: Annotated[DeliveryStatus, unknown_as("pending")]
    replay_id: str | None = Field(None, description="the replay that sent it again, if any")
    created_at: datetime
    next_attempt_at: datetime | None = None
    attempts: list[AttemptView] = Field(default_factory=list)


class DeliveryPage(_Model):
    deliveries: list[DeliveryView]
    next_cursor: str | None = None


class ReplayAccepted(_Model):
    replay_id: str
    count: int = Field(description="deliveries made for the slice")


# operation -> (request, reply); the subject is `manage_subject(operation)`
OPERATIONS: dict[str, tuple[type[_Model], type[_Model]]] = {
    "endpoint.create": (CreateEndpoint, EndpointCreated),
    "endpoint.list": (ListEndpoints, EndpointList),
    "endpoint.get": (GetEndpoint, EndpointView),
    "endpoint.update": (UpdateEndpoint, EndpointView),
    "endpoint.delete": (DeleteEndpoint, EndpointDeleted),
    "secret.rotate": (RotateSecret, SecretRotated),
    "deliveries.list": (ListDeliveries, DeliveryPage),
    "replay": (Replay, ReplayAccepted),
}

# reads: one whose reply was lost with a dropped connection is sent again on the new one (SPEC 15)
RESENDABLE_OPERATIONS = frozenset({"endpoint.list", "endpoint.get", "deliveries.list"})
if not RESENDABLE_OPERATIONS <= OPERATIONS.keys():
    raise ImportError(f"not webhook operations: {RESENDABLE_OPERATIONS - OPERATIONS.keys()}")


def manage_subject(operation: str) -> str:
    return f"{WEBHOOKS_MANAGE_PREFIX}.{operation}"


async def call(nc: NATS, operation: str, request: _Model, result: type[M], *, timeout: float = 5.0) -> M:
    """One operation's reply as `result`; `shared.messaging.Refused` when the service refused it."""
    return await ask(nc, manage_subject(operation), request, result, timeout=timeout,
                     resend_if_lost=operation in RESENDABLE_OPERATIONS)


def declare_webhook_requests(broker: NatsBroker) -> None:
    """What the api asks the webhooks service, in the api's AsyncAPI document (sent with nats-py's request)."""
    for operation, (request_model, reply) in OPERATIONS.items():
        subject = manage_subject(operation)
        broker.publisher(subject, title=f"{subject}:request", schema=request_model,
                         description=f"request/reply: answered with {reply.__name__}, or ErrorReply")
