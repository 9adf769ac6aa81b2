"""What must hold of the bus identities whatever shared/identities.py declares: the rules (who may publish and
subscribe to what, by role), each role's publish limits, and `violations`, which checks identities against them
(pure: for the tests, and for whoever writes a server configuration with extra identities, an outside team's, say).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from shared.authcheck import CHECK_SUBJECT, MANAGE_PREFIX
from shared.contracts import (
    AUTH_SPENT_SUBJECT,
    COUNTER_SUBJECTS,
    DLQ_SUBJECTS,
    EVENTS,
    LIMITS_STREAM,
    PUBLISHER,
    REPLAY_SUBJECTS,
    SWEEP_RUN_SUBJECT,
    WEBHOOKS_MANAGE_PREFIX,
    contract,
    event_subjects,
    published_by,
)
from shared.events import CATALOG
from shared.identities import (
    EVENT_PUBLISHERS,
    IDENTITIES,
    JS_ACK,
    JS_API,
    OPERATOR,
    READER_DENIED,
    SERVICES,
    Identity,
    covers,
    inbox_subjects,
    overlaps,
    tokens,
)
from shared.media.protocol import (
    CANCEL_PREFIX,
    HEARTBEAT_SUBJECT,
    OFFER_PREFIX,
    RESULT_SUBJECT,
    STATUS_SUBJECT,
    STATUS_V2_SUBJECT,
)
from shared.natsconn import INBOX_ROOT
from shared.publishersubjects import (
    EVERY_ACCOUNT,
    PUBLIC_STREAMS,
    public_subjects,
    recording_subjects,
    rejected_subject,
    valid_account,
)
from shared.streams import STREAMS, stream_named, subject_matches

_RECORDING = contract("recording.completed")  # a publisher's recordings, as in shared/publishersubjects.py


@dataclass(frozen=True)
class Rule:
    """Who (by role) may publish and who may subscribe to any subject `subjects` matches; None: not restricted."""

    subjects: str
    publish: frozenset[str] | None
    subscribe: frozenset[str] | None
    why: str


_ALL_SERVICES = frozenset(SERVICES)
_STREAM_CHANGES = ("CREATE", "UPDATE", "PURGE", "DELETE", "MSG.DELETE", "SNAPSHOT", "RESTORE", "PEER.REMOVE",
                   "LEADER.STEPDOWN")

# what must hold whatever the declaration says (who sends auth.check and farm offers, each event type only from its
# SPEC section 7 publisher, streams changed only by operator...); `violations` checks identities against them, purely
RULES: tuple[Rule, ...] = (
    Rule(CHECK_SUBJECT, frozenset({"api", OPERATOR}), frozenset({"auth"}),
         "auth.check is sent only by api and operator, answered only by auth"),
    Rule(f"{CHECK_SUBJECT}.>", frozenset({"api", OPERATOR}), frozenset({"auth"}),
         "anything below auth.check likewise"),
    Rule(f"{MANAGE_PREFIX}.>", frozenset({"api", OPERATOR}), frozenset({"auth"}),
         "auth.manage.* is sent only by api and operator, answered only by auth"),
    Rule("auth.>", frozenset({"api", OPERATOR, "auth"}), frozenset({"auth"}),
         "nobody but auth hears anything of auth's (auth.spent is auth's own)"),
    Rule(AUTH_SPENT_SUBJECT, frozenset({"auth"}), frozenset({"auth"}), "between auth instances only"),
    Rule(f"{OFFER_PREFIX}.*", frozenset({"encode"}), frozenset({"media"}), "only encode sends the farm's offers"),
    Rule(f"{CANCEL_PREFIX}.*", frozenset({"encode"}), frozenset({"media"}), "only encode cancels the farm's jobs"),
    Rule(HEARTBEAT_SUBJECT, frozenset({"media"}), frozenset({"encode"}), "a worker's own heartbeats"),
    Rule(RESULT_SUBJECT, frozenset({"media"}), frozenset({"encode"}), "a worker's own results"),
    Rule("farm.>", frozenset({"encode", "media"}), frozenset({"encode", "media"}), "the farm is encode and media"),
    Rule(STATUS_SUBJECT, frozenset({"api"}), frozenset({"encode"}), "the api asks encode for a video's state"),
    Rule(STATUS_V2_SUBJECT, frozenset({"api"}), frozenset({"encode"}), "the api asks encode for videos' states (v2)"),
    Rule(SWEEP_RUN_SUBJECT, frozenset({OPERATOR}), frozenset({"sweep"}), "`weir sweep run` asks the sweep"),
    Rule(f"{WEBHOOKS_MANAGE_PREFIX}.>", frozenset({"api"}), frozenset({"webhooks"}),
         "a developer's endpoints are managed through the api only, answered only by webhooks"),
    Rule(REPLAY_SUBJECTS, frozenset({OPERATOR}), frozenset(), "only `weir replay` writes replays; read by durables"),
    Rule(DLQ_SUBJECTS, _ALL_SERVICES, frozenset(), "services park what they cannot handle; nobody reads it live"),
    Rule(COUNTER_SUBJECTS, frozenset({"auth"}), frozenset(), "auth's counters"),
    Rule(f"{JS_API}.DIRECT.GET.{LIMITS_STREAM}.>", frozenset({"auth"}), None, "auth's counters, read"),
    *(Rule(f"{JS_API}.STREAM.{verb}.>", frozenset({OPERATOR}), None,
           "creating, changing, purging or deleting a stream is operator only") for verb in _STREAM_CHANGES),
    Rule(f"{JS_API}.ACCOUNT.>", frozenset({OPERATOR}), None, "account-wide JetStream changes: operator only"),
    Rule(f"{JS_API}.SERVER.>", frozenset(), None, "server administration: nobody on the bus"),
    Rule(f"{JS_API}.META.>", frozenset(), None, "the JetStream cluster's meta group: nobody on the bus"),
    Rule(f"{JS_API}.CONSUMER.DELETE.>", frozenset({OPERATOR}), None, "only `weir streams apply` deletes a "
         "consumer: a reader durable whose team lost the account, or one a reader must never have (push)"),
    Rule(f"{JS_API}.CONSUMER.CREATE.>", _ALL_SERVICES | {OPERATOR}, None, "a consumer is made by the service that "
         "reads it or by the operator, never by a publisher: a create's deliver subject is in its body, unchecked"),
    Rule(f"{JS_API}.CONSUMER.DURABLE.CREATE.>", _ALL_SERVICES | {OPERATOR}, None, "the legacy create likewise"),
    Rule("$SYS.>", frozenset(), frozenset(), "the system account's subjects: nobody"),
    Rule("$KV.>", frozenset(), frozenset(), "no key-value buckets in Weir"),
    *(Rule(subject, frozenset(e.publishers), None,
           f"{e.type} is published only by {', '.join(sorted(e.publishers))} (shared/contracts.py)")
      for e in EVENTS for subject in e.subjects),
)


# Everything a role may publish at most, whatever else the rules allow (its durables' JetStream API subjects aside):
# a media worker sends only its own heartbeats, results and the encoding events shared/contracts.py gives it; a
# publisher only its recordings and direct gets of the public streams (`_reader_violations`: of its accounts).
PUBLISH_LIMITS: dict[str, tuple[str, ...]] = {
    "media": (HEARTBEAT_SUBJECT, RESULT_SUBJECT, *event_subjects(published_by("media")), f"{JS_API}.INFO"),
    PUBLISHER: (*event_subjects(published_by(PUBLISHER)),
                *(f"{JS_API}.DIRECT.GET.{stream}.>" for stream in PUBLIC_STREAMS)),
}


def violations(identities: Iterable[Identity] | None = None) -> list[str]:
    """Every way the identities break a rule (empty: they hold). Pure: for the tests, and for whoever writes a
    server configuration (with extra identities, say an outside team's) to refuse a bad one."""
    ids = list(IDENTITIES.values() if identities is None else identities)
    names = [i.name for i in ids]
    found = [f"identity {n} is declared twice" for n in sorted({n for n in names if names.count(n) > 1})]
    for rule in RULES:
        for i in ids:
            pub = [r.subject for r in i.publish_rights() if overlaps(r.subject, rule.subjects)]
            if pub and rule.publish is not None and i.role not in rule.publish:
                found.append(f"{i.name} may publish {pub} ({rule.subjects}): {rule.why}")
            sub = [r.subject for r in i.subscribe_rights() if overlaps(r.subject, rule.subjects)]
            if sub and rule.subscribe is not None and i.role not in rule.subscribe:
                found.append(f"{i.name} may subscribe to {sub} ({rule.subjects}): {rule.why}")
    found += [f"event type {t} has no contract in shared/contracts.py" for t in CATALOG if t not in EVENT_PUBLISHERS]
    found += [f"event type {t} of shared/contracts.py is not in the catalog" for t in EVENT_PUBLISHERS
              if t not in CATALOG]
    for i in ids:
        limit = PUBLISH_LIMITS.get(i.role)
        if limit is not None:
            found += [f"{i.name} may publish {r.subject}: a {i.role} publishes only {', '.join(limit)}"
                      for r in i.publish if not any(covers(p, r.subject) for p in limit)]
        found += _inbox_violations(i, names)
        found += _durable_violations(i, ids)
        found += _reader_violations(i)
    return found


def _inbox_violations(i: Identity, names: list[str]) -> list[str]:
    """Replies: each identity reads only its own inbox, and publishes to none but by name."""
    found: list[str] = []
    own = inbox_subjects(i.name)
    for r in i.subscribe_rights():
        if overlaps(r.subject, f"{INBOX_ROOT}.>") and not covers(own, r.subject):
            found.append(f"{i.name} may subscribe to {r.subject}: another identity's replies")
        if r.subject in (">", f"{INBOX_ROOT}.*"):
            found.append(f"{i.name} may subscribe to {r.subject}")
    for r in i.publish_rights():
        if overlaps(r.subject, f"{INBOX_ROOT}.>"):
            t = tokens(r.subject)
            if len(t) < 3 or t[1] in ("*", ">") or t[1] not in names or t[1] == i.name:
                found.append(f"{i.name} may publish to {r.subject}: only a named identity's inbox, and by need")
    return found


def _durable_violations(i: Identity, ids: list[Identity]) -> list[str]:
    """A durable is read and acknowledged by its owner only (operator aside: `weir replay` reads ephemerals)."""
    found: list[str] = []
    operators = [o for o in ids if o.role == OPERATOR]
    for d in i.durables:
        if d.made_by_operator:  # `weir streams apply` makes it and removes it
            found += [f"{o.name} may not make {i.name}'s durable {d.stream}/{d.name} ({subject})" for o in operators
                      for subject in (d.create_subject(), f"{JS_API}.CONSUMER.DELETE.{d.stream}.{d.name}",
                                      f"{JS_API}.CONSUMER.INFO.{d.stream}.{d.name}")
                      if not o.may_publish(subject)]
        for other in ids:
            if other.name == i.name or other.role == OPERATOR:
                continue
            for subject in (f"{JS_API}.CONSUMER.MSG.NEXT.{d.stream}.{d.name}", f"{JS_ACK}.{d.stream}.{d.name}.x",
                            f"{JS_API}.CONSUMER.CREATE.{d.stream}.{d.name}"):
                if any(overlaps(r.subject, subject) or overlaps(r.subject, f"{subject}.>")
                       for r in other.publish_rights()):
                    found.append(f"{other.name} may use {i.name}'s durable {d.stream}/{d.name} ({subject})")
    return found


def _meet(a: str, b: str) -> str | None:
    """The subjects both `a` and `b` match, as one pattern (token by token the narrower); None when there are none."""
    if not overlaps(a, b):
        return None
    ta, tb = tokens(a), tokens(b)
    out: list[str] = []
    for i, (x, y) in enumerate(zip(ta, tb, strict=False)):
        if x == ">" or y == ">":
            return ".".join([*out, *(tb[i:] if x == ">" else ta[i:])])
        out.append(y if x == "*" else x)
    return ".".join(out)


def reader_scope(i: Identity) -> tuple[str, ...]:
    """Everything a publisher-like identity may read: its accounts' public subjects and its own rejections."""
    return (*(s for a in i.accounts for s in public_subjects(a)), rejected_subject(i.name))


def _reader_violations(i: Identity) -> list[str]:
    """A publisher reads only its accounts' public events and its own rejections (live, through its durables, by
    direct get), publishes only its recordings (its accounts, its name, its job classes), and never reads a stream
    past the filter its rights check (READER_DENIED)."""
    if i.role != PUBLISHER:
        return []
    found: list[str] = []
    if i.accounts == (EVERY_ACCOUNT,) and i.name != PUBLISHER:
        found.append(f"{i.name} reads every account: only the stack's own {PUBLISHER} does")
    found += [f"{i.name}: {a!r} is not an account id" for a in i.accounts
              if not valid_account(a) and i.accounts != (EVERY_ACCOUNT,)]
    scope = reader_scope(i)

    def within(subject: str) -> bool:
        return any(covers(p, subject) for p in scope)

    own_inbox = inbox_subjects(i.name)
    found += [f"{i.name} may subscribe to {r.subject}: outside its accounts' public events and its rejections"
              for r in i.subscribe_rights() if r.subject != own_inbox and not within(r.subject)]
    consumer_api = f"{JS_API}.CONSUMER."
    own_reads = {f"{JS_API}.CONSUMER.{verb}.{d.stream}.{d.name}" for d in i.durables for verb in ("INFO", "MSG.NEXT")}
    found += [f"{i.name} may publish {r.subject}: a publisher only looks up and fetches its own durables, the "
              "operator's making" for r in i.publish_rights()
              if overlaps(r.subject, f"{consumer_api}>") and r.subject not in own_reads]
    for d in i.durables:
        if not d.made_by_operator:
            found.append(f"{i.name}'s durable {d.name} is not made by the operator: a publisher never creates a "
                         "consumer (a create's deliver subject is not checked)")
        spec = next((s for s in STREAMS if s.name == d.stream), None)
        if spec is None:
            found.append(f"{i.name}'s durable {d.name} reads {d.stream}, which is not a declared stream")
            continue
        if len(d.subjects) != 1:
            found.append(f"{i.name}'s durable {d.name} has not exactly one filter: its create subject would allow "
                         "any")
            continue
        for kept in spec.subjects:
            meet = _meet(kept, d.subjects[0])
            if meet is not None and not within(meet):
                found.append(f"{i.name}'s durable {d.name} would read {meet}: outside its accounts' public events")
    direct = f"{JS_API}.DIRECT.GET."
    for r in i.publish:
        if r.subject.startswith(direct):
            stream, _, subject = r.subject.removeprefix(direct).partition(".")
            if not subject or not within(subject) or not any(subject_matches(k, subject) or overlaps(k, subject)
                                                             for k in stream_named(stream).subjects):
                found.append(f"{i.name} may publish {r.subject}: a direct get outside its accounts' public events")
        elif overlaps(r.subject, f"{_RECORDING.type}.>") or overlaps(r.subject, _RECORDING.type):
            allowed = recording_subjects(i.name, i.accounts, i.first_party)
            if not any(covers(p, r.subject) for p in allowed):
                found.append(f"{i.name} may publish {r.subject}: a recording of another account, publisher or job "
                             f"class than its own ({', '.join(allowed) or 'none'})")
    for r in i.publish_rights():
        found += [f"{i.name} may publish {r.subject}, which its denials refuse ({d.subject}): a dead right"
                  for d in i.deny_publish if overlaps(d.subject, r.subject)]
    missing = [d.subject for d in READER_DENIED if d not in i.deny_publish]
    if missing:
        found.append(f"{i.name} lacks the denials of unfiltered reads: {', '.join(missing)}")
    return found

