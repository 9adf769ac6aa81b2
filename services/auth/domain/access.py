"""What a request carries (its route class, what its credential turned out to be) and whether the route lets that
credential through: the 401 and 403 refusals. Limits (429) come first; they are `limits.decide`'s."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Final, Literal, TypeAlias

from services.auth.domain.credentials import CredentialForm, InternalToken, key_prefix
from services.auth.domain.upload_tokens import UploadTokenCheck, UploadTokenClaims, UploadTokenVerdict
from shared.events.catalog import CredentialKind

# --- what a request carries -------------------------------------------------------------------------------------------


class RouteClass(StrEnum):
    SECRET = "secret"
    SDK = "sdk"
    INTERNAL = "internal"
    MANAGEMENT = "management"
    PUBLIC = "public"


class ManagementOperation(StrEnum):
    APP_CREATE = "app_create"
    KEY_ROTATE = "key_rotate"


class RejectionReason(StrEnum):
    MALFORMED = "malformed"
    UNKNOWN = "unknown"
    REVOKED = "revoked"
    BAD_SIGNATURE = "bad_signature"
    FORGED = "forged"


class UnusableReason(StrEnum):
    EXPIRED = "expired"
    KEY_REVOKED = "key_revoked"


@dataclass(frozen=True)
class NoCredential:
    pass


@dataclass(frozen=True)
class AcceptedSecretKey:
    key_id: str
    account_id: str
    app_id: str


@dataclass(frozen=True)
class AcceptedPublishableKey:
    key_id: str
    account_id: str
    app_id: str


@dataclass(frozen=True)
class AcceptedAccountToken:
    user_id: str
    account_id: str


@dataclass(frozen=True)
class ValidUploadToken:
    token_id: str
    claims: UploadTokenClaims


@dataclass(frozen=True)
class UnusableUploadToken:
    """A token with a good signature that no longer works: refused, but not a rejected credential."""

    token_id: str
    claims: UploadTokenClaims
    reason: UnusableReason


@dataclass(frozen=True)
class RejectedCredential:
    """A rejected credential (SPEC section 2): it counts on `auth_failure`, never on a key's or account's budget."""

    kind: CredentialKind
    reason: RejectionReason
    key_prefix: str | None = None


CredentialOutcome: TypeAlias = (
    NoCredential
    | AcceptedSecretKey
    | AcceptedPublishableKey
    | AcceptedAccountToken
    | ValidUploadToken
    | UnusableUploadToken
    | RejectedCredential
)


def malformed_credential(form: CredentialForm) -> RejectedCredential:
    """The outcome of a malformed form (looked up nowhere)."""
    kind: CredentialKind = form.looks_like or "internal_token"
    # never a prefix of an internal-token attempt: a near miss would show part of the real token
    prefix = None if kind == "internal_token" else key_prefix(form.value)
    return RejectedCredential(kind, RejectionReason.MALFORMED, prefix)


def upload_token_outcome(check: UploadTokenCheck, key_live: bool) -> CredentialOutcome:
    """What an upload token amounts to, given its check and whether the key that minted it is still live."""
    if check.verdict is UploadTokenVerdict.GARBLED:
        return RejectedCredential("upload_token", RejectionReason.MALFORMED)
    if check.verdict is UploadTokenVerdict.BAD_SIGNATURE:
        return RejectedCredential("upload_token", RejectionReason.BAD_SIGNATURE)
    assert check.claims is not None and check.token_id is not None
    if check.verdict is UploadTokenVerdict.EXPIRED:
        return UnusableUploadToken(check.token_id, check.claims, UnusableReason.EXPIRED)
    if not key_live:
        return UnusableUploadToken(check.token_id, check.claims, UnusableReason.KEY_REVOKED)
    return ValidUploadToken(check.token_id, check.claims)


@dataclass(frozen=True)
class RequestFacts:
    """What the edge saw and what the one credential lookup found.

    `video_id` is the video the route acts on (SDK upload routes); `recently_accepted_key` is whether this instance
    accepted the request's secret key from this address within the last window (`RecentAcceptedKeys`).
    """

    route: RouteClass
    address: str
    credential: CredentialOutcome = NoCredential()
    internal: InternalToken = InternalToken.ABSENT
    operation: ManagementOperation | None = None
    video_id: str | None = None
    recently_accepted_key: bool = False


@dataclass(frozen=True)
class Rejection:
    """One rejected credential of a request, for the `credential.rejected` event."""

    kind: CredentialKind
    reason: RejectionReason
    key_prefix: str | None = None


def rejections(facts: RequestFacts) -> tuple[Rejection, ...]:
    """The rejected credentials a request carried: its Authorization credential, a forged internal token, or both."""
    found: list[Rejection] = []
    if isinstance(facts.credential, RejectedCredential):
        c = facts.credential
        found.append(Rejection(c.kind, c.reason, c.key_prefix))
    if facts.internal is InternalToken.FORGED:
        found.append(Rejection("internal_token", RejectionReason.FORGED))
    return tuple(found)


# --- credential refusals ----------------------------------------------------------------------------------------------

ProblemCode: TypeAlias = Literal[
    "missing_credential", "invalid_credential", "credential_not_allowed", "token_expired", "forbidden", "rate_limited",
    "unavailable",
]

@dataclass(frozen=True)
class Refusal:
    status: int
    code: ProblemCode
    detail: str


_NOT_ALLOWED_NAMES: Final[Mapping[type, str]] = {
    AcceptedSecretKey: "secret keys",
    AcceptedPublishableKey: "publishable keys",
    AcceptedAccountToken: "account tokens",
    ValidUploadToken: "upload tokens",
    UnusableUploadToken: "upload tokens",
}

_ACCEPTED_ON: Final[Mapping[RouteClass, tuple[type, ...]]] = {
    RouteClass.SECRET: (AcceptedSecretKey,),
    RouteClass.SDK: (AcceptedPublishableKey, ValidUploadToken, UnusableUploadToken),
    RouteClass.MANAGEMENT: (AcceptedAccountToken,),
    RouteClass.INTERNAL: (),
}

MISSING: Final = Refusal(401, "missing_credential", "this route needs a credential: Authorization: Bearer <credential>")
MISSING_INTERNAL: Final = Refusal(401, "missing_credential", "this route needs Weir's internal token: "
                                  "X-Weir-Internal-Token: <token>")
INVALID: Final = Refusal(401, "invalid_credential", "the credential was not accepted")


def _not_allowed(credential: CredentialOutcome) -> Refusal:
    name = _NOT_ALLOWED_NAMES[type(credential)]
    return Refusal(401, "credential_not_allowed", f"{name} cannot be used on this route")


def credential_refusal(facts: RequestFacts) -> Refusal | None:
    """Whether the route refuses the request's credential, and how; None lets it through."""
    route, credential = facts.route, facts.credential
    if route is RouteClass.PUBLIC:
        return None
    if route is RouteClass.INTERNAL:
        if facts.internal is InternalToken.REAL:
            return None
        if facts.internal is InternalToken.FORGED:
            return INVALID
        if isinstance(credential, NoCredential):
            return MISSING_INTERNAL
    if isinstance(credential, NoCredential):
        return MISSING
    if isinstance(credential, RejectedCredential):
        return INVALID
    if not isinstance(credential, _ACCEPTED_ON[route]):
        if route is RouteClass.INTERNAL:
            return Refusal(401, "credential_not_allowed", "only Weir's internal token is accepted on this route")
        return _not_allowed(credential)
    if isinstance(credential, UnusableUploadToken):
        if credential.reason is UnusableReason.EXPIRED:
            return Refusal(401, "token_expired", "the upload token has expired; mint a new one")
        return Refusal(401, "invalid_credential", "the key that minted this upload token was revoked")
    # on SDK routes a publishable key creates videos (no video in the route); an upload token acts on its one video
    if isinstance(credential, AcceptedPublishableKey) and facts.video_id is not None:
        return _not_allowed(credential)
    if isinstance(credential, ValidUploadToken):
        if facts.video_id is None:
            return _not_allowed(credential)
        if facts.video_id != credential.claims.video_id:
            return Refusal(403, "forbidden", "this upload token was minted for another video")
    return None
