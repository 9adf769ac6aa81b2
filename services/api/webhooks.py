"""The webhook routes of SPEC 13: a developer's endpoints, their secrets, delivery log and replay, with a secret key.
Each is one request to the webhooks service (`webhooks.manage.<op>`, shared/webhookcalls.py), which owns them; its
refusals come back as problem bodies with their codes (install_error_handlers), and a webhooks service that does not
run yet answers 503 like any dependency."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import AwareDatetime, Field, StrictBool, model_validator

from services.api.routes import ERRORS, Strict, auth_of
from shared.problems import Problem
from shared.routeclass import route_class
from shared.webhookcalls import (
    DESCRIPTION_MAX_LENGTH,
    EVENTS_MAX,
    URL_MAX_LENGTH,
    CreateEndpoint,
    DeleteEndpoint,
    DeliveryPage,
    DeliveryStatus,
    EndpointCreated,
    EndpointDeleted,
    EndpointList,
    EndpointView,
    GetEndpoint,
    ListDeliveries,
    ListEndpoints,
    Replay,
    ReplayAccepted,
    RotateSecret,
    SecretRotated,
    UpdateEndpoint,
    call,
)

EventName = Annotated[str, Field(min_length=1, max_length=100)]
ENDPOINT_ID = Annotated[str, Field(max_length=64)]


class CreateWebhook(Strict):
    url: str = Field(min_length=1, max_length=URL_MAX_LENGTH, description="https URL that receives the POSTs")
    events: list[EventName] = Field(min_length=1, max_length=EVENTS_MAX, description="event types, `*`, or "
                                    "`<prefix>.*` (e.g. `encode.*`)")
    description: str = Field("", max_length=DESCRIPTION_MAX_LENGTH)


class ChangeWebhook(Strict):
    url: str | None = Field(None, min_length=1, max_length=URL_MAX_LENGTH)
    events: list[EventName] | None = Field(None, min_length=1, max_length=EVENTS_MAX)
    description: str | None = Field(None, max_length=DESCRIPTION_MAX_LENGTH)
    # strict: "yes", "off" or 1 is not a boolean (pydantic's lax mode would take them)
    enabled: StrictBool | None = Field(None, description="true turns a disabled endpoint back on (its failures "
                                       "forgotten)")

    @model_validator(mode="after")
    def something(self) -> ChangeWebhook:
        if not self.model_fields_set:
            raise ValueError("name at least one of url, events, description, enabled")
        nulls = sorted(name for name in self.model_fields_set if getattr(self, name) is None)
        if nulls:  # leaving a field out keeps it; null would say something else, which none of them means
            raise ValueError(f"{', '.join(nulls)}: null is not a value here; leave a field out to keep it")
        return self


class ReplayWebhook(Strict):
    since: AwareDatetime = Field(description="the slice's first event time (RFC 3339, with its zone)")
    until: AwareDatetime | None = Field(None, description="its last (default: now)")
    types: list[EventName] | None = Field(None, max_length=EVENTS_MAX, description="only these types (as `events`)")


def _app(request: Request) -> tuple[str, str]:
    identity = auth_of(request).identity
    if identity is None or identity.app_id is None or identity.account_id is None:
        raise Problem(401, "invalid_credential", "no app behind this credential")
    return identity.app_id, identity.account_id


def webhook_routes(nc_of: Any) -> APIRouter:
    r = APIRouter(prefix="/v1/webhooks", tags=["webhooks"], responses=ERRORS)

    @r.post("", status_code=201, **route_class("secret"))
    async def create_webhook(request: Request, body: CreateWebhook) -> JSONResponse:
        """Register an endpoint for the app's events. The answer holds its signing secret (`whsec_...`), shown this
        once: verify each delivery's `webhook-signature` with it (Standard Webhooks)."""
        app_id, account_id = _app(request)
        created = await call(nc_of(), "endpoint.create",
                             CreateEndpoint(app_id=app_id, account_id=account_id, url=body.url, events=body.events,
                                            description=body.description), EndpointCreated)
        return JSONResponse({**created.endpoint.model_dump(mode="json"), "secret": created.secret}, status_code=201)

    @r.get("", **route_class("secret"))
    async def list_webhooks(request: Request) -> dict[str, Any]:
        """The app's endpoints (never their secrets)."""
        app_id, account_id = _app(request)
        found = await call(nc_of(), "endpoint.list", ListEndpoints(app_id=app_id, account_id=account_id),
                           EndpointList)
        return {"webhooks": [e.model_dump(mode="json") for e in found.endpoints]}

    @r.get("/{webhook_id}", **route_class("secret"))
    async def get_webhook(request: Request, webhook_id: ENDPOINT_ID) -> dict[str, Any]:
        """One endpoint: where it points, what it takes, whether it is enabled and since when it fails."""
        app_id, account_id = _app(request)
        return (await call(nc_of(), "endpoint.get", GetEndpoint(app_id=app_id, account_id=account_id,
                                                                endpoint_id=webhook_id), EndpointView)
                ).model_dump(mode="json")

    @r.patch("/{webhook_id}", **route_class("secret"))
    async def change_webhook(request: Request, webhook_id: ENDPOINT_ID, body: ChangeWebhook) -> dict[str, Any]:
        """Change the URL, the events or the description, or turn the endpoint off or back on."""
        app_id, account_id = _app(request)
        return (await call(nc_of(), "endpoint.update", UpdateEndpoint(
            app_id=app_id, account_id=account_id, endpoint_id=webhook_id, url=body.url, events=body.events,
            description=body.description, enabled=body.enabled), EndpointView)).model_dump(mode="json")

    @r.delete("/{webhook_id}", status_code=204, **route_class("secret"))
    async def delete_webhook(request: Request, webhook_id: ENDPOINT_ID) -> Response:
        """Delete the endpoint, its pending deliveries and its log."""
        app_id, account_id = _app(request)
        await call(nc_of(), "endpoint.delete", DeleteEndpoint(app_id=app_id, account_id=account_id,
                                                              endpoint_id=webhook_id), EndpointDeleted)
        return Response(status_code=204)

    @r.post("/{webhook_id}/secret/rotate", **route_class("secret"))
    async def rotate_webhook_secret(request: Request, webhook_id: ENDPOINT_ID) -> dict[str, Any]:
        """A new signing secret, shown this once. The previous one goes on signing beside it (two signatures in
        `webhook-signature`) until `previous_signs_until`, so receivers can switch without losing a delivery."""
        app_id, account_id = _app(request)
        return (await call(nc_of(), "secret.rotate", RotateSecret(app_id=app_id, account_id=account_id,
                                                                  endpoint_id=webhook_id), SecretRotated)
                ).model_dump(mode="json")

    @r.get("/{webhook_id}/deliveries", **route_class("secret"))
    async def list_webhook_deliveries(
        request: Request, webhook_id: ENDPOINT_ID,
        status: Annotated[DeliveryStatus | None, Query()] = None,
        cursor: Annotated[str | None, Query(max_length=200)] = None,
        limit: Annotated[int, Query(ge=1, le=200)] = 50,
    ) -> dict[str, Any]:
        """The endpoint's deliveries, newest first, each with its attempts (time, status code or error, latency);
        `next_cursor` pages on."""
        app_id, account_id = _app(request)
        return (await call(nc_of(), "deliveries.list", ListDeliveries(
            app_id=app_id, account_id=account_id, endpoint_id=webhook_id, status=status, cursor=cursor, limit=limit),
            DeliveryPage)).model_dump(mode="json")

    @r.post("/{webhook_id}/replay", status_code=202, **route_class("secret"))
    async def replay_webhook(request: Request, webhook_id: ENDPOINT_ID, body: ReplayWebhook) -> dict[str, Any]:
        """Send the app's events of a time slice to the endpoint again (those it takes), in their order, with their
        original `webhook-id`s; answers how many deliveries were made."""
        app_id, account_id = _app(request)
        accepted = await call(nc_of(), "replay", Replay(
            app_id=app_id, account_id=account_id, endpoint_id=webhook_id, since=body.since,
            until=body.until or datetime.now(body.since.tzinfo), types=body.types), ReplayAccepted)
        return accepted.model_dump(mode="json")

    return r
