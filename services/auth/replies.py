"""What a request payload amounts to before counting (`RememberedPayload`), a request of a batch awaiting its decision
(`PendingCheck`), and the reply written for it: `CheckReply`'s JSON from a template made from the model, the parts
fixed for a payload (its identity, address and CORS origin) written once per payload."""

from __future__ import annotations

from dataclasses import dataclass, field

from pydantic import ValidationError

from services.auth.domain.access import CredentialOutcome, RequestFacts
from services.auth.domain.credentials import InternalToken
from services.auth.domain.limits import CountPlan, Decision
from services.auth.domain.rules import CounterKey
from services.auth.domain.throttled import RefusedCaller
from services.auth.lookups import Lookup
from shared.authcheck import CheckReply, CheckRequest, CounterMode, Identity
from shared.messaging import error_reply
from shared.modeljson import Encoder, ModelTemplate, RawJson

CHECK_REPLY = ModelTemplate(CheckReply)


def invalid_reply(exc: ValidationError) -> bytes:
    """The answer to a request that is not a CheckRequest: the same ErrorReply as FastStream's subscribers give."""
    detail = str(exc.errors(include_url=False, include_context=False))
    return error_reply(400, "validation_error", detail).model_dump_json().encode()


@dataclass(slots=True)
class RememberedPayload:
    """What a request payload amounts to before counting, kept for the same payload arriving again."""

    request: CheckRequest
    address: str
    credential: CredentialOutcome
    identity: Identity | None
    internal: InternalToken
    key_id: str | None  # the accepted secret key, for the block's recently-accepted exception
    failure_key: CounterKey
    until: float
    cors_origin: str | None = None  # the request's Origin, when the credential's app allows it
    plans: dict[bool, tuple[RequestFacts, CountPlan]] = field(default_factory=dict)
    lookup: Lookup | None = None  # the cached lookup behind `credential`; none for a request without a credential
    refused_as: RefusedCaller | None = None  # who it is in `weir status`'s most refused, made at its first 429
    _allowed: Encoder | None = None
    _refused: Encoder | None = None

    def allowed_reply(self) -> Encoder:
        """An allowed reply of this payload, but for its counter mode and headers."""
        if self._allowed is None:
            identity = RawJson(b"null" if self.identity is None else self.identity.model_dump_json().encode())
            self._allowed = CHECK_REPLY.bind(allowed=True, status=200, problem=None, identity=identity,
                                             client_address=self.address, cors_origin=self.cors_origin)
        return self._allowed

    def refused_reply(self) -> Encoder:
        """A refusal of this payload, but for its status, problem, counter mode and headers."""
        if self._refused is None:
            self._refused = CHECK_REPLY.bind(allowed=False, identity=None, client_address=self.address,
                                             cors_origin=self.cors_origin)
        return self._refused


@dataclass(slots=True)
class PendingCheck:
    """One request of a batch between its lookup and its decision (the rest of what it is: its payload's)."""

    payload: RememberedPayload
    facts: RequestFacts
    plan: CountPlan
    past_failure_limit: bool
    decision: Decision | None  # already known when refused from memory
    counts: dict[CounterKey, int] = field(default_factory=dict)


def reply_model(check: PendingCheck, mode: CounterMode) -> CheckReply:
    decision = check.decision
    assert decision is not None
    # model_construct: every field was made here, from validated values; nothing to check again per request
    return CheckReply.model_construct(
        allowed=decision.allowed, status=decision.status, problem=decision.problem(), headers=decision.headers(),
        identity=check.payload.identity if decision.allowed else None, client_address=check.facts.address,
        counter_mode=mode, cors_origin=check.payload.cors_origin,
    )


def reply_bytes(check: PendingCheck, mode: CounterMode) -> bytes:
    """`reply_model`'s JSON, its fields in the model's order (the headers last, for the edge's remembered
    decisions: shared/authclient.py)."""
    decision = check.decision
    assert decision is not None
    headers = RawJson(decision.headers_json().encode())
    if decision.status == 200:
        return check.payload.allowed_reply()(counter_mode=mode, headers=headers)
    return check.payload.refused_reply()(status=decision.status, problem=decision.problem(), counter_mode=mode,
                                         headers=headers)
