"""Every subject a service subscribes to or sends on is declared in shared/contracts.py, once.

What a service may use on the bus is its identity's rights (shared/identities.py): nats-server refuses anything else,
and tests/unit/test_identities.py holds the rights to what each FastStream broker declares. So a subject outside
these declarations cannot be used: each right is an event's, a durable's, a JetStream API's or an inbox's, or a
request/reply contract's with that service as its responder (subscribe) or caller (publish)."""

from __future__ import annotations

import importlib

import pytest
from pydantic import BaseModel

from shared import contracts
from shared.authcheck import MANAGE_OPERATIONS, manage_subject
from shared.contractversions import contract_versions
from shared.events.catalog import CATALOG
from shared.identities import IDENTITIES, JS_ACK, JS_API, LIMITS_SUBJECTS, SERVICES, Identity, covers, overlaps
from shared.natsconn import INBOX_ROOT

CALLERS = (*SERVICES, contracts.OPERATOR)


def resolve(model: str) -> type[BaseModel]:
    module, _, name = model.partition(":")
    found = getattr(importlib.import_module(module), name)
    assert isinstance(found, type) and issubclass(found, BaseModel), model
    return found


def other_declarations(subject: str) -> bool:
    """A subject the other declarations cover: an event's subject (its account's, its bare type), a dead letter, a
    replay, a counter, JetStream's API, an inbox (replies, and sweep.run's updates to the inbox its request names)."""
    return (subject in contracts.EVENT_TYPES or contracts.origin_of(subject) is not None
            or subject.startswith((contracts.DLQ_PREFIX, contracts.REPLAY_PREFIX, f"{JS_API}.", f"{JS_ACK}.",
                                   f"{INBOX_ROOT}."))
            or any(overlaps(s, subject) for s in LIMITS_SUBJECTS))


def contracts_on(subject: str, requests: tuple[contracts.RequestContract, ...]) -> list[contracts.RequestContract]:
    return [r for r in requests if covers(subject, r.wildcard) or covers(r.wildcard, subject)]


def undeclared(identity: Identity, requests: tuple[contracts.RequestContract, ...] = contracts.REQUESTS) -> list[str]:
    """Each right of the identity that no declaration accounts for, or whose contract does not name it."""
    found: list[str] = []
    for action, rights, named in (("subscribes to", identity.subscribe, lambda r: r.responder == identity.name),
                                  ("sends on", identity.publish_rights(), lambda r: identity.name in r.callers)):
        for right in rights:
            declared = contracts_on(right.subject, requests)
            if not declared and not other_declarations(right.subject):
                found.append(f"{identity.name} {action} {right.subject}, which shared/contracts.py does not declare")
            found += [f"{identity.name} {action} {right.subject}, but its contract does not name it"
                      for r in declared if not named(r)]
    return found


@pytest.mark.parametrize("identity", [IDENTITIES[n] for n in CALLERS], ids=lambda i: i.name)
def test_every_subject_an_identity_may_use_is_declared(identity: Identity) -> None:
    assert undeclared(identity) == []


@pytest.mark.parametrize("contract", contracts.REQUESTS, ids=lambda r: r.subject)
def test_a_contract_left_out_of_the_declaration_is_found(contract: contracts.RequestContract) -> None:
    others = tuple(r for r in contracts.REQUESTS if r is not contract)
    assert undeclared(IDENTITIES[contract.responder], others)
    for caller in contract.callers:
        assert undeclared(IDENTITIES[caller], others)


@pytest.mark.parametrize("contract", contracts.REQUESTS, ids=lambda r: r.subject)
def test_each_contract_is_served_and_called_by_whom_it_names(contract: contracts.RequestContract) -> None:
    responder = IDENTITIES[contract.responder]
    assert responder.may_subscribe(contract.wildcard), f"{contract.responder} may not subscribe to it"
    if contract.answered:
        assert responder.responds, f"{contract.responder} may not answer requests"
    for caller in contract.callers:
        assert IDENTITIES[caller].may_publish(contract.wildcard), f"{caller} may not send on {contract.subject}"


@pytest.mark.parametrize("contract", contracts.REQUESTS, ids=lambda r: r.subject)
def test_each_contract_names_models_that_exist(contract: contracts.RequestContract) -> None:
    for model in (contract.request, *contract.replies):
        resolve(model)


def test_the_management_operations_are_authcheck_s() -> None:
    declared = {r.subject: r for r in contracts.REQUESTS if r.subject.startswith(f"{contracts.AUTH_MANAGE_PREFIX}.")}
    assert set(declared) == {manage_subject(op) for op in MANAGE_OPERATIONS}
    for op, (request, reply) in MANAGE_OPERATIONS.items():
        r = declared[manage_subject(op)]
        assert resolve(r.request) is request
        assert reply in [resolve(m) for m in r.replies]
        assert contracts.ERROR_REPLY in r.replies


def test_a_pattern_s_subject_finds_its_contract() -> None:
    for r in contracts.REQUESTS:
        concrete = r.subject.replace(contracts.INSTANCE_TOKEN, "c0ffee")
        assert contracts.request_contract(concrete) is r
    with pytest.raises(contracts.ContractError):
        contracts.request_contract("nobody.serves.this")


def test_the_declaration_is_consistent() -> None:
    assert contracts.problems() == []


@pytest.mark.parametrize("service", SERVICES)
def test_contract_versions_name_what_the_service_serves_or_calls(service: str) -> None:
    versions = contract_versions(service)
    served_or_called = {r.subject for r in contracts.served_by(service) + contracts.called_by(service)}
    assert set(versions["requests"]) == served_or_called
    assert all(versions["requests"][r.subject] == r.version for r in contracts.REQUESTS if r.subject in
               served_or_called)
    assert all(versions["events"][t] == CATALOG[t].version for t in versions["events"])
    assert ("openapi" in versions) == (service == "api")
