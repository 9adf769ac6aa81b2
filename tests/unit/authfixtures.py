"""What the auth domain's tests share: settings with small, pairwise different limits, a moment on which every window
starts, credential outcomes, and a whole instance wired as the service wires it (on the service's local counters)."""

from __future__ import annotations

import hashlib
import math
from dataclasses import replace

import pytest

from services.auth.counters import SUBJECT_PREFIX, LocalCounters
from services.auth.domain.access import (
    AcceptedAccountToken,
    AcceptedPublishableKey,
    AcceptedSecretKey,
    CredentialOutcome,
    NoCredential,
    RejectedCredential,
    RejectionReason,
    RequestFacts,
    RouteClass,
    UnusableReason,
    UnusableUploadToken,
    ValidUploadToken,
)
from services.auth.domain.credentials import KEY_RANDOM_BYTES, InternalToken
from services.auth.domain.limits import CountPlan, Decision, decide, plan_counts
from services.auth.domain.memory import RecentAcceptedKeys, RefusalMemory, refusal_from_memory
from services.auth.domain.rules import HOUR_SECONDS, CounterKey, counter_subject, rules_from
from services.auth.domain.upload_tokens import UploadTokenClaims, sign_upload_token
from services.auth.settings import AuthSettings

DEFAULTS = AuthSettings()
# small and pairwise different, so that a test cannot pass by confusing one rule with another
SMALL = AuthSettings(
    limit_address_per_minute=7,
    limit_auth_failure_per_minute=3,
    limit_key_per_minute=5,
    limit_owner_per_minute=12,
    limit_upload_token_per_minute=6,
    limit_app_create_per_hour=2,
    limit_key_rotate_per_hour=4,
    limit_window_seconds=60,
    upload_token_ttl_seconds=120,
)
BOTH = pytest.mark.parametrize("cfg", [DEFAULTS, SMALL], ids=["defaults", "small"])

WINDOW = SMALL.limit_window_seconds
# a moment on which every window (the minute rules' and the hour rules') starts
T0 = float(math.lcm(WINDOW, HOUR_SECONDS, DEFAULTS.limit_window_seconds) * 600_000)

ADDRESS = "203.0.113.7"
OTHER_ADDRESS = "198.51.100.9"
SECRET = b"upload-token-signing-secret"
HASH_SECRET = b"key-hash-secret"
INTERNAL = "internal-token-0123456789abcdefghijklmnopqrstuvwxyz"


def rand_bytes(seed: int) -> bytes:
    return hashlib.sha256(seed.to_bytes(8, "big")).digest()[:KEY_RANDOM_BYTES]


def claims(video: str = "video-1", expires_at: int | None = None) -> UploadTokenClaims:
    return UploadTokenClaims(video, "app-1", "key-1", int(T0) + 3600 if expires_at is None else expires_at)


def signed_token(expires_at: int | None = None, secret: bytes = SECRET) -> str:
    """An upload token for video-1, signed with SECRET (or `secret`), good for an hour from T0 unless told."""
    return sign_upload_token(secret, "video-1", "app-1", "key-1", int(T0) + 3600 if expires_at is None else expires_at)


SECRET_KEY = AcceptedSecretKey("key-1", "acct-1", "app-1")
PUBLISHABLE_KEY = AcceptedPublishableKey("key-2", "acct-1", "app-1")
ACCOUNT_TOKEN = AcceptedAccountToken("user-1", "acct-1")
UPLOAD_TOKEN = ValidUploadToken("tok-1", claims())
EXPIRED_TOKEN = UnusableUploadToken("tok-2", claims(), UnusableReason.EXPIRED)
REVOKED_TOKEN = UnusableUploadToken("tok-3", claims(), UnusableReason.KEY_REVOKED)
REJECTED_KEY = RejectedCredential("secret_key", RejectionReason.UNKNOWN, "wsk_abcdefgh")
REJECTED_TOKEN = RejectedCredential("upload_token", RejectionReason.BAD_SIGNATURE)

OUTCOMES: dict[str, CredentialOutcome] = {
    "none": NoCredential(),
    "secret_key": SECRET_KEY,
    "publishable_key": PUBLISHABLE_KEY,
    "account_token": ACCOUNT_TOKEN,
    "upload_token": UPLOAD_TOKEN,
    "expired_upload_token": EXPIRED_TOKEN,
    "revoked_upload_token": REVOKED_TOKEN,
    "rejected_key": REJECTED_KEY,
    "rejected_upload_token": REJECTED_TOKEN,
}


# what a decision answers, as (status, code)
OK = (200, None)
MISSING = (401, "missing_credential")
INVALID = (401, "invalid_credential")
NOT_ALLOWED = (401, "credential_not_allowed")
EXPIRED = (401, "token_expired")
FORBIDDEN = (403, "forbidden")


def local_subject(key: CounterKey, now: float) -> str:
    return counter_subject(SUBJECT_PREFIX, key, key.window_start(now))


def count_locally(store: LocalCounters, plan: CountPlan, now: float) -> dict[CounterKey, int]:
    """The counts `decide` takes, from the service's local counters: the plan's increments, then its block read."""
    counts = {key: store.incr_now(local_subject(key, now)) for key in plan.increments}
    for key in plan.reads:
        counts[key] = store.peek(local_subject(key, now))
    return counts


class Instance:
    """One auth instance as the service wires it: refusal memory, recent keys, and local counters for the store."""

    def __init__(self, cfg: AuthSettings, *, use_memory: bool = True) -> None:
        self.rules = rules_from(cfg)
        self.store = LocalCounters(clock=lambda: 0.0)  # the test's moments are not the counters' clock
        self.memory = RefusalMemory()
        self.recent = RecentAcceptedKeys(cfg.limit_window_seconds)
        self.use_memory = use_memory
        self.store_calls = 0

    def count(self, key: CounterKey, now: float) -> int:
        """What the store holds for `key` in the window of `now`."""
        return self.store.peek(local_subject(key, now))

    def check(self, facts: RequestFacts, now: float) -> Decision:
        if isinstance(facts.credential, AcceptedSecretKey):
            recent = self.recent.accepted_within(facts.address, facts.credential.key_id, now)
            facts = replace(facts, recently_accepted_key=recent)
        plan = plan_counts(facts, self.rules)
        if self.use_memory:
            remembered = refusal_from_memory(plan, self.memory, now)
            if remembered is not None:
                return remembered
        self.store_calls += 1
        decision = decide(plan, count_locally(self.store, plan, now), now)
        self.memory.remember_decision(decision, now)
        if decision.accepted_key_id is not None:
            self.recent.record(facts.address, decision.accepted_key_id, now)
        return decision


def facts(
    route: RouteClass = RouteClass.PUBLIC,
    credential: CredentialOutcome | None = None,
    internal: InternalToken = InternalToken.ABSENT,
    address: str = ADDRESS,
    **kw: object,
) -> RequestFacts:
    return RequestFacts(route, address, credential or NoCredential(), internal, **kw)  # type: ignore[arg-type]


def statuses(decisions: list[Decision]) -> list[int]:
    return [d.status for d in decisions]
