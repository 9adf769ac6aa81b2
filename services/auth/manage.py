"""auth's management operations (accounts, apps, keys, upload tokens), answered over NATS request/reply.

Callers establish who acts with `auth.check` first (which also spends the `app_create` and `key_rotate` budgets);
these operations trust the identity they are given, as everything on Weir's bus does. Each is a function of
(checker, connection, request model) -> reply model; `answer` runs one and turns its refusals into an `ErrorReply`.
"""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import TypeVar

import asyncpg
from pydantic import BaseModel

from services.auth import store
from services.auth.checker import Checker
from services.auth.domain.applicable import RULE_WORDS, limits_in_force
from services.auth.domain.credentials import KEY_RANDOM_BYTES, FormKind, key_hash, key_prefix, mint_key
from services.auth.domain.rules import rules_from
from services.auth.domain.upload_tokens import sign_upload_token, upload_token_expires_at
from services.auth.settings import AuthSettings
from shared.authcheck import (
    AccountCreated,
    AppCreated,
    CreateAccount,
    CreateApp,
    CredentialLimits,
    KeyInfo,
    KeyList,
    KeyPair,
    KeyRevocation,
    LimitList,
    LimitRule,
    ListKeys,
    MintUploadToken,
    RevokeKey,
    RotateKeys,
    RouteLimits,
    UploadToken,
)
from shared.messaging import ErrorReply, Refused, answer_on_pool

Req = TypeVar("Req", bound=BaseModel)
Rep = TypeVar("Rep", bound=BaseModel)


ManageFailure = Refused  # an operation's refusal, answered as its ErrorReply


def _new_key(checker: Checker, kind: FormKind) -> store.NewKey:
    raw = mint_key(kind, secrets.token_bytes(KEY_RANDOM_BYTES))
    return store.NewKey(
        id=store.new_id(),
        kind="secret" if kind is FormKind.SECRET_KEY else "publishable",
        raw=raw,
        key_hash=key_hash(checker.hash_secret, raw),
        prefix=key_prefix(raw),
    )


def _pair(checker: Checker) -> tuple[store.NewKey, store.NewKey]:
    return _new_key(checker, FormKind.SECRET_KEY), _new_key(checker, FormKind.PUBLISHABLE_KEY)


def _key_pair(keys: tuple[store.NewKey, store.NewKey]) -> dict[str, str]:
    secret, publishable = keys
    return {
        "secret_key": secret.raw,
        "publishable_key": publishable.raw,
        "secret_key_id": secret.id,
        "publishable_key_id": publishable.id,
    }


async def create_account(checker: Checker, conn: asyncpg.Connection, req: CreateAccount) -> AccountCreated:
    token = mint_key(FormKind.ACCOUNT_TOKEN, secrets.token_bytes(KEY_RANDOM_BYTES))
    account_id, user_id = await store.create_account(
        conn, req.name, req.user_name, key_hash(checker.hash_secret, token), key_prefix(token)
    )
    return AccountCreated(account_id=account_id, user_id=user_id, account_token=token)


async def create_app(checker: Checker, conn: asyncpg.Connection, req: CreateApp) -> AppCreated:
    keys = _pair(checker)
    app_id = await store.create_app(
        conn, account_id=req.account_id, user_id=req.user_id, name=req.name,
        allowed_origins=req.allowed_origins, keys=keys,
    )
    return AppCreated(id=app_id, name=req.name, **_key_pair(keys))


async def _own_app(conn: asyncpg.Connection, app_id: str, account_id: str) -> None:
    if await store.app_owner(conn, app_id) != account_id:
        raise ManageFailure(404, "not_found", "no such app in this account")


async def rotate_keys(checker: Checker, conn: asyncpg.Connection, req: RotateKeys) -> KeyPair:
    await _own_app(conn, req.app_id, req.account_id)
    keys = _pair(checker)
    for key_id in await store.rotate_keys(conn, app_id=req.app_id, account_id=req.account_id, keys=keys):
        checker.cache.forget_key(key_id)
    return KeyPair(**_key_pair(keys))


async def revoke_key(checker: Checker, conn: asyncpg.Connection, req: RevokeKey) -> KeyRevocation:
    done = await store.revoke_key(conn, key_id=req.key_id, account_id=req.account_id)
    if done is None:
        raise ManageFailure(404, "not_found", "no such key in this account")
    checker.cache.forget_key(req.key_id)
    return KeyRevocation(revoked=True, already=not done)


async def list_keys(checker: Checker, conn: asyncpg.Connection, req: ListKeys) -> KeyList:
    await _own_app(conn, req.app_id, req.account_id)
    rows = await store.list_keys(conn, req.app_id)
    return KeyList(keys=[
        KeyInfo(id=i, kind=k, prefix=p, created_at=c.isoformat(),
                revoked_at=r.isoformat() if r else None)
        for i, k, p, c, r in rows
    ])


async def mint_upload_token(checker: Checker, conn: asyncpg.Connection, req: MintUploadToken) -> UploadToken:
    # the token names the key whose request minted it, so that key must be live and the app's own
    key = await store.key_by_id(conn, req.key_id)
    if key is None or key.app_id != req.app_id:
        raise ManageFailure(403, "forbidden", "the minting key does not belong to this app")
    if key.revoked:
        raise ManageFailure(401, "invalid_credential", "the minting key was revoked")
    now = checker.clock()
    expires = upload_token_expires_at(now, checker.settings.upload_token_ttl_seconds)
    token = sign_upload_token(checker.token_secret, req.video_id, req.app_id, req.key_id, expires)
    return UploadToken(upload_token=token, upload_token_expires_at=datetime.fromtimestamp(expires, UTC).isoformat())


def list_limits(settings: AuthSettings) -> LimitList:
    """Every rule with the numbers this instance counts by, and the rules each credential spends on each route class
    (services/auth/domain/applicable.py): from the same settings object as the counters, headers and refusals."""
    found = limits_in_force(rules_from(settings))
    return LimitList(
        rules=tuple(LimitRule(id=rule.id, limit=rule.limit, window_seconds=rule.window_seconds,
                              keyed_by=RULE_WORDS[rule.id].keyed_by, counts=RULE_WORDS[rule.id].counts)
                    for rule in found.rules),
        routes=tuple(RouteLimits(route_class=scope.route, operation=scope.operation, credentials=tuple(
            CredentialLimits(credential=c.case.name, description=c.case.description,
                             rules=tuple(str(rule) for rule in c.rules)) for c in scope.cases))
                     for scope in found.routes),
    )


async def answer(
    checker: Checker, operation: Callable[[Checker, asyncpg.Connection, Req], Awaitable[Rep]], req: Req
) -> Rep | ErrorReply:
    """Run one operation on a pooled connection; a refusal, or a failure, is answered at once."""
    return await answer_on_pool("auth", checker.pool, operation, checker, req)
