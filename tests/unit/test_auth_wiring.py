"""auth's subscribers wired on a broker: which handler each subject reaches, with which model, and what the AsyncAPI
document says. Pure wiring, so FastStream's in-memory TestNatsBroker (no server): delivery, validation replies and
`auth.check` (a plain nats-py subscription) are tested against the real nats-server
(tests/integration/test_auth_messaging.py)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from faststream.nats import NatsBroker, TestNatsBroker
from pydantic import BaseModel, ValidationError

from services.auth import app, manage
from services.auth.settings import AuthSettings
from services.auth.spent import SpentBudgets
from shared.authcheck import (
    CHECK_SUBJECT,
    MANAGE_OPERATIONS,
    CreateAccount,
    CreateApp,
    KeyRevocation,
    LimitList,
    ListKeys,
    ListLimits,
    MintUploadToken,
    RevokeKey,
    RotateKeys,
    manage_subject,
)
from shared.authclient import declare_auth_requests
from shared.contracts import AUTH_SPENT_SUBJECT
from shared.events import KeyRevoked, new_event
from shared.messaging import REPLY_ADDRESS, ErrorReply, asyncapi_document, error_reply, make_broker

SAMPLES: dict[str, BaseModel] = {
    "account.create": CreateAccount(name="acme"),
    "app.create": CreateApp(user_id="u1", account_id="a1", name="site"),
    "keys.rotate": RotateKeys(user_id="u1", account_id="a1", app_id="p1"),
    "key.revoke": RevokeKey(user_id="u1", account_id="a1", key_id="k1"),
    "keys.list": ListKeys(account_id="a1", app_id="p1"),
    "token.mint": MintUploadToken(video_id="v1", app_id="p1", key_id="k1"),
}
# answered from the settings alone, without a database connection (manage.answer)
FROM_SETTINGS: dict[str, BaseModel] = {"limits.list": ListLimits()}
HANDLERS = {"account.create": manage.create_account, "app.create": manage.create_app,
            "keys.rotate": manage.rotate_keys, "key.revoke": manage.revoke_key, "keys.list": manage.list_keys,
            "token.mint": manage.mint_upload_token}


@dataclass
class FakeChecker:
    """What the handlers call on the checker, recorded."""

    forgotten: list[str] = field(default_factory=list)
    forgot_all: int = 0
    spent: list[SpentBudgets] = field(default_factory=list)

    def forget_key(self, key_id: str) -> None:
        self.forgotten.append(key_id)

    def forget_all(self) -> None:
        self.forgot_all += 1

    def learn_spent(self, budgets: SpentBudgets) -> None:
        self.spent.append(budgets)


@pytest.fixture
def answered(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, BaseModel]]:
    """manage.answer replaced: each call recorded, answered with the operation's name (or a revocation)."""
    calls: list[tuple[Any, BaseModel]] = []

    async def answer(checker: Any, operation: Any, request: BaseModel) -> BaseModel:
        calls.append((operation, request))
        if operation is manage.revoke_key:
            return KeyRevocation(revoked=True, already=False)
        return error_reply(299, operation.__name__, "recorded")

    monkeypatch.setattr(manage, "answer", answer)
    return calls


def broker_with_auth(checker: FakeChecker) -> NatsBroker:
    """auth's running broker: every FastStream subscriber, and no auth.check (served by a plain subscription)."""
    broker = make_broker(AuthSettings(), name="auth")
    fake: Any = checker
    app.register(broker, fake, AuthSettings())
    return broker


def documented_brokers(checker: FakeChecker) -> tuple[NatsBroker, NatsBroker]:
    """What auth's /asyncapi.json is built from: the running broker, and its contracts on a broker of their own."""
    contracts = make_broker(AuthSettings(), name="auth")
    assert app.SERVICE.served_outside_broker is app.declare_check
    app.declare_check(contracts)
    return broker_with_auth(checker), contracts


@pytest.fixture
async def wired() -> AsyncIterator[tuple[NatsBroker, FakeChecker]]:
    checker = FakeChecker()
    broker = broker_with_auth(checker)
    async with TestNatsBroker(broker) as test_broker:
        yield test_broker, checker


async def test_each_operation_reaches_its_own_handler_with_its_model(
    wired: tuple[NatsBroker, FakeChecker], answered: list[tuple[Any, BaseModel]]
) -> None:
    broker, _ = wired
    assert set(SAMPLES) | set(FROM_SETTINGS) == set(MANAGE_OPERATIONS) and set(SAMPLES) == set(HANDLERS)
    for operation, request in SAMPLES.items():
        reply = await broker.request(request.model_dump_json().encode(), manage_subject(operation))
        handler, received = answered[-1]
        assert handler is HANDLERS[operation], operation
        assert received == request and type(received) is MANAGE_OPERATIONS[operation][0]
        body = json.loads(reply.body)
        if operation == "key.revoke":
            assert KeyRevocation.model_validate(body) == KeyRevocation(revoked=True, already=False)
        else:  # a refusal travels as the ErrorReply it is
            assert ErrorReply.model_validate(body).error.code == handler.__name__
    assert len(answered) == len(SAMPLES)


async def test_the_limits_are_answered_from_the_settings(wired: tuple[NatsBroker, FakeChecker]) -> None:
    broker, _ = wired
    reply = await broker.request(ListLimits().model_dump_json().encode(), manage_subject("limits.list"))
    assert LimitList.model_validate_json(reply.body) == manage.list_limits(AuthSettings())


def test_the_running_broker_has_no_auth_check_subscriber() -> None:
    """A FastStream subscriber of auth.check would open a second subscription in the queue group, on the slow path."""
    subjects = {sub.subject.broker_address for sub in broker_with_auth(FakeChecker()).subscribers}
    assert CHECK_SUBJECT not in subjects and manage_subject("keys.list") in subjects


async def test_a_revocation_forgets_its_key_and_a_spent_budget_is_learned(
    wired: tuple[NatsBroker, FakeChecker],
) -> None:
    broker, checker = wired
    event = new_event(KeyRevoked(key_id="k9", app_id="p1", account_id="a1", kind="secret"), source="auth",
                      subject="k9")
    await broker.publish(event.to_bytes(), "key.revoked")
    assert checker.forgotten == ["k9"] and checker.forgot_all == 0
    # an envelope whose data is not a KeyRevoked: which key is unknown, so every cached key goes
    odd = event.model_copy(update={"data": {"key_id": 7}})
    with pytest.raises(ValidationError):  # FastStream logs it (TestNatsBroker hands it to the publisher)
        await broker.publish(odd.to_bytes(), "key.revoked")
    assert checker.forgotten == ["k9"] and checker.forgot_all == 1
    budgets = SpentBudgets([("auth_failure", "10_0_0_1", 1_700_000_060), ("key", "k9", 0)])
    await broker.publish(budgets.model_dump_json().encode(), AUTH_SPENT_SUBJECT)
    assert checker.spent == [budgets]


def _schema_title(doc: dict[str, Any], ref: str) -> str:
    name = ref.rsplit("/", 1)[1]
    title: str = doc["components"]["schemas"][name]["title"]
    return title


def _payload_titles(doc: dict[str, Any], channel: dict[str, Any]) -> set[str]:
    """The schema titles a channel's message carries (one model, or each member of a union)."""
    (message,) = channel["messages"].values()
    payload = doc["components"]["messages"][message["$ref"].rsplit("/", 1)[1]]["payload"]
    if "$ref" in payload:
        payload = doc["components"]["schemas"][payload["$ref"].rsplit("/", 1)[1]]
        if "$ref" not in str(payload.get("anyOf", "")):
            return {payload["title"]}
    return {_schema_title(doc, member["$ref"]) for member in payload["anyOf"]}


def test_the_asyncapi_document_lists_every_subject_with_its_request_and_reply() -> None:
    doc = asyncapi_document(*documented_brokers(FakeChecker()), service="auth")
    channels = doc["channels"]
    served = {c["address"]: c for c in channels.values() if c["address"] != REPLY_ADDRESS}
    replies = {name.removesuffix(":reply"): c for name, c in channels.items() if name.endswith(":reply")}
    assert _payload_titles(doc, served[CHECK_SUBJECT]) == {"CheckRequest"}
    assert served[CHECK_SUBJECT]["bindings"]["nats"]["queue"] == "auth"
    assert _payload_titles(doc, replies[CHECK_SUBJECT]) == {"CheckReply", "ErrorReply"}
    for operation, (request, reply) in MANAGE_OPERATIONS.items():
        subject = manage_subject(operation)
        assert _payload_titles(doc, served[subject]) == {request.__name__}, subject
        assert served[subject]["bindings"]["nats"]["queue"] == "auth"
        assert _payload_titles(doc, replies[subject]) == {reply.__name__, "ErrorReply"}, subject
    # heard by every instance: no queue group
    assert _payload_titles(doc, served["key.revoked"]) == {"KeyRevokedEvent"}
    assert "queue" not in served["key.revoked"]["bindings"]["nats"]
    assert "queue" not in served[AUTH_SPENT_SUBJECT]["bindings"]["nats"]
    actions = {op["channel"]["$ref"].rsplit("/", 1)[1]: op["action"] for op in doc["operations"].values()}
    assert actions[CHECK_SUBJECT] == "receive" and actions[f"{CHECK_SUBJECT}:reply"] == "send"


def test_an_edges_document_lists_what_it_asks_auth() -> None:
    """The api declares auth.check and every auth.manage.<op> it sends, with their request models."""
    broker = make_broker(AuthSettings(), name="api")
    declare_auth_requests(broker)
    doc = asyncapi_document(broker, service="api")
    sent = {c["address"]: c for c in doc["channels"].values()}
    assert _payload_titles(doc, sent[CHECK_SUBJECT]) == {"CheckRequest"}
    for operation, (request, _) in MANAGE_OPERATIONS.items():
        assert _payload_titles(doc, sent[manage_subject(operation)]) == {request.__name__}, operation
    assert {op["action"] for op in doc["operations"].values()} == {"send"}
