"""Wiring of the `auth` service: `auth.check` and the management operations over NATS, the counters, the cache.

`auth.check` is a plain nats-py subscription feeding the batcher (services/auth/batched.py); its contract is declared
by `declare_check` where the AsyncAPI document is built. Every other subject is a FastStream subscriber, its handler's
signature the contract: one per management operation `auth.manage.<op>` (queue group `auth`), and, on every
instance, `key.revoked` and `auth.spent`. A request that fails validation is answered with a `validation_error`.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from faststream.nats import NatsBroker, NatsMessage
from faststream.nats.subscriber.usecases import LogicSubscriber
from pydantic import ValidationError

from services.auth import batched, manage, operators
from services.auth.batched import CheckBatcher
from services.auth.checker import Checker
from services.auth.counters import ResilientCounters, counters_from_settings
from services.auth.settings import AuthSettings
from services.auth.spent import SpentBudgets
from shared.authcheck import (
    CHECK_SUBJECT,
    LIMITS_LIST,
    MANAGE_OPERATIONS,
    QUEUE_GROUP,
    AccountCreated,
    AppCreated,
    CheckReply,
    CheckRequest,
    CreateAccount,
    CreateApp,
    KeyList,
    KeyPair,
    KeyRevocation,
    LimitList,
    ListKeys,
    ListLimits,
    MintUploadToken,
    RevokeKey,
    RotateKeys,
    UploadToken,
    manage_subject,
)
from shared.contracts import AUTH_SPENT_SUBJECT
from shared.events import Event, KeyRevoked
from shared.messaging import ErrorReply, declare_reply
from shared.runtime import Runtime, ServiceDefinition

log = logging.getLogger("weir.auth")


def declare_check(broker: NatsBroker) -> None:
    """`auth.check` in the AsyncAPI document: request, queue group and reply. Declared only on the broker that builds
    the document (`ServiceDefinition.served_outside_broker`): the running service serves it with
    `batched.serve_checks`."""

    @broker.subscriber(CHECK_SUBJECT, queue=QUEUE_GROUP, title=CHECK_SUBJECT,
                       description="one decision per API request: allow or refuse, the identity, the limit headers")
    async def check(request: CheckRequest) -> CheckReply:
        raise NotImplementedError("documentation only: auth.check is served by batched.serve_checks")

    declare_reply(broker, CHECK_SUBJECT, CheckReply | ErrorReply)


def register(broker: NatsBroker, checker: Checker, settings: AuthSettings) -> None:
    """Every FastStream subscriber and publisher of auth on `broker` (all but `auth.check`)."""

    def operation(name: str, description: str) -> LogicSubscriber[Any]:
        """The subscriber of one management operation (and its reply in the document)."""
        subject = manage_subject(name)
        declare_reply(broker, subject, MANAGE_OPERATIONS[name][1] | ErrorReply)
        return broker.subscriber(subject, queue=QUEUE_GROUP, max_workers=settings.manage_concurrency, title=subject,
                                 description=description)

    @operation("account.create", "a new account, its first user and account token")
    async def create_account(request: CreateAccount) -> AccountCreated | ErrorReply:
        return await manage.answer(checker, manage.create_account, request)

    @operation("app.create", "an app of the account, with a secret and a publishable key (shown once)")
    async def create_app(request: CreateApp) -> AppCreated | ErrorReply:
        return await manage.answer(checker, manage.create_app, request)

    @operation("keys.rotate", "a new key pair for the app; the old pair is revoked")
    async def rotate_keys(request: RotateKeys) -> KeyPair | ErrorReply:
        return await manage.answer(checker, manage.rotate_keys, request)

    @operation("key.revoke", "revoke one key of the account (key.revoked tells every instance)")
    async def revoke_key(request: RevokeKey) -> KeyRevocation | ErrorReply:
        return await manage.answer(checker, manage.revoke_key, request)

    @operation("keys.list", "the app's keys, by prefix")
    async def list_keys(request: ListKeys) -> KeyList | ErrorReply:
        return await manage.answer(checker, manage.list_keys, request)

    @operation("token.mint", "an upload token for one video, naming the key that minted it")
    async def mint_upload_token(request: MintUploadToken) -> UploadToken | ErrorReply:
        return await manage.answer(checker, manage.mint_upload_token, request)

    limits = manage.list_limits(settings)  # the settings are fixed for the life of the process

    @operation(LIMITS_LIST, "every request limit with the numbers this instance counts by, and where each "
               "applies (route class and credential): the api's OpenAPI document shows them")
    async def list_limits(request: ListLimits) -> LimitList:
        return limits

    def decode_revocation(message: NatsMessage) -> Event[KeyRevoked]:
        """The event read as JSON (its strict types take their JSON forms only there). One that does not validate
        still says that some key was revoked: every cached key is forgotten (each costs one lookup), and FastStream
        logs the validation error."""
        try:
            return Event[KeyRevoked].model_validate_json(message.body)
        except ValidationError:
            checker.forget_all()
            raise

    # every instance hears every revocation (no queue group): the cached key is gone at once. No reply: the event
    # comes from a JetStream publish, whose reply subject waits for the stream's PubAck, not for us
    # its own channel title: the publisher of key.revoked has the type's, and FastStream keeps one channel per title
    @broker.subscriber(KeyRevoked.event_type, decoder=decode_revocation, no_reply=True,
                       title=f"{KeyRevoked.event_type}:live",
                       description="the revoked key is forgotten on every instance")
    async def on_key_revoked(event: Event[KeyRevoked]) -> None:
        checker.forget_key(event.data.key_id)

    # every instance, its own included (remembering twice changes nothing)
    @broker.subscriber(AUTH_SPENT_SUBJECT, no_reply=True, title=AUTH_SPENT_SUBJECT,
                       description="budgets another instance saw spent")
    async def on_spent(budgets: SpentBudgets) -> None:
        checker.learn_spent(budgets)


@dataclass(frozen=True)
class AuthParts:
    """What auth's start makes and its loops, routes and stop use."""

    checker: Checker
    counters: ResilientCounters
    batcher: CheckBatcher


async def start(rt: Runtime) -> None:
    settings = rt.settings
    assert isinstance(settings, AuthSettings) and rt.broker is not None
    nc, _, pool = rt.require()
    counters = counters_from_settings(nc, settings, metrics=rt.metrics)
    spent = rt.broker.publisher(AUTH_SPENT_SUBJECT, title=f"{AUTH_SPENT_SUBJECT}:publish", schema=SpentBudgets,
                                description="budgets this instance saw spent, for every instance to refuse from memory")

    async def broadcast(budgets: SpentBudgets) -> None:
        await spent.publish(budgets)

    checker = Checker(settings, pool, counters, metrics=rt.metrics, counter_mode=lambda: counters.mode,
                      broadcast=broadcast)
    register(rt.broker, checker, settings)
    if rt.watch is not None:
        rt.watch.on_reconnect(checker.forget_all)  # revocations may have passed while disconnected

    shed = None if settings.shed_policy == "off" else batched.QueueShedding(
        target=settings.shed_target_ms / 1000, interval=settings.shed_burst_ms / 1000,
        sender_clock=settings.shed_sender_clock)
    batcher = CheckBatcher(checker, settings.check_concurrency, respond=batched.publisher(nc), metrics=rt.metrics,
                           shed=shed)
    rt.subscriptions.append(await batched.serve_checks(nc, batcher))
    rt.parts = AuthParts(checker=checker, counters=counters, batcher=batcher)


async def stop(rt: Runtime) -> None:
    # the subscriptions are stopped already (no new work): finish what is in flight, then give back
    if not isinstance(rt.parts, AuthParts):  # the start did not get that far
        return
    parts = rt.parts
    await parts.batcher.drain(rt.settings.shutdown_grace_seconds)
    try:
        await asyncio.wait_for(parts.checker.close(), timeout=rt.settings.shutdown_grace_seconds)
    except Exception as exc:  # what was not given back stays counted: over, never under
        log.warning("leased counts not given back at shutdown: %s", exc)
    await parts.counters.close()


def _checker(rt: Runtime) -> Checker:
    """The checker `start` made: the runtime starts a service's background loops once its on_start returned."""
    return rt.parts_of(AuthParts).checker


async def fold_rejections(rt: Runtime, stop_event: asyncio.Event) -> None:
    await _checker(rt).run_folding(stop_event)


async def give_back_idle_leases(rt: Runtime, stop_event: asyncio.Event) -> None:
    await _checker(rt).leases.run(stop_event)


SERVICE = ServiceDefinition(
    name="auth",
    settings_cls=AuthSettings,
    on_start=start,
    on_stop=stop,
    # GET /throttled: who this instance refused 429 lately (operators only)
    routes=lambda app, rt: operators.routes(app, rt, lambda: _checker(rt)),
    served_outside_broker=declare_check,
    background=(fold_rejections, give_back_idle_leases),
    description="accounts, users, apps, keys, upload-token signing and every request-limit counter",
)
