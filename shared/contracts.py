"""The bus declared once: subject and stream names, one row per event type (publisher, stream, consumers) and one
per request/reply (or fire-and-forget) contract (subject, responder, callers, models, version).

Streams' subjects (streams.py), identities' rights (identities.py), `ServiceDefinition.publishes`, the consumers a
service may run (`check_consumer`), the AsyncAPI check (events/documents.py), the contract versions a service shows
(contractversions.py) and the contract snapshots and their compatibility check (shared/compat.py, `weir contracts`)
derive from it. Models are named as "module:Name" strings, resolved where they are used: imports nothing of Weir's.
"""

from __future__ import annotations

from dataclasses import dataclass

# --- subjects that are not event types

AUTH_SPENT_SUBJECT = "auth.spent"  # auth instances tell each other the budgets they saw spent
SWEEP_RUN_SUBJECT = "sweep.run"  # `weir sweep run` asks the sweep service for a run
AUTH_CHECK_SUBJECT = "auth.check"  # the edge asks auth for one request's decision
AUTH_MANAGE_PREFIX = "auth.manage"  # auth.manage.<op>: one management operation
ENCODE_STATUS_SUBJECT = "encode.status"  # the api asks encode for a video's processing state
ENCODE_STATUS_V2_SUBJECT = "encode.status.v2"  # the api asks encode for many videos' processing states (v2)
FARM_OFFER_PREFIX = "farm.offer"  # farm.offer.<worker instance>: encode offers one output to one worker
FARM_CANCEL_PREFIX = "farm.cancel"  # farm.cancel.<worker instance>: encode tells one worker to stop jobs
FARM_HEARTBEAT_SUBJECT = "farm.heartbeat"  # every worker's slots and running jobs, to every encode instance
FARM_RESULT_SUBJECT = "farm.result"  # a worker's result of one output, to one encode instance
COUNTER_PREFIX = "limits"  # auth's request-limit counters: limits.<rule>.<key>.<window start>
DLQ_PREFIX = "dlq."  # dlq.<type>: an event a consumer parked
REPLAY_PREFIX = "replay."  # replay.<consumer>.<type>: `weir replay`'s copy of an event for one consumer
WEBHOOKS_MANAGE_PREFIX = "webhooks.manage"  # webhooks.manage.<op>: the api manages a developer's endpoints


def all_below(prefix: str) -> str:
    """The wildcard subject of everything below a prefix (`limits` or `dlq.` -> `limits.>`, `dlq.>`)."""
    return f"{prefix.rstrip('.')}.>"


COUNTER_SUBJECTS = all_below(COUNTER_PREFIX)
DLQ_SUBJECTS = all_below(DLQ_PREFIX)
REPLAY_SUBJECTS = all_below(REPLAY_PREFIX)


def dlq_subject(event_type: str) -> str:
    """The dead-letter subject where a consumer parks an event of this type that it cannot handle."""
    return f"{DLQ_PREFIX}{event_type}"


def replay_subject(consumer: str, event_type: str) -> str:
    """Where `weir replay` sends one consumer its copy of an event of this type."""
    return f"{REPLAY_PREFIX}{consumer}.{event_type}"


def replay_filter(consumer: str) -> str:
    """Everything replayed to one consumer: its `<name>_replay` durable's filter."""
    return f"{REPLAY_PREFIX}{consumer}.>"


def replay_durable(consumer: str) -> str:
    return f"{consumer}_replay"


# --- streams (their configuration: shared/streams.py)

AUTH_STREAM = "AUTH"
VIDEOS_STREAM = "VIDEOS"
RECORDINGS_STREAM = "RECORDINGS"
ENCODE_STREAM = "ENCODE"
DLQ_STREAM = "DLQ"
REPLAY_STREAM = "REPLAY"
LIMITS_STREAM = "LIMITS"
WEBHOOKS_STREAM = "WEBHOOKS"

# --- who publishes and who reads each event type

PUBLISHER = "publisher"  # the role of a first-party or outside publisher (shared/identities.py)


@dataclass(frozen=True)
class ConsumerContract:
    """A durable consumer: the service that runs it, and what it is for."""

    name: str  # its durable name; also its inbox key and its replay subject's token
    service: str
    description: str


ACCOUNT_TOKEN = "{account_id}"  # a subject's account token (SPEC 12): a team's rights name its accounts there
PUBLISHER_TOKEN = "{publisher}"  # a subject's publisher-identity token: its rights name only its own
JOB_CLASS_TOKEN = "{job_class}"  # a recording's job class: a team's rights allow `developer` unless first-party
ACCOUNT_SUBJECTS_SINCE = "1.1.0"  # the release whose events carry their account in the subject (SPEC 11, 12)


@dataclass(frozen=True)
class EventContract:
    """One event type on the bus. Its subject is `subject` with each `{token}` filled from the event (the data field
    of that name; a recording's from its publisher's rights), or its type when `subject` is empty. `legacy`: the bare
    type is still published beside it (a copy) and read, for consumers of the release before ACCOUNT_SUBJECTS_SINCE;
    contracted once no such consumer runs."""

    type: str
    publishers: tuple[str, ...]  # roles: a service's name, or PUBLISHER
    stream: str
    consumers: tuple[str, ...] = ()  # durable names (CONSUMERS)
    listeners: tuple[str, ...] = ()  # services that also hear it live (a core subscription: every instance, no replay)
    public: bool = False  # an outside publisher may read it, of its own accounts only (SPEC 12)
    subject: str = ""  # the template: `video.created.{account_id}`; empty: the type itself
    legacy: bool = False

    @property
    def template(self) -> str:
        return self.subject or self.type

    @property
    def tokens(self) -> tuple[str, ...]:
        """The template's tokens to fill (`account_id`, ...), in subject order."""
        return tuple(t[1:-1] for t in self.template.split(".") if t.startswith("{"))

    @property
    def wildcard(self) -> str:
        """The NATS subject matching every subject of the template (`video.created.*`)."""
        return ".".join("*" if t.startswith("{") else t for t in self.template.split("."))

    @property
    def subjects(self) -> tuple[str, ...]:
        """What streams keep and consumers read: the template's wildcard, and the bare type while `legacy`."""
        return (self.wildcard, self.type) if self.legacy and self.wildcard != self.type else (self.wildcard,)

    def fill(self, values: dict[str, object]) -> str | None:
        """The subject for these token values; None when one is missing or not a plain token (the event then goes
        on its legacy subject only, where a team's rights never reach)."""
        out = []
        for t in self.template.split("."):
            if t.startswith("{"):
                v = values.get(t[1:-1])
                if not isinstance(v, str) or not v or any(c in v for c in ".*> \t\r\n"):
                    return None
                out.append(v)
            else:
                out.append(t)
        return ".".join(out)

    def parse(self, subject: str) -> dict[str, str] | None:
        """The token values of one of its subjects (`{}` for the bare type), None if the subject is not its."""
        if subject == self.type:
            return {}
        pattern, got = self.template.split("."), subject.split(".")
        if len(pattern) != len(got):
            return None
        values = {}
        for p, t in zip(pattern, got, strict=True):
            if p.startswith("{"):
                values[p[1:-1]] = t
            elif p != t:
                return None
        return values


def _public(type: str, publishers: tuple[str, ...], stream: str, consumers: tuple[str, ...] = ()) -> EventContract:
    """A public event: on `<type>.<account_id>`, and on its bare type beside it for one release (SPEC 11)."""
    return EventContract(type, publishers, stream, consumers, public=True, subject=f"{type}.{ACCOUNT_TOKEN}",
                         legacy=True)


CONSUMERS: tuple[ConsumerContract, ...] = (
    ConsumerContract("api_status", "api", "the video status shown by the API"),
    ConsumerContract("encode_uploads", "encode", "developer uploads to encode"),
    ConsumerContract("encode_recordings", "encode", "first-party recordings to encode"),
    ConsumerContract("encode_deletions", "encode", "deleted videos: stop their encoding"),
    ConsumerContract("encode_videos", "encode", "each video's account, so that a team's recording names only its own"),
    # one per stream read (a video's events come from two, webhooks' own from a third)
    ConsumerContract("webhooks_videos", "webhooks", "videos' and uploads' events, to developers' endpoints"),
    ConsumerContract("webhooks_encode", "webhooks", "encoding events, to developers' endpoints"),
    ConsumerContract("webhooks_own", "webhooks", "the service's own events (an endpoint disabled), to the app's "
                     "other endpoints"),
)

# SPEC 7 allows encode and media to publish each encoding event; each is published by the one that has it.
# Not public: credential.rejected (client addresses, key prefixes), key.* (accounts' keys), dispatch.busy (the
# farm's workers and load), recording.completed (each first-party team's own recordings).
EVENTS: tuple[EventContract, ...] = (
    EventContract("credential.rejected", ("auth",), AUTH_STREAM),
    EventContract("key.created", ("auth",), AUTH_STREAM),
    EventContract("key.revoked", ("auth",), AUTH_STREAM, listeners=("auth",)),  # each instance forgets the key
    _public("video.created", ("api",), VIDEOS_STREAM, ("encode_videos", "webhooks_videos")),
    _public("video.deleted", ("api",), VIDEOS_STREAM, ("encode_deletions", "webhooks_videos")),
    _public("video.retired", ("sweep",), VIDEOS_STREAM, ("webhooks_videos",)),
    _public("upload.completed", ("api",), VIDEOS_STREAM, ("encode_uploads", "webhooks_videos")),
    # a video's outcome, announced by the api (which projects encode's events): new in 1.1.0, on its account's
    # subject only (no release before it read a bare one)
    EventContract("video.ready", ("api",), VIDEOS_STREAM, ("webhooks_videos",), public=True,
                  subject=f"video.ready.{ACCOUNT_TOKEN}"),
    EventContract("video.failed", ("api",), VIDEOS_STREAM, ("webhooks_videos",), public=True,
                  subject=f"video.failed.{ACCOUNT_TOKEN}"),
    # a video's caption tracks changed: new in 1.1.0, on its account's subject only
    EventContract("video.captions_changed", ("api",), VIDEOS_STREAM, ("webhooks_videos",), public=True,
                  subject=f"video.captions_changed.{ACCOUNT_TOKEN}"),
    # a team publishes on its own accounts and name only; encode reads who sent it from the subject (SPEC 12)
    EventContract("recording.completed", (PUBLISHER,), RECORDINGS_STREAM, ("encode_recordings",),
                  subject=f"recording.completed.{ACCOUNT_TOKEN}.{PUBLISHER_TOKEN}.{JOB_CLASS_TOKEN}", legacy=True),
    # what encode refused of a team's recordings, on a subject only that team may read
    EventContract("publisher.rejected", ("encode",), RECORDINGS_STREAM,
                  subject=f"publisher.{PUBLISHER_TOKEN}.rejected"),
    EventContract("dispatch.busy", ("encode",), ENCODE_STREAM, ("api_status",)),
    _public("encode.started", ("encode",), ENCODE_STREAM, ("api_status", "webhooks_encode")),
    _public("encode.progress", ("media",), ENCODE_STREAM, ("api_status", "webhooks_encode")),
    _public("encode.completed", ("encode",), ENCODE_STREAM, ("api_status", "webhooks_encode")),
    _public("encode.failed", ("encode",), ENCODE_STREAM, ("api_status", "webhooks_encode")),
    # new with webhooks, on its account's subject only (no release before it read a bare one); to developers through
    # their endpoints, not (yet) to teams on the bus
    EventContract("webhook.disabled", ("webhooks",), WEBHOOKS_STREAM, ("webhooks_own",),
                  subject=f"webhook.disabled.{ACCOUNT_TOKEN}"),
)

EVENT_TYPES: tuple[str, ...] = tuple(e.type for e in EVENTS)

# --- request/reply and fire-and-forget contracts (core NATS, outside every stream)

OPERATOR = "operator"  # the `weir` CLI, as a caller (shared/identities.py)
ERROR_REPLY = "shared.messaging:ErrorReply"  # what a responder answers instead of its reply: {"error": {...}}
OPENAPI_VERSION = 1  # the api's public HTTP contract (OpenAPI, /v1 routes): raised with a breaking change
INSTANCE_TOKEN = "{instance}"  # a subject pattern's per-instance token (one subject token)


@dataclass(frozen=True)
class RequestContract:
    """One subject (or pattern) a service serves: the request model, the reply models it may answer (none: a message
    nobody answers), who answers or hears it and who sends it. `version` is raised with a breaking change, which ships
    as a new contract (a new subject) served `beside` the old one: a newer caller falls back to that one when no
    responder of its own release answers (an older responder does not serve the new subject)."""

    subject: str  # exact, or a pattern with INSTANCE_TOKEN (farm.offer.{instance})
    responder: str  # the service that subscribes: answers each request, or hears each message
    callers: tuple[str, ...]  # the services (or OPERATOR) that send it
    request: str  # "module:Name"
    replies: tuple[str, ...] = ()  # "module:Name" each; ERROR_REPLY among them when the responder may refuse
    version: int = 1
    beside: str = ""  # the older contract's subject a caller falls back to (a breaking change shipped beside)
    description: str = ""
    # its callers go on without an answer (they show that what it tells is not known yet): a responder of an older
    # release that does not serve it breaks none of them
    optional: bool = False

    @property
    def answered(self) -> bool:
        return bool(self.replies)

    @property
    def wildcard(self) -> str:
        """The NATS subject that matches every subject of the contract (`farm.offer.*`)."""
        return ".".join("*" if t.startswith("{") else t for t in self.subject.split("."))


def _manage(op: str, request: str, reply: str, description: str, *, optional: bool = False) -> RequestContract:
    return RequestContract(f"{AUTH_MANAGE_PREFIX}.{op}", "auth", ("api", OPERATOR), f"shared.authcheck:{request}",
                           (f"shared.authcheck:{reply}", ERROR_REPLY), description=description, optional=optional)


def _webhooks(op: str, request: str, reply: str, description: str) -> RequestContract:
    return RequestContract(f"{WEBHOOKS_MANAGE_PREFIX}.{op}", "webhooks", ("api",),
                           f"shared.webhookcalls:{request}", (f"shared.webhookcalls:{reply}", ERROR_REPLY),
                           description=description)


_FARM = "shared.media.protocol"
_SWEEP = "services.sweep.trigger"

REQUESTS: tuple[RequestContract, ...] = (
    RequestContract(AUTH_CHECK_SUBJECT, "auth", ("api", OPERATOR), "shared.authcheck:CheckRequest",
                    ("shared.authcheck:CheckReply", ERROR_REPLY), description="one API request's decision"),
    _manage("account.create", "CreateAccount", "AccountCreated", "a new account, its first user and token"),
    _manage("app.create", "CreateApp", "AppCreated", "an app of the account, with its key pair"),
    _manage("keys.rotate", "RotateKeys", "KeyPair", "a new key pair for the app; the old pair is revoked"),
    _manage("key.revoke", "RevokeKey", "KeyRevocation", "revoke one key of the account"),
    _manage("keys.list", "ListKeys", "KeyList", "the app's keys"),
    _manage("token.mint", "MintUploadToken", "UploadToken", "an upload token for one video"),
    _manage("limits.list", "ListLimits", "LimitList", "every request limit with its numbers and where it applies "
            "(the api's OpenAPI document shows them); without an answer the api says they are not known yet",
            optional=True),
    RequestContract(AUTH_SPENT_SUBJECT, "auth", ("auth",), "services.auth.spent:SpentBudgets",
                    description="budgets one auth instance saw spent, to every instance (fire and forget)"),
    RequestContract(ENCODE_STATUS_SUBJECT, "encode", ("api",), f"{_FARM}:StatusRequest",
                    (f"{_FARM}:ProcessingStatus", ERROR_REPLY), description="a video's processing state"),
    RequestContract(ENCODE_STATUS_V2_SUBJECT, "encode", ("api",), f"{_FARM}:StatusesRequest",
                    (f"{_FARM}:ProcessingStatuses", ERROR_REPLY), version=2, beside=ENCODE_STATUS_SUBJECT,
                    description="the processing states of many videos (a listing page) in one request"),
    RequestContract(f"{FARM_OFFER_PREFIX}.{INSTANCE_TOKEN}", "media", ("encode",), f"{_FARM}:Offer",
                    (f"{_FARM}:OfferAnswer", ERROR_REPLY), description="one output offered to one worker"),
    RequestContract(f"{FARM_CANCEL_PREFIX}.{INSTANCE_TOKEN}", "media", ("encode",), f"{_FARM}:Cancel",
                    description="stop these jobs (fire and forget, repeated while wanted)"),
    RequestContract(FARM_HEARTBEAT_SUBJECT, "encode", ("media",), f"{_FARM}:Heartbeat",
                    description="a worker's slots and running jobs (fire and forget, every instance hears it)"),
    RequestContract(FARM_RESULT_SUBJECT, "encode", ("media",), f"{_FARM}:OutputResult",
                    (f"{_FARM}:ResultAck", ERROR_REPLY), description="a worker's result of one output"),
    # the run's progress and report (RunUpdate) go to the inbox the request names: replies of the same contract
    RequestContract(SWEEP_RUN_SUBJECT, "sweep", (OPERATOR,), f"{_SWEEP}:RunRequest",
                    (f"{_SWEEP}:RunAccepted", f"{_SWEEP}:RunUpdate", ERROR_REPLY), description="run the sweep now"),
    _webhooks("endpoint.create", "CreateEndpoint", "EndpointCreated", "a developer's endpoint and its secret"),
    _webhooks("endpoint.list", "ListEndpoints", "EndpointList", "the app's endpoints"),
    _webhooks("endpoint.get", "GetEndpoint", "EndpointView", "one endpoint of the app"),
    _webhooks("endpoint.update", "UpdateEndpoint", "EndpointView", "change an endpoint, or turn it back on"),
    _webhooks("endpoint.delete", "DeleteEndpoint", "EndpointDeleted", "delete an endpoint and stop its deliveries"),
    _webhooks("secret.rotate", "RotateSecret", "SecretRotated", "a new signing secret; the old one signs on for a "
              "while"),
    _webhooks("deliveries.list", "ListDeliveries", "DeliveryPage", "an endpoint's delivery log"),
    _webhooks("replay", "Replay", "ReplayAccepted", "send a slice of the app's events to the endpoint again"),
)

REQUEST_SUBJECTS: tuple[str, ...] = tuple(r.subject for r in REQUESTS)


def request_contract(subject: str) -> RequestContract:
    """The contract of a subject, or of a pattern's concrete subject (`farm.offer.<instance>`)."""
    for r in REQUESTS:
        if r.subject == subject or _matches(r.wildcard, subject):
            return r
    raise ContractError(f"{subject!r} has no request/reply contract in shared/contracts.py")


def served_by(service: str) -> tuple[RequestContract, ...]:
    return tuple(r for r in REQUESTS if r.responder == service)


def called_by(service: str) -> tuple[RequestContract, ...]:
    return tuple(r for r in REQUESTS if service in r.callers)


def _matches(wildcard: str, subject: str) -> bool:
    pattern, tokens = wildcard.split("."), subject.split(".")
    return len(pattern) == len(tokens) and all(p in ("*", t) for p, t in zip(pattern, tokens, strict=True))
PUBLIC_EVENTS: frozenset[str] = frozenset(e.type for e in EVENTS if e.public)


class ContractError(ValueError):
    """A service's messaging differs from the declaration here."""


def contract(event_type: str) -> EventContract:
    for e in EVENTS:
        if e.type == event_type:
            return e
    raise ContractError(f"{event_type!r} has no contract in shared/contracts.py")


def consumer_contract(name: str) -> ConsumerContract:
    for c in CONSUMERS:
        if c.name == name:
            return c
    raise ContractError(f"consumer {name!r} is not declared in shared/contracts.py")


def published_by(role: str) -> tuple[str, ...]:
    """The event types a service (or the PUBLISHER role) publishes."""
    return tuple(e.type for e in EVENTS if role in e.publishers)


def events_on(stream: str) -> tuple[str, ...]:
    """The subjects a stream keeps: each of its event types' (`event_subjects`)."""
    return tuple(s for e in EVENTS if e.stream == stream for s in e.subjects)


def consumed_by(consumer: str) -> tuple[str, ...]:
    """The event types a durable consumer reads."""
    return tuple(e.type for e in EVENTS if consumer in e.consumers)


def event_subjects(types: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """The subjects of these event types: a durable's filter subjects, a stream's."""
    return tuple(s for t in types for s in contract(t).subjects)


def subject_of(event_type: str, data: dict[str, object], **tokens: str) -> str | None:
    """The subject an event goes on (its tokens from `tokens`, else from its data); None when the type has a
    template and a value is missing: then its bare type only (legacy), which no team may read."""
    c = contract(event_type)
    return c.fill({**data, **tokens}) if c.subject else c.type


def origin_of(subject: str) -> tuple[str, dict[str, str]] | None:
    """The event type and token values of a subject an event came on; None if no contract has it."""
    for e in EVENTS:
        values = e.parse(subject)
        if values is not None:
            return e.type, values
    return None


def heard_by(service: str) -> tuple[str, ...]:
    """The event types a service hears live (core subscriptions)."""
    return tuple(e.type for e in EVENTS if service in e.listeners)


def received_by(service: str) -> set[str]:
    """Every event type a service reads: through its durable consumers, or live."""
    return {t for c in consumers_of(service) for t in consumed_by(c.name)} | set(heard_by(service))


def consumers_of(service: str) -> tuple[ConsumerContract, ...]:
    return tuple(c for c in CONSUMERS if c.service == service)


def check_consumer(service: str, name: str, event_types: tuple[str, ...]) -> ConsumerContract:
    """The declaration of a consumer a service runs; raises ContractError when the service's handler reads other
    event types than declared, or the consumer is someone else's or not declared."""
    declared = consumer_contract(name)
    if declared.service != service:
        raise ContractError(f"consumer {name} is declared as {declared.service}'s, not {service}'s")
    if sorted(event_types) != sorted(consumed_by(name)):
        raise ContractError(f"consumer {name} handles {sorted(event_types)}, but shared/contracts.py declares "
                            f"{sorted(consumed_by(name))}")
    return declared


def problems() -> list[str]:
    """What makes the declaration itself inconsistent (tested; checked at import below)."""
    found = [f"event type {t} is declared twice" for t in sorted({t for t in EVENT_TYPES if EVENT_TYPES.count(t) > 1})]
    names = [c.name for c in CONSUMERS]
    found += [f"consumer {n} is declared twice" for n in sorted({n for n in names if names.count(n) > 1})]
    for e in EVENTS:
        if not e.publishers:
            found.append(f"event type {e.type} has no publisher")
        found += [f"event type {e.type} is read by {c}, which is not in CONSUMERS" for c in e.consumers
                  if c not in names]
    subjects = [r.subject for r in REQUESTS]
    found += [f"request contract {s} is declared twice" for s in sorted({s for s in subjects if subjects.count(s) > 1})]
    for r in REQUESTS:
        if r.version < 1:
            found.append(f"request contract {r.subject}: version must be at least 1")
        if r.beside and r.beside not in subjects:
            found.append(f"request contract {r.subject} is served beside {r.beside}, which is not declared")
        found += [f"request contract {r.subject}: {m!r} is not a 'module:Name'" for m in (r.request, *r.replies)
                  if m.count(":") != 1]
        if any(_matches(w, r.subject) or r.subject == w for e in EVENTS for w in e.subjects):
            found.append(f"{r.subject} is both an event subject and a request/reply subject")
    for c in CONSUMERS:
        read = consumed_by(c.name)
        if not read:
            found.append(f"consumer {c.name} reads no event type")
        streams = {contract(t).stream for t in read}
        if len(streams) > 1:
            found.append(f"consumer {c.name} reads several streams ({sorted(streams)}): split it")
        if any(ch in c.name for ch in ".*> ") or not c.name.startswith(f"{c.service}_"):
            found.append(f"consumer {c.name}: a plain token named after its service ({c.service}_...)")
    return found


_problems = problems()
if _problems:
    raise ContractError("; ".join(_problems))
