"""The seven limit rules (SPEC section 3), and the counters that keep them: one per rule, key and window."""

from __future__ import annotations

import base64
import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Final

from services.auth.domain.windows import window_end, window_start
from services.auth.settings import AuthSettings


class RuleId(StrEnum):
    """The seven rules, in the order of SPEC section 3's table (the tie-break between refusals)."""

    ADDRESS = "address"
    AUTH_FAILURE = "auth_failure"
    KEY = "key"
    OWNER = "owner"
    UPLOAD_TOKEN = "upload_token"
    APP_CREATE = "app_create"
    KEY_ROTATE = "key_rotate"


RULE_ORDER: Final[Mapping[RuleId, int]] = {rule: index for index, rule in enumerate(RuleId)}

HOUR_SECONDS: Final = 3600
"""The management rules are per hour by name (`..._PER_HOUR`); the minute rules follow WEIR_LIMIT_WINDOW_SECONDS."""


@dataclass(frozen=True)
class Rule:
    id: RuleId
    limit: int
    window_seconds: int

    @functools.cached_property
    def headers_json_parts(self) -> tuple[str, str]:
        """What `headers.rate_limit_headers_json` writes for this rule around its `remaining` (for every request)."""
        name = f'\\"{self.id}\\"'  # a rule id is a plain word: its structured-field string needs only JSON's escape
        return (f'{{"RateLimit-Policy":"{name};q={self.limit};w={self.window_seconds}","RateLimit":"{name};r=',
                f'"X-RateLimit-Limit":"{self.limit}","X-RateLimit-Remaining":"')


def rules_from(settings: AuthSettings) -> dict[RuleId, Rule]:
    minute = settings.limit_window_seconds
    return {
        RuleId.ADDRESS: Rule(RuleId.ADDRESS, settings.limit_address_per_minute, minute),
        RuleId.AUTH_FAILURE: Rule(RuleId.AUTH_FAILURE, settings.limit_auth_failure_per_minute, minute),
        RuleId.KEY: Rule(RuleId.KEY, settings.limit_key_per_minute, minute),
        RuleId.OWNER: Rule(RuleId.OWNER, settings.limit_owner_per_minute, minute),
        RuleId.UPLOAD_TOKEN: Rule(RuleId.UPLOAD_TOKEN, settings.limit_upload_token_per_minute, minute),
        RuleId.APP_CREATE: Rule(RuleId.APP_CREATE, settings.limit_app_create_per_hour, HOUR_SECONDS),
        RuleId.KEY_ROTATE: Rule(RuleId.KEY_ROTATE, settings.limit_key_rotate_per_hour, HOUR_SECONDS),
    }


# --- counter keys and subjects ----------------------------------------------------------------------------------------

_VERBATIM_TOKEN = re.compile(r"[A-Za-z0-9-]{1,64}")


@functools.lru_cache(maxsize=65536)  # the same keys and addresses come back request after request
def subject_token(value: str) -> str:
    """A NATS subject token for any value: ids as they are, anything else `_` + base32 (`_` never starts an id)."""
    if _VERBATIM_TOKEN.fullmatch(value):
        return value
    return "_" + base64.b32encode(value.encode()).decode("ascii").rstrip("=").lower()


def subject_value(token: str) -> str:
    """The value a subject token stands for (the inverse of `subject_token`)."""
    if not token.startswith("_"):
        return token
    body = token[1:].upper()
    return base64.b32decode(body + "=" * (-len(body) % 8)).decode()


@dataclass(frozen=True)
class CounterKey:
    """One budget: a rule and whom it is kept for (already a subject-safe token)."""

    rule: Rule
    key: str
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # hashed on every dict lookup of every request: once, not by hashing the rule's fields each time
        object.__setattr__(self, "_hash", hash((self.rule, self.key)))

    def __hash__(self) -> int:
        return self._hash

    @classmethod
    def of(cls, rule: Rule, value: str) -> CounterKey:
        return _counter_key(rule, value)

    def window_start(self, now: float) -> int:
        return window_start(now, self.rule.window_seconds)

    def window_end(self, now: float) -> int:
        return window_end(now, self.rule.window_seconds)


@functools.lru_cache(maxsize=65536)
def _counter_key(rule: Rule, value: str) -> CounterKey:
    # one object per budget: the dicts a request goes through then match by identity before equality
    return CounterKey(rule, subject_token(value))


_SUBJECT_PREFIX = re.compile(r"[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*")


@functools.lru_cache(maxsize=65536)  # the same counters come back request after request, within a window
def counter_subject(prefix: str, counter: CounterKey, window_start: int) -> str:
    """`<prefix>.<rule>.<key>.<window start>`: one counter subject per rule, key and window."""
    if not _SUBJECT_PREFIX.fullmatch(prefix):
        raise ValueError(f"{prefix!r} is not a subject prefix")
    return f"{prefix}.{counter.rule.id}.{counter.key}.{window_start}"
