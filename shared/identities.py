"""Who may do what on the bus: one identity per service, `operator` (the `weir` CLI) and `publisher`.

Each connects with its own NKEY seed (shared/natsauth.py) and may use only the subjects listed here. `declared` rights
are what the service's FastStream broker declares (shared/brokerdeclared.py reads them; tests/unit/test_identities.py
compares both ways, so a handler without its permission fails a test, not production); the others are added by hand
with their reason (JetStream API, nats-py requests, the brokerless `operator` and `publisher`). Built from
shared/contracts.py, a publisher-like identity's subjects from shared/publishersubjects.py; the rules every identity
must keep are in shared/identityrules.py. Pure, imports no service.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from shared.authcheck import CHECK_SUBJECT, MANAGE_OPERATIONS, manage_subject
from shared.contracts import (
    AUTH_SPENT_SUBJECT,
    DLQ_STREAM,
    EVENTS,
    LIMITS_STREAM,
    PUBLIC_EVENTS,
    PUBLISHER,
    REPLAY_STREAM,
    REPLAY_SUBJECTS,
    SWEEP_RUN_SUBJECT,
    consumed_by,
    consumers_of,
    contract,
    dlq_subject,
    event_subjects,
    heard_by,
    published_by,
    replay_durable,
    replay_filter,
)
from shared.media.protocol import (
    CANCEL_PREFIX,
    HEARTBEAT_SUBJECT,
    OFFER_PREFIX,
    RESULT_SUBJECT,
    STATUS_SUBJECT,
    STATUS_V2_SUBJECT,
)
from shared.natsconn import inbox_prefix
from shared.publishersubjects import (
    EVERY_ACCOUNT,
    PUBLIC_STREAMS,
    account_filter,
    public_subjects,
    recording_subjects,
    rejected_subject,
    valid_account,
)
from shared.streams import stream_for_subject, stream_named
from shared.webhookcalls import OPERATIONS as WEBHOOK_OPERATIONS
from shared.webhookcalls import manage_subject as manage_webhooks

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
JS_API = "$JS.API"
JS_ACK = "$JS.ACK"

LIMITS_SUBJECTS = stream_named(LIMITS_STREAM).subjects  # auth's counters

SERVICES: tuple[str, ...] = ("auth", "api", "encode", "media", "sweep", "webhooks")
OPERATOR = "operator"

# The only publishers (by role) of each event type, from shared/contracts.py. The roles are the identities' names;
# an outside team given a publisher-like identity of its own (`publisher_like`) has the role `publisher`.
EVENT_PUBLISHERS: dict[str, frozenset[str]] = {e.type: frozenset(e.publishers) for e in EVENTS}

# how long a responder may answer a request it received, and how often (nats-server's `allow_responses`): one reply
# each; a minute is far beyond any caller's timeout (auth.check waits 2 s, `sweep.run` 30 s), and an expiry lets the
# server forget the requests never answered (events a service hears that carry a PubAck inbox as their reply)
RESPONSE_MAX = 1
RESPONSE_EXPIRES = "1m"


# ------------------------------------------------------------------------------------------------- subjects


def tokens(subject: str) -> list[str]:
    return subject.split(".")


def covers(pattern: str, subject: str) -> bool:
    """Every subject `subject` can stand for (it may hold wildcards) is matched by `pattern`."""
    p, s = tokens(pattern), tokens(subject)
    for i, tok in enumerate(p):
        if tok == ">":
            return len(s) > i
        if i >= len(s) or s[i] == ">":
            return False
        if tok != "*" and (s[i] == "*" or tok != s[i]):
            return False
    return len(p) == len(s)


def overlaps(a: str, b: str) -> bool:
    """Some subject is matched by both `a` and `b` (wildcards on either side)."""
    ta, tb = tokens(a), tokens(b)
    for i in range(max(len(ta), len(tb))):
        if i >= len(ta) or i >= len(tb):
            return False
        x, y = ta[i], tb[i]
        if x == ">" or y == ">":
            return True
        if x != y and x != "*" and y != "*":
            return False
    return True


def valid_name(name: str) -> bool:
    """An identity's name is one subject token, a durable name's prefix and a file name: letters, digits, - and _."""
    return bool(_NAME.fullmatch(name))


def inbox_subjects(name: str) -> str:
    return f"{inbox_prefix(name)}.>"


# ------------------------------------------------------------------------------------------------- the declaration


@dataclass(frozen=True)
class Right:
    """One subject (wildcards allowed) an identity may publish or subscribe to, and why."""

    subject: str
    why: str
    declared: bool = False  # the service's FastStream broker declares it (the tests compare both ways)


@dataclass(frozen=True)
class Durable:
    """A JetStream durable pull consumer an identity creates (if missing), reads and acknowledges.

    `subjects` are its filter subjects (`()`: the whole stream). With exactly one, the create request names it in
    its subject (`$JS.API.CONSUMER.CREATE.<stream>.<durable>.<filter>`) and nats-server refuses a request whose
    configured filter differs, so the right to create is the right to read that filter only; with several, the
    subject names none (`$JS.API.CONSUMER.CREATE.<stream>.<durable>`), which is fine for a service's own durable on
    a stream it may read whole, and never given to a reader restricted to part of a stream."""

    stream: str
    name: str
    subjects: tuple[str, ...]
    why: str
    # made by the operator (`weir streams apply`, from the teams file), never by its reader: a create request's body
    # may name a deliver subject, which nats-server does not check, so whoever may create a consumer may make it push
    # the stream onto any subject (a service's `farm.result`, say). Its reader only looks it up, fetches and acks.
    made_by_operator: bool = False

    def key(self) -> tuple[str, str, tuple[str, ...]]:
        """What tells two durables apart: stream, name and filters (their order does not matter)."""
        return self.stream, self.name, tuple(sorted(self.subjects))

    def create_subject(self) -> str:
        base = f"{JS_API}.CONSUMER.CREATE.{self.stream}.{self.name}"
        return f"{base}.{self.subjects[0]}" if len(self.subjects) == 1 else base

    def rights(self) -> tuple[Right, ...]:
        """The JetStream API subjects of the pull-consumer flow (nats-py's `pull_subscribe` with stream and durable:
        consumer info, create when missing, fetch, then ack/nak/in-progress on each message's reply subject); an
        operator-made durable's reader never creates it."""
        s, d = self.stream, self.name
        create = () if self.made_by_operator else (
            Right(self.create_subject(), f"creates its durable {d} on {s} when missing"),)
        return (
            Right(f"{JS_API}.CONSUMER.INFO.{s}.{d}", f"looks up its durable {d} before binding"),
            *create,
            Right(f"{JS_API}.CONSUMER.MSG.NEXT.{s}.{d}", f"fetches from {d}"),
            # a responder could ack once per delivery through allow_responses; this right also serves one that is
            # not (api) and a second answer to one delivery (in progress, then ack)
            Right(f"{JS_ACK}.{s}.{d}.>", f"acknowledges (ack, nak with delay) what {d} delivered"),
        )


@dataclass(frozen=True)
class Identity:
    """Who connects with one seed: what it may publish and subscribe to, the durables it reads, whether it answers
    requests. Its inbox (`_INBOX.<name>.>`) is always its own to read, and no one else's."""

    name: str
    role: str  # what RULES and EVENT_PUBLISHERS know it as: its own name, or `publisher` for a publisher-like one
    description: str
    publish: tuple[Right, ...] = ()
    subscribe: tuple[Right, ...] = ()
    durables: tuple[Durable, ...] = ()
    # answers on the requester's inbox through nats-server's `allow_responses` (one reply per request received),
    # never through a right to publish to `_INBOX.>`
    responds: bool = False
    # publishes nats-server refuses even if an allow list grew to cover them (a publisher's unfiltered reads)
    deny_publish: tuple[Right, ...] = ()
    # a publisher-like identity's accounts (SPEC 12): the only ones whose events it reads and whose recordings it
    # publishes; (EVERY_ACCOUNT,) for the stack's own publisher. `first_party`: its recordings may be first-party.
    accounts: tuple[str, ...] = ()
    first_party: bool = False

    @property
    def inbox_prefix(self) -> str:
        return inbox_prefix(self.name)

    def publish_rights(self) -> tuple[Right, ...]:
        """Everything it may publish: its rights and its durables' JetStream API subjects."""
        return self.publish + tuple(r for d in self.durables for r in d.rights())

    def subscribe_rights(self) -> tuple[Right, ...]:
        """Everything it may subscribe to: its rights and its own inbox (replies, PubAcks, fetched messages)."""
        own = Right(inbox_subjects(self.name), "its own inbox: replies to its requests, PubAcks, fetched messages")
        return (*self.subscribe, own)

    def may_publish(self, subject: str) -> bool:
        return any(covers(r.subject, subject) for r in self.publish_rights()) and \
            not any(overlaps(r.subject, subject) for r in self.deny_publish)

    def may_subscribe(self, subject: str) -> bool:
        return any(covers(r.subject, subject) for r in self.subscribe_rights())


# --------------------------------------------------------------------------------------- building blocks


def _declared(subject: str, why: str) -> Right:
    return Right(subject, why, declared=True)


def _event_rights(event_type: str, why: str) -> tuple[Right, ...]:
    """An event type's subjects (shared/contracts.py): its template's wildcard (`video.created.*`), which the broker
    declares, and while the contract keeps it the bare legacy type, which the relay's copy uses (not declared)."""
    c = contract(event_type)
    rights = [_declared(c.wildcard, why)]
    rights += [Right(s, f"{why}: the bare type, a copy for consumers of the release before (SPEC 11)")
               for s in c.subjects if s != c.wildcard]
    return tuple(rights)


def _events(service: str) -> tuple[Right, ...]:
    """The event types a service publishes from its outbox: a JetStream publish whose PubAck comes to its inbox."""
    return tuple(r for t in published_by(service)
                 for r in _event_rights(t, f"its {t} events (outbox relay; JetStream publish, PubAck to its inbox)"))


def _heard(service: str) -> tuple[Right, ...]:
    """The event types a service hears live: a core subscription on every instance."""
    return tuple(r for t in heard_by(service)
                 for r in _event_rights(t, f"every instance hears {t} at once (core subscription)"))


@dataclass(frozen=True)
class _EventConsumer:
    """What shared/bus.py's EventConsumer makes for one ConsumerSpec: the durable on the events' stream, the
    `<name>_replay` durable on REPLAY (`replay.<name>.>`, written by `weir replay`), and `dlq.<type>` for each type
    it parks (a JetStream publish into DLQ)."""

    name: str
    types: tuple[str, ...]
    why: str
    durables: tuple[Durable, ...] = field(init=False)
    parks: tuple[Right, ...] = field(init=False)

    def __post_init__(self) -> None:
        subjects = event_subjects(self.types)  # each type's account subject and its bare legacy type
        stream = stream_for_subject(subjects[0]).name
        main = Durable(stream, self.name, subjects, self.why)
        replay = Durable(REPLAY_STREAM, replay_durable(self.name), (replay_filter(self.name),),
                         f"{self.why}: what `weir replay` re-delivers")
        object.__setattr__(self, "durables", (main, replay))
        object.__setattr__(self, "parks", tuple(
            _declared(dlq_subject(t), f"{self.name} parks a {t} it cannot handle (JetStream publish into DLQ)")
            for t in self.types))


def _consumers(service: str) -> tuple[tuple[Durable, ...], tuple[Right, ...]]:
    """The durables and dead-letter rights of a service's consumers (shared/contracts.py)."""
    consumers = [_EventConsumer(c.name, consumed_by(c.name), c.description) for c in consumers_of(service)]
    return (tuple(d for c in consumers for d in c.durables), tuple(r for c in consumers for r in c.parks))


_JS_INFO = Right(f"{JS_API}.INFO", "/readyz asks JetStream for the account's info (`js.account_info()`)")
_MANAGE_SUBJECTS = tuple(manage_subject(op) for op in MANAGE_OPERATIONS)


def _auth_requests(*, declared: bool) -> tuple[Right, ...]:
    why = "asks auth (request/reply, the reply on its own inbox)"
    subjects = (CHECK_SUBJECT, *_MANAGE_SUBJECTS)
    return tuple(Right(s, why, declared=declared) for s in subjects)


# ------------------------------------------------------------------------------------------------- identities

_api_consumers, _api_parks = _consumers("api")
_webhooks_consumers, _webhooks_parks = _consumers("webhooks")
_encode_consumers, _encode_parks = _consumers("encode")

AUTH = Identity(
    name="auth", role="auth",
    description="accounts, keys, auth.check and the management operations; the request-limit counters",
    responds=True,  # answers auth.check and auth.manage.<op> on the requester's inbox
    publish=(
        *_events("auth"),
        _declared(AUTH_SPENT_SUBJECT, "budgets this instance saw spent, for every auth instance"),
        *(Right(s, "request-limit counters: `Nats-Incr` publishes into the LIMITS counter stream, the new total "
                   "in the PubAck on its inbox (services/auth/counters.py, nats-py request)") for s in LIMITS_SUBJECTS),
        *(Right(f"{JS_API}.DIRECT.GET.{LIMITS_STREAM}.{s}", "reads a counter's total by direct get (the LIMITS "
                "stream allows direct gets; services/auth/counters.py)") for s in LIMITS_SUBJECTS),
        _JS_INFO,
    ),
    subscribe=(
        _declared(CHECK_SUBJECT, "decides each API request (queue group auth)"),
        *(_declared(s, "a management operation (queue group auth)") for s in _MANAGE_SUBJECTS),
        *_heard("auth"),
        _declared(AUTH_SPENT_SUBJECT, "budgets another instance saw spent"),
    ),
)

API = Identity(
    name="api", role="api",
    description="the public HTTP API: asks auth, asks encode for a video's status, publishes video events",
    publish=(
        *_events("api"),
        *_auth_requests(declared=True),
        _declared(STATUS_SUBJECT, "GET /v1/videos/{id} asks encode for the processing state (v1: an encode of "
                                  "release 1.0.0 answers only it)"),
        _declared(STATUS_V2_SUBJECT, "GET /v1/videos (a page) and GET /v1/videos/{id} ask encode for processing "
                                     "states (v2)"),
        *_api_parks,
        *(_declared(manage_webhooks(op), "asks the webhooks service (request/reply, the reply on its own inbox)")
          for op in WEBHOOK_OPERATIONS),
        _JS_INFO,
    ),
    durables=_api_consumers,
)

ENCODE = Identity(
    name="encode", role="encode",
    description="dispatch: offers outputs to the farm, hears its heartbeats and results, answers status requests",
    responds=True,  # answers farm.result and encode.status (v1 and v2)
    publish=(
        *_events("encode"),
        _declared(f"{OFFER_PREFIX}.*", "offers one output to one worker (request; the answer on its inbox)"),
        _declared(f"{CANCEL_PREFIX}.*", "tells one worker to stop jobs encode does not want"),
        *_encode_parks,
        _JS_INFO,
    ),
    subscribe=(
        _declared(HEARTBEAT_SUBJECT, "every worker's heartbeat (every instance)"),
        _declared(RESULT_SUBJECT, "a worker's result of one output (request, queue group encode)"),
        _declared(STATUS_SUBJECT, "the api's status request, v1 (queue group encode)"),
        _declared(STATUS_V2_SUBJECT, "the api's status request, v2: many videos (queue group encode)"),
    ),
    durables=_encode_consumers,
)

MEDIA = Identity(
    name="media", role="media",
    description="an encoding worker: answers offers, reports progress, heartbeats and results",
    responds=True,  # answers the offers (accepted or busy)
    publish=(
        *_events("media"),  # published from the worker, JetStream-acknowledged
        _declared(HEARTBEAT_SUBJECT, "its slots and running jobs"),
        _declared(RESULT_SUBJECT, "the result of one output (request to encode; the ResultAck on its inbox)"),
        _JS_INFO,
    ),
    subscribe=(
        # one subject per worker instance (a uuid made at start): any instance of the media identity
        _declared(f"{OFFER_PREFIX}.*", "offers to this worker (its instance id in the subject)"),
        _declared(f"{CANCEL_PREFIX}.*", "cancellations for this worker"),
    ),
)

SWEEP = Identity(
    name="sweep", role="sweep",
    description="the sweep: retires uploads that never received a file",
    responds=True,  # answers sweep.run (accepted or refused)
    publish=(
        *_events("sweep"),
        # the run's progress and report go to the `updates` inbox the request named (a publish, not a reply: many
        # of them, after the reply): only `weir sweep run` asks, so only the operator's inbox
        Right(f"{inbox_prefix(OPERATOR)}.>", "progress and report of a run, to the inbox `weir sweep run` named"),
        _JS_INFO,
    ),
    subscribe=(
        _declared(SWEEP_RUN_SUBJECT, "`weir sweep run`: run the sweep now (request, queue group sweep)"),
    ),
)

WEBHOOKS = Identity(
    name="webhooks", role="webhooks",
    description="developers' endpoints: delivers the public events to them, signed and retried",
    responds=True,  # answers webhooks.manage.<op>
    publish=(
        *_events("webhooks"),
        *_webhooks_parks,
        _JS_INFO,
    ),
    subscribe=tuple(_declared(manage_webhooks(op), "a management operation from the api (queue group webhooks)")
                    for op in WEBHOOK_OPERATIONS),
    durables=_webhooks_consumers,
)

_STREAM_ADMIN = tuple(
    Right(f"{JS_API}.STREAM.{verb}.*", why) for verb, why in (
        ("INFO", "`weir streams apply` and `weir replay` read a stream's configuration and state"),
        ("CREATE", "`weir streams apply` creates the declared streams"),
        ("UPDATE", "`weir streams apply` brings a stream to its declaration"),
        ("PURGE", "an operator empties a stream (operator only)"),
        ("DELETE", "an operator deletes a stream (operator only)"),
    ))

OPERATOR_IDENTITY = Identity(
    name=OPERATOR, role=OPERATOR,
    description="the `weir` CLI: streams apply, replay, sweep run, the management operations",
    publish=(
        _JS_INFO,
        *_STREAM_ADMIN,
        Right(f"{JS_API}.CONSUMER.LIST.*", "`weir replay` finds the consumers of the replayed subject; `weir streams "
              "apply` the consumers of the public streams (reader durables, push consumers)"),
        # `weir replay` reads the slice with an ephemeral consumer (a random name) filtered on the replayed subject
        Right(f"{JS_API}.CONSUMER.CREATE.*.*.>", "`weir replay` reads a slice with an ephemeral, filtered consumer; "
              "`weir streams apply` makes each publisher's durables (pull, its filter in the subject)"),
        Right(f"{JS_API}.CONSUMER.CREATE.*.*", "`weir replay` reads a slice of several subjects (every account's "
              "and the bare legacy type) with an ephemeral: nats-py then names no filter in the subject"),
        Right(f"{JS_API}.CONSUMER.INFO.*.*", "`weir replay` asks how much the slice holds; `weir streams apply` "
              "looks up each reader durable"),
        Right(f"{JS_API}.CONSUMER.DELETE.*.*", "`weir streams apply` removes a reader durable whose team lost the "
              "account, and any push consumer on a public stream (Weir makes none)"),
        Right(f"{JS_API}.CONSUMER.MSG.NEXT.*.*", "`weir replay` fetches the slice"),
        Right(REPLAY_SUBJECTS, "`weir replay` re-delivers to replay.<consumer>.<type> (JetStream publish into REPLAY); "
              "`weir dlq redrive` sends a parked event back the same way"),
        Right(f"{JS_API}.STREAM.MSG.DELETE.{DLQ_STREAM}", "`weir dlq redrive` removes a parked message once its "
              "consumer has handled it (the DLQ only: no other stream's message is the operator's to remove)"),
        *_auth_requests(declared=False),  # `weir accounts|apps|keys ...`: auth.check, then the op
        Right(SWEEP_RUN_SUBJECT, "`weir sweep run` asks the sweep service (request; updates on its inbox)"),
    ),
)


# ------------------------------------------------------------------------------------- publisher-like identities


def _public_durables(name: str, accounts: tuple[str, ...]) -> tuple[Durable, ...]:
    """A reader's own durables: one per public stream and account, `<name>_<stream>_<account>` (the stack's own
    publisher: `<name>_<stream>`), each with one filter on its account's public events of the stream. The operator
    makes them (pull, explicit ack: `weir streams apply`, from the teams file): the reader may look them up, fetch
    and ack, and never create, change or delete a consumer (a create's deliver subject is not checked)."""
    def durable_name(stream: str, account: str) -> str:
        return f"{name}_{stream.lower()}" + ("" if account == EVERY_ACCOUNT else f"_{account}")

    return tuple(
        Durable(stream, durable_name(stream, account), (account_filter(stream, account),),
                f"the public {stream} events of {'every account' if account == EVERY_ACCOUNT else account}, durable",
                made_by_operator=True)
        for account in accounts for stream in PUBLIC_STREAMS)


# what a publisher may never publish, denied beside its allow list so that no right added later reopens them: a
# consumer made, changed or deleted (a create's body names its deliver subject, which nats-server does not check: a
# push consumer would deliver the stream onto any subject, a service's included), or a stream read whole or by
# sequence, past the filter in the subject its rights check
READER_DENIED: tuple[Right, ...] = (
    Right(f"{JS_API}.CONSUMER.CREATE.>", "any consumer create or update (an update is a create): its deliver "
          "subject and its filter (when not in the subject) are in the body, unchecked"),
    Right(f"{JS_API}.CONSUMER.DURABLE.CREATE.>", "the legacy durable create: its filter is not in the subject"),
    Right(f"{JS_API}.CONSUMER.DELETE.>", "a consumer deleted: its durables are the operator's to remove"),
    Right(f"{JS_API}.DIRECT.GET.*", "a direct get by sequence, or with the subject in the body"),
    Right(f"{JS_API}.STREAM.MSG.GET.>", "a stream's message get: by sequence, any subject"),
)


def publisher_like(name: str, accounts: Iterable[str] = (), *, first_party: bool = False,
                   description: str = "") -> Identity:
    """A `publisher` of its own (its seed, inbox and durables): what an outside team gets (SPEC 12). It reads the
    public events of its `accounts` only (live, through its durables, by direct get of one subject) and
    `publisher.<name>.rejected`; it publishes recordings of its accounts under its own name, as `developer` jobs
    unless `first_party`. Pass it to `violations` and to the server configuration as an extra identity."""
    if not valid_name(name) or (name in IDENTITIES and name != PUBLISHER):
        raise ValueError(f"not a free identity name: {name!r}")
    chosen = tuple(dict.fromkeys(accounts))
    every = chosen == (EVERY_ACCOUNT,) and name == PUBLISHER  # the stack's own publisher only
    bad = [a for a in chosen if not valid_account(a) and not every]
    if bad:
        raise ValueError(f"not account ids (letters, digits, - and _): {bad}")
    scope = "every account" if chosen == (EVERY_ACCOUNT,) else ", ".join(chosen) or "no account"
    return Identity(
        name=name, role=PUBLISHER, accounts=chosen, first_party=first_party,
        description=description or f"a {'first-party ' if first_party else ''}publisher of recordings and reader "
        f"of the public events of {scope} ({name})",
        publish=(
            *(Right(s, "its recordings to encode (JetStream publish, PubAck to its inbox)")
              for s in recording_subjects(name, chosen, first_party)),
            *(Right(f"{JS_API}.DIRECT.GET.{contract(t).stream}.{s}", "the last event of one of its subjects "
                    "(direct get by subject; the server refuses a sequence in the body)")
              for a in chosen for t, s in zip(sorted(PUBLIC_EVENTS), public_subjects(a), strict=True)),
        ),
        subscribe=(
            *(Right(s, "a public event of its accounts, live (core subscription)") for a in chosen
              for s in public_subjects(a)),
            Right(rejected_subject(name), "what encode refused of its events, and why (its own only)"),
        ),
        durables=_public_durables(name, chosen),
        deny_publish=READER_DENIED,
    )


IDENTITIES: dict[str, Identity] = {}  # filled below; `publisher_like` checks names against it
# the stack's own publisher (`weir up`'s, the platform's recording services): first-party, for every account
PUBLISHER_IDENTITY = publisher_like(
    PUBLISHER, (EVERY_ACCOUNT,), first_party=True,
    description="the platform's first-party publisher of recordings, for every account, and a reader of every "
    "account's public events")

IDENTITIES.update({
    i.name: i for i in (AUTH, API, ENCODE, MEDIA, SWEEP, WEBHOOKS, OPERATOR_IDENTITY, PUBLISHER_IDENTITY)
})


def connect_options(name: str, seed_path: str) -> dict[str, str]:
    """What `nats.connect` (and `NatsBroker`) take to connect as `name`: its seed file and its own inbox prefix."""
    return {"nkeys_seed": seed_path, "inbox_prefix": inbox_prefix(name)}
