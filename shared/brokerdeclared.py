"""What a service's FastStream broker declares, read as nats-server permissions (`declared_by`), and how it compares
with the service's identity both ways: what the broker declares that the identity may not do (`uncovered`: a failure
in production) and the rights the broker no longer declares (`undeclared`: a permission left behind). The tests
(tests/unit/test_identities.py) hold every service to both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shared.identities import Identity, covers, overlaps, tokens
from shared.messaging import REPLY_ADDRESS
from shared.natsconn import INBOX_ROOT


@dataclass(frozen=True)
class Declared:
    """The subjects a service's FastStream broker declares, as nats-server permissions see them."""

    publish: frozenset[str]  # its publishers' subjects (`farm.offer.{instance}` read as `farm.offer.*`)
    subscribe: frozenset[str]  # its core subscribers' subjects
    durables: frozenset[tuple[str, str, tuple[str, ...]]]  # its pull subscribers: `Durable.key()`
    addressed: frozenset[str]  # publishers whose whole address a request names (`{reply_to}`, `{updates}`)
    answers: bool  # a core subscriber may reply to what it receives


def _as_subject(template: str) -> str:
    """A publisher's address template as a permission subject: each templated token is any token."""
    return ".".join("*" if "{" in tok else tok for tok in tokens(template))


def declared_by(broker: Any) -> Declared:
    """What a FastStream NatsBroker's subscribers and publishers declare (read from the broker, not running it)."""
    publish: set[str] = set()
    addressed: set[str] = set()
    subscribe: set[str] = set()
    durables: set[tuple[str, str, tuple[str, ...]]] = set()
    for pub in broker.publishers:
        template = str(getattr(pub.subject, "template", pub.subject))
        if template.startswith("{") and template.endswith("}") and "." not in template:
            addressed.add(template)
        else:
            publish.add(_as_subject(template))
    for sub in broker.subscribers:
        stream: Any = getattr(sub, "stream", None)
        config: Any = getattr(sub, "config", None)
        if stream is not None and getattr(config, "durable_name", None):
            filters = config.filter_subjects or ([config.filter_subject] if config.filter_subject else [])
            durables.add((stream.name, config.durable_name, tuple(sorted(filters))))
            continue
        subscribe.add(_as_subject(str(getattr(sub.subject, "template", sub.subject))))
    # a subscriber that answers declares its reply (messaging.declare_reply: a publisher to the request's reply_to)
    answers = REPLY_ADDRESS in addressed
    return Declared(frozenset(publish), frozenset(subscribe), frozenset(durables), frozenset(addressed), answers)


def uncovered(identity: Identity, declared: Declared) -> list[str]:
    """What the broker declares that the identity may not do: each one a failure in production."""
    missing = [f"publish {s}" for s in sorted(declared.publish) if not identity.may_publish(s)]
    missing += [f"subscribe {s}" for s in sorted(declared.subscribe) if not identity.may_subscribe(s)]
    mine = {d.key() for d in identity.durables}
    missing += [f"durable {s}/{n} on {list(f)}" for s, n, f in sorted(declared.durables) if (s, n, f) not in mine]
    if declared.answers and not identity.responds:
        missing.append("answer requests (allow_responses)")
    for address in sorted(declared.addressed):
        if address == "{reply_to}":
            if not identity.responds:
                missing.append(f"publish {address} (allow_responses)")
        elif not any(overlaps(r.subject, f"{INBOX_ROOT}.>") for r in identity.publish):
            missing.append(f"publish {address} (an inbox the request names)")
    return missing


def undeclared(identity: Identity, declared: Declared) -> list[str]:
    """Rights marked `declared` that the broker no longer declares (a removed handler's permission left behind),
    and durables it no longer reads."""
    stale = [f"publish {r.subject}" for r in identity.publish
             if r.declared and not any(covers(r.subject, s) for s in declared.publish)]
    stale += [f"subscribe {r.subject}" for r in identity.subscribe
              if r.declared and not any(covers(r.subject, s) for s in declared.subscribe)]
    stale += [f"durable {d.stream}/{d.name}" for d in identity.durables
              if d.key() not in declared.durables]
    if identity.responds and not declared.answers and not declared.addressed:
        stale.append("allow_responses (it answers nothing)")
    return stale
