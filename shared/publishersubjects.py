"""The subjects of a publisher-like identity (SPEC 12: the stack's own `publisher` and each outside team's): the
public events it reads, by account, and what it publishes (its recordings) and hears back (its rejections). Pure
subject arithmetic from shared/contracts.py; shared/identities.py builds the identities from it and
shared/identityrules.py checks they stay within it.
"""

from __future__ import annotations

import re

from shared.contracts import ACCOUNT_TOKEN, EVENTS, JOB_CLASS_TOKEN, PUBLIC_EVENTS, PUBLISHER_TOKEN, contract
from shared.videos import JobClass

EVERY_ACCOUNT = "*"  # the accounts of the stack's own publisher: every one (SPEC 12: it is first-party for all)
_ACCOUNT = re.compile(r"[A-Za-z0-9_-]{1,64}")
_REJECTED = contract("publisher.rejected")
_RECORDING = contract("recording.completed")
# the streams holding public events: a publisher reads each through one durable per account
PUBLIC_STREAMS: tuple[str, ...] = tuple(sorted({e.stream for e in EVENTS if e.public}))


def valid_account(account: str) -> bool:
    """An account id in a team's rights is one literal subject token (a wildcard would be every account)."""
    return bool(_ACCOUNT.fullmatch(account))


def _fill(template: str, **values: str) -> str:
    """A subject template (`video.created.{account_id}`) with its tokens given; `*` stays a wildcard."""
    return ".".join(values[t[1:-1]] if t.startswith("{") else t for t in template.split("."))


def _account(account: str) -> dict[str, str]:
    return {ACCOUNT_TOKEN[1:-1]: account}


def public_subjects(account: str) -> tuple[str, ...]:
    """The subjects of every public event of one account (`video.created.<account>`, ...), in the order of
    sorted(PUBLIC_EVENTS); EVERY_ACCOUNT: of all accounts."""
    return tuple(_fill(contract(t).template, **_account(account)) for t in sorted(PUBLIC_EVENTS))


def rejected_subject(name: str) -> str:
    """Where encode tells the publisher `name` what it refused of its events (`publisher.<name>.rejected`)."""
    return _fill(_REJECTED.template, **{PUBLISHER_TOKEN[1:-1]: name})


def recording_subjects(name: str, accounts: tuple[str, ...], first_party: bool) -> tuple[str, ...]:
    """The recording subjects a publisher may publish: its accounts, its own name, `developer` (and `first_party`
    if it is first-party); the bare legacy `recording.completed` only if first-party (it names nobody)."""
    classes = [JobClass.DEVELOPER.value, *([JobClass.FIRST_PARTY.value] if first_party else [])]
    subjects = [_fill(_RECORDING.template, **_account(a), **{PUBLISHER_TOKEN[1:-1]: name, JOB_CLASS_TOKEN[1:-1]: c})
                for a in accounts for c in classes]
    return (*subjects, *([_RECORDING.type] if first_party and _RECORDING.legacy else []))


def account_filter(stream: str, account: str) -> str:
    """One durable filter for a stream's public events of one account: the public templates' tokens where they
    agree, `*` where they differ, the account itself at the account token (VIDEOS: `*.*.<account>`, ENCODE:
    `encode.*.<account>`). `violations` checks it reads nothing else of the stream."""
    templates = [e.template.split(".") for e in EVENTS if e.public and e.stream == stream]
    if not templates or len({len(t) for t in templates}) != 1:
        raise ValueError(f"{stream}'s public events have no one filter per account")
    out = []
    for column in zip(*templates, strict=True):
        if set(column) == {ACCOUNT_TOKEN}:
            out.append(account)
        elif len(set(column)) == 1 and not column[0].startswith("{"):
            out.append(column[0])
        else:
            out.append("*")
    return ".".join(out)
