"""The `auth.check` request and reply, and auth's management operations: what any edge sends to auth over NATS.

`auth.check` is called once per request with what the edge saw; its reply is the one decision: allow or refuse
(status, problem body), the identity the route uses, the rate-limit headers. Each management operation is its own
subject, `auth.manage.<op>` (`MANAGE_OPERATIONS`). What auth cannot serve is answered `shared.messaging.ErrorReply`.
Read tolerantly (SPEC 11): unknown fields are ignored, and an unknown closed-set value reads as its safe side.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from shared.contracts import AUTH_CHECK_SUBJECT, AUTH_MANAGE_PREFIX
from shared.messaging import ReplyError, unknown_as

CHECK_SUBJECT = AUTH_CHECK_SUBJECT
MANAGE_PREFIX = AUTH_MANAGE_PREFIX
QUEUE_GROUP = "auth"
# when the edge sent the check, in Unix milliseconds: auth counts a check's wait from it (SPEC 15), since what waits
# in sockets and the server while auth is short of CPU never shows in auth's own queue. A header, not a field: auth
# remembers payloads by their bytes.
SENT_AT_HEADER = "Weir-Sent-At"

RouteClassName = Literal["secret", "sdk", "internal", "management", "public"]
OperationName = Literal["app_create", "key_rotate"]
KeyKind = Literal["secret", "publishable"]
KeyType = Literal["secret", "publishable", "upload_token", "account_token", "internal"]
CounterMode = Literal["shared", "local"]


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")  # read across processes: unknown fields are ignored


class CheckRequest(_Model):
    """What the edge saw. Credentials travel as the edge received them; auth alone judges them."""

    authorization: str | None = Field(None, description="the Authorization header, as received")
    internal_token: str | None = Field(None, description="the X-Weir-Internal-Token header, as received")
    peer: str = Field(description="the TCP peer address of the request")
    forwarded_for: str | None = Field(None, description="X-Forwarded-For, read only when the peer is a trusted proxy")
    # unknown: `internal`, which no customer credential passes (an older auth cannot know whom a newer class admits)
    route_class: Annotated[RouteClassName, unknown_as("internal")]
    route: str = Field(description="the route's name, e.g. 'GET /v1/videos/{id}'")
    # unknown: none; the route's other limits still count the request
    operation: Annotated[OperationName | None, unknown_as(None)] = Field(
        None, description="management routes: the limited operation, if any")
    video_id: str | None = Field(None, description="the video the route acts on, if any")
    origin: str | None = Field(None, description="SDK routes: the Origin header, as received (for CORS)")


class Identity(_Model):
    """Who the request is, as the one credential lookup found it; the route uses this and nothing else."""

    account_id: str | None = None
    app_id: str | None = None
    key_id: str | None = None
    key_type: Annotated[KeyType | None, unknown_as(None)] = None  # unknown: none, nothing assumed of the credential
    user_id: str | None = None
    video_id: str | None = None  # an upload token's video
    allowed_origins: tuple[str, ...] = ()


class CheckDecision(_Model):
    """auth.check's reply without its rate-limit headers: what the route learns of its request."""

    allowed: bool
    status: int
    problem: dict[str, object] | None = None
    identity: Identity | None = None
    client_address: str
    counter_mode: Annotated[CounterMode, unknown_as("local")] = "shared"  # unknown: the weaker promise
    cors_origin: str | None = Field(
        None, description="the request's origin when it is one of the allowed origins of the app its credential names"
        " (refused requests too, when the credential names an app); the edge sends Access-Control-Allow-Origin for it"
    )


class CheckReply(CheckDecision):
    """auth.check's reply: the decision, and the headers the edge sends with its answer."""

    # the last field, so that its JSON ends the reply: the one part that changes from one request of an identity to
    # the next (shared/authclient.py's check_decision remembers the rest)
    headers: dict[str, str] = Field(default_factory=dict, description="RateLimit-*, X-RateLimit-*, Retry-After")


ManageError = ReplyError  # what auth answers instead of a reply: status, code, detail (in an ErrorReply)


# ---- management operations (auth.manage.<op>); identity comes from a preceding auth.check ----


class CreateAccount(_Model):
    name: str = Field(min_length=1, max_length=200)
    user_name: str = Field("owner", min_length=1, max_length=200)


class AccountCreated(_Model):
    account_id: str
    user_id: str
    account_token: str  # shown once


class CreateApp(_Model):
    user_id: str
    account_id: str
    name: str = Field(min_length=1, max_length=200)
    allowed_origins: tuple[str, ...] = ()


class KeyPair(_Model):
    secret_key: str  # shown once
    publishable_key: str  # shown once
    secret_key_id: str
    publishable_key_id: str


class AppCreated(KeyPair):
    id: str
    name: str


class RotateKeys(_Model):
    user_id: str
    account_id: str
    app_id: str


class RevokeKey(_Model):
    user_id: str
    account_id: str
    key_id: str


class ListKeys(_Model):
    account_id: str
    app_id: str


class KeyInfo(_Model):
    id: str
    kind: Annotated[KeyKind, unknown_as("secret")]  # unknown: the kind never to expose
    prefix: str
    created_at: str
    revoked_at: str | None


class KeyList(_Model):
    keys: list[KeyInfo]


class KeyRevocation(_Model):
    revoked: bool
    already: bool = Field(description="the key was revoked before this request")


class MintUploadToken(_Model):
    video_id: str
    app_id: str
    key_id: str


class UploadToken(_Model):
    upload_token: str
    upload_token_expires_at: str


class ListLimits(_Model):
    """Every request limit in force and where it applies: asks nothing (the api documents the answer)."""


class LimitRule(_Model):
    """One rule of SPEC 3's table with its current numbers. `id` is an open set: a newer auth's rule is shown as
    it is named."""

    id: str
    limit: int = Field(description="requests admitted per window")
    window_seconds: int
    keyed_by: str = Field(description="whose budget it is, e.g. 'client address'")
    counts: str = Field(description="which requests spend it")


class CredentialLimits(_Model):
    """The rules a request of a route class spends when it carries this credential."""

    credential: str = Field(description="an open set, e.g. 'secret_key', 'none', 'rejected'")
    description: str = Field(description="the credential in words, e.g. 'an accepted secret key'")
    rules: tuple[str, ...] = Field(description="the ids of the rules it spends (none: not counted)")


class RouteLimits(_Model):
    """Which rules apply to a request of one route class (and management operation), credential by credential."""

    route_class: str  # an open set: an edge ignores a class it does not serve
    operation: str | None = None
    credentials: tuple[CredentialLimits, ...]


class LimitList(_Model):
    rules: tuple[LimitRule, ...]
    routes: tuple[RouteLimits, ...]


LIMITS_LIST = "limits.list"  # the operation the api documents the limits from (/openapi.json)

# operation -> (request, reply); the subject is `manage_subject(operation)`
MANAGE_OPERATIONS: dict[str, tuple[type[BaseModel], type[BaseModel]]] = {
    "account.create": (CreateAccount, AccountCreated),
    "app.create": (CreateApp, AppCreated),
    "keys.rotate": (RotateKeys, KeyPair),
    "key.revoke": (RevokeKey, KeyRevocation),
    "keys.list": (ListKeys, KeyList),
    "token.mint": (MintUploadToken, UploadToken),
    LIMITS_LIST: (ListLimits, LimitList),
}

# operations that change nothing (a read, or a token signed from what is read): one whose reply was lost with a
# dropped connection is sent again on the new one (SPEC 15); the others must not be done twice
RESENDABLE_OPERATIONS = frozenset({"keys.list", "token.mint", LIMITS_LIST})
if not RESENDABLE_OPERATIONS <= MANAGE_OPERATIONS.keys():
    raise ImportError(f"not management operations: {RESENDABLE_OPERATIONS - MANAGE_OPERATIONS.keys()}")


def manage_subject(operation: str) -> str:
    return f"{MANAGE_PREFIX}.{operation}"

