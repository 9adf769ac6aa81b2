"""Who is throttled (the post-mortem's lesson: a 429 that lands on our own service is a bug report about the limits).

`caller_class` names who a request came from; `refused_caller` what may be shown of it (account and app ids, a key's
first characters, or the address when no account is known: never a secret); `RecentRefusals` the callers refused
most in the last few windows, in bounded memory (`SpaceSaving` tables, one per clock-aligned window).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Final, Generic, TypeVar

from services.auth.domain.access import (
    AcceptedAccountToken,
    AcceptedPublishableKey,
    AcceptedSecretKey,
    CredentialOutcome,
    NoCredential,
    RejectedCredential,
    UnusableUploadToken,
    ValidUploadToken,
)
from services.auth.domain.credentials import (
    FormKind,
    InternalToken,
    bearer_credential,
    classify_credential,
    key_prefix,
)
from services.auth.domain.windows import window_start
from shared.events.catalog import KEY_PREFIX_MAX_LENGTH


class CallerClass(StrEnum):
    """Who a request came from, as its credentials tell (a label of `weir_limit_refusals_total`)."""

    INTERNAL = "internal"  # the real internal token: Weir's own services and edges
    SECRET_KEY = "secret_key"
    PUBLISHABLE_KEY = "publishable_key"
    UPLOAD_TOKEN = "upload_token"
    ACCOUNT_TOKEN = "account_token"
    REJECTED = "rejected"  # a rejected credential (SPEC 2): a guessed or revoked key, a forged internal token
    NO_CREDENTIAL = "no_credential"


_BY_CREDENTIAL: Final[Mapping[type, CallerClass]] = {
    NoCredential: CallerClass.NO_CREDENTIAL,
    AcceptedSecretKey: CallerClass.SECRET_KEY,
    AcceptedPublishableKey: CallerClass.PUBLISHABLE_KEY,
    AcceptedAccountToken: CallerClass.ACCOUNT_TOKEN,
    ValidUploadToken: CallerClass.UPLOAD_TOKEN,
    UnusableUploadToken: CallerClass.UPLOAD_TOKEN,  # expired or its key revoked: still an upload token's holder
    RejectedCredential: CallerClass.REJECTED,
}


def caller_class(credential: CredentialOutcome, internal: InternalToken) -> CallerClass:
    """The real internal token makes a request internal whatever else it carries (our own traffic, told apart by
    identity); a forged one alone is a rejected credential; otherwise the Authorization credential decides."""
    if internal is InternalToken.REAL:
        return CallerClass.INTERNAL
    if internal is InternalToken.FORGED and isinstance(credential, NoCredential):
        return CallerClass.REJECTED
    return _BY_CREDENTIAL[type(credential)]


@dataclass(frozen=True, slots=True)
class RefusedCaller:
    """What may be shown of a refused caller: ids and a key's first characters, never a secret. `address` only when
    no account is known (no credential, a rejected one, the internal token alone): it is then all there is."""

    caller: str  # a CallerClass (read back from a newer instance, one this release does not know)
    account_id: str | None = None
    app_id: str | None = None
    key_prefix: str | None = None
    address: str | None = None


def presented_key_prefix(authorization: str | None) -> str | None:
    """The first characters of the secret or publishable key an Authorization header carries (never of anything
    else: an upload token's or an internal-token attempt's characters are not shown)."""
    form = classify_credential(bearer_credential(authorization))
    if form.kind in (FormKind.SECRET_KEY, FormKind.PUBLISHABLE_KEY):
        return key_prefix(form.value)
    return None


def refused_caller(credential: CredentialOutcome, internal: InternalToken, address: str, *,
                   account_id: str | None = None, presented_prefix: str | None = None) -> RefusedCaller:
    """The shown form of a caller: `account_id` is the identity's (an upload token names its app only), and
    `presented_prefix` the accepted key's first characters (`presented_key_prefix`)."""
    app_id: str | None = None
    prefix: str | None = None
    if isinstance(credential, AcceptedSecretKey | AcceptedPublishableKey):
        account_id, app_id, prefix = credential.account_id, credential.app_id, presented_prefix
    elif isinstance(credential, AcceptedAccountToken):
        account_id = credential.account_id
    elif isinstance(credential, ValidUploadToken | UnusableUploadToken):
        app_id = credential.claims.app_id
    elif isinstance(credential, RejectedCredential):
        # a rejected key names no account, and its characters are the sender's choice: one address sending a
        # different made-up key each time is one caller (as the auth_failure rule counts it), not many of one refusal
        account_id = None
    else:
        account_id = None
    return RefusedCaller(
        caller=caller_class(credential, internal), account_id=account_id, app_id=app_id,
        key_prefix=prefix[:KEY_PREFIX_MAX_LENGTH] if prefix else None,
        address=address if account_id is None and app_id is None else None,
    )


# --- the most refused, in bounded memory ------------------------------------------------------------------------------

K = TypeVar("K")


class SpaceSaving(Generic[K]):
    """The heaviest keys of a stream in at most `capacity` counters (Metwally, Agrawal, El Abbadi's space-saving): a
    new key, with the table full, takes the smallest counter's place and count. A key's count is then over by at most
    its `error`, and every key seen more than total/capacity times is held."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("a space-saving table needs at least one counter")
        self.capacity = capacity
        self.total = 0
        self._counts: dict[K, list[int]] = {}  # key -> [count, error]

    def __len__(self) -> int:
        return len(self._counts)

    def add(self, key: K, n: int = 1) -> None:
        self.total += n
        slot = self._counts.get(key)
        if slot is not None:
            slot[0] += n
            return
        if len(self._counts) < self.capacity:
            self._counts[key] = [n, 0]
            return
        smallest = min(self._counts, key=lambda k: self._counts[k][0])
        floor = self._counts.pop(smallest)[0]
        self._counts[key] = [floor + n, floor]

    def items(self) -> list[tuple[K, int, int]]:
        """(key, count, error) of every key held, the most counted first."""
        return sorted(((k, c, e) for k, (c, e) in self._counts.items()), key=lambda item: -item[1])


@dataclass(frozen=True, slots=True)
class RefusedCount:
    """A caller refused by a rule `count` times in the windows asked about; at most `error` of them may be another
    caller's (space-saving's over-count)."""

    who: RefusedCaller
    rule: str
    count: int
    error: int = 0


class RecentRefusals:
    """429s by caller and rule in the last `windows` clock-aligned windows of `window_seconds` (the current one
    included), each window its own `SpaceSaving` table of `capacity`: at most windows x capacity entries, however many
    callers a flood brings."""

    def __init__(self, window_seconds: int, windows: int, capacity: int) -> None:
        if window_seconds < 1 or windows < 1:
            raise ValueError("at least one window of at least one second")
        self.window_seconds = window_seconds
        self.windows = windows
        self.capacity = capacity
        self._tables: dict[int, SpaceSaving[tuple[RefusedCaller, str]]] = {}  # window start -> its table

    def __len__(self) -> int:
        return sum(len(t) for t in self._tables.values())

    def oldest_start(self, now: float) -> int:
        """The start of the oldest window still counted at `now`."""
        return window_start(now, self.window_seconds) - (self.windows - 1) * self.window_seconds

    def record(self, who: RefusedCaller, rule: str, now: float, n: int = 1) -> None:
        start = window_start(now, self.window_seconds)
        table = self._tables.get(start)
        if table is None:
            oldest = self.oldest_start(now)
            for gone in [s for s in self._tables if s < oldest]:
                del self._tables[gone]
            table = self._tables[start] = SpaceSaving(self.capacity)
        table.add((who, rule), n)

    def top(self, now: float) -> list[RefusedCount]:
        """Every caller held in the windows counted at `now`, summed over them, the most refused first."""
        oldest = self.oldest_start(now)
        tables = [t for start, t in self._tables.items() if start >= oldest]
        return merge_counts(
            [RefusedCount(who, rule, count, error) for (who, rule), count, error in t.items()] for t in tables)


def merge_counts(parts: Iterable[Iterable[RefusedCount]]) -> list[RefusedCount]:
    """Counts of several windows or instances summed by caller and rule (errors too), the most refused first (ties by
    caller and rule, so the order is stable)."""
    summed: dict[tuple[RefusedCaller, str], list[int]] = {}
    for part in parts:
        for c in part:
            slot = summed.setdefault((c.who, c.rule), [0, 0])
            slot[0] += c.count
            slot[1] += c.error
    merged = [RefusedCount(who, rule, count, error) for (who, rule), (count, error) in summed.items()]
    merged.sort(key=lambda c: (-c.count, c.who.caller, c.rule, c.who.account_id or "", c.who.app_id or "",
                               c.who.key_prefix or "", c.who.address or ""))
    return merged
