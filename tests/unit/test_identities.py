"""The bus identities (shared/identities.py): the rules hold for every identity, every subject each service's FastStream
broker declares is within its identity's rights (and no declared right is left without its handler), and the seeds
and the nats-server configuration (shared/natsauth.py) are made as `weir up` needs them."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import os
import shutil
import stat
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import nkeys  # type: ignore[import-untyped]
import pytest
from faststream.nats import NatsBroker

from shared import brokerdeclared, contracts, identities, publishersubjects
from shared.authcheck import CHECK_SUBJECT, MANAGE_OPERATIONS, manage_subject
from shared.brokerdeclared import declared_by, uncovered, undeclared
from shared.contracts import PUBLIC_EVENTS, PUBLISHER
from shared.events import CATALOG
from shared.events.documents import check_routing
from shared.identities import (
    EVENT_PUBLISHERS,
    IDENTITIES,
    OPERATOR,
    SERVICES,
    Durable,
    Identity,
    Right,
    inbox_prefix,
    publisher_like,
)
from shared.identityrules import violations
from shared.messaging import asyncapi_document, make_broker
from shared.metrics import Metrics
from shared.natsauth import (
    SeedError,
    authorization_config,
    ensure_seeds,
    public_key,
    public_keys,
    seed_path,
)
from shared.runtime import Runtime, ServiceDefinition, declare_messaging
from shared.streams import STREAMS

NAMES = list(IDENTITIES)
AUTH_SECRETS = {"key_hash_secret": "k" * 32, "upload_token_secret": "u" * 32}


def definition(service: str) -> ServiceDefinition:
    found = importlib.import_module(f"services.{service}.app").SERVICE
    assert isinstance(found, ServiceDefinition)
    return found


def who_may_publish(subject: str) -> set[str]:
    return {n for n, i in IDENTITIES.items() if i.may_publish(subject)}


def who_may_subscribe(subject: str) -> set[str]:
    return {n for n, i in IDENTITIES.items() if i.may_subscribe(subject)}


# ------------------------------------------------------------------------------------------ each service's broker


class _Conn:
    """A database connection that has nothing in it (start-up reads find no rows)."""

    async def fetch(self, *args: Any, **kwargs: Any) -> list[Any]:
        return []

    async def fetchval(self, *args: Any, **kwargs: Any) -> Any:
        return None

    async def fetchrow(self, *args: Any, **kwargs: Any) -> Any:
        return None

    async def execute(self, *args: Any, **kwargs: Any) -> str:
        return ""

    def transaction(self) -> contextlib.AbstractAsyncContextManager[None]:
        return contextlib.nullcontext()


class _Pool:
    @contextlib.asynccontextmanager
    async def acquire(self, *args: Any, **kwargs: Any) -> AsyncIterator[_Conn]:
        yield _Conn()


class _NoBus:
    """A NATS client that is never connected: on_start only keeps references to it."""

    is_connected = False

    def jetstream(self) -> Any:
        return object()

    async def publish(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("no bus in this test")

    async def request(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("no bus in this test")

    async def subscribe(self, *args: Any, **kwargs: Any) -> Any:
        return object()  # a plain subscription (auth.check): its subject is declared in `contracts`


async def service_broker(service: str, tmp: Path) -> NatsBroker:
    """The service's broker with everything the running service declares on it: the runtime's publishers and
    consumers, then its own `on_start` (run against a database and a bus that are not there), never started."""
    d = definition(service)
    extra: dict[str, Any] = dict(AUTH_SECRETS) if service == "auth" else {}
    if service == "media":
        extra["media_work_dir"] = str(tmp)
    settings = d.settings_cls(**extra)
    rt = Runtime(definition=d, settings=settings, metrics=Metrics(service))
    rt.broker = make_broker(settings, name=service)
    rt.nc, rt.js, rt.pool = _NoBus(), object(), _Pool()  # type: ignore[assignment]
    declare_messaging(rt)
    if d.on_start is not None:
        await d.on_start(rt)
    if d.served_outside_broker is not None:  # what the service serves without a FastStream subscriber (auth.check)
        d.served_outside_broker(rt.broker)
    if d.on_stop is not None:
        with contextlib.suppress(Exception):
            await d.on_stop(rt)
    return rt.broker


@pytest.fixture(scope="module")
async def brokers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, NatsBroker]:
    tmp = tmp_path_factory.mktemp("brokers")
    built = {service: await service_broker(service, tmp) for service in SERVICES}
    shutil.rmtree(tmp, ignore_errors=True)
    return built


# ------------------------------------------------------------------------------------------ the declaration


def test_there_is_one_identity_per_service_and_operator_and_publisher() -> None:
    assert set(IDENTITIES) == {*SERVICES, OPERATOR, PUBLISHER}
    for name, identity in IDENTITIES.items():
        assert identity.name == name
        assert identity.role == name
        assert identity.inbox_prefix == f"_INBOX.{name}"


def test_the_declaration_breaks_no_rule() -> None:
    assert violations() == []


def test_every_event_type_has_its_spec_publisher_and_the_public_ones_are_events() -> None:
    assert set(EVENT_PUBLISHERS) == set(CATALOG)
    assert set(PUBLIC_EVENTS) <= set(CATALOG)
    assert "dispatch.busy" not in PUBLIC_EVENTS and "credential.rejected" not in PUBLIC_EVENTS


@pytest.mark.parametrize("subject", [CHECK_SUBJECT, *(manage_subject(op) for op in MANAGE_OPERATIONS)])
def test_only_api_and_operator_ask_auth_and_only_auth_hears_it(subject: str) -> None:
    assert who_may_publish(subject) <= {"api", OPERATOR}
    assert "api" in who_may_publish(subject)
    assert who_may_subscribe(subject) == {"auth"}
    assert OPERATOR in who_may_publish(subject)


def test_only_auth_answers_requests_to_auth_and_responders_are_the_services_that_serve() -> None:
    assert {n for n, i in IDENTITIES.items() if i.responds} == {"auth", "encode", "media", "sweep", "webhooks"}
    # nobody may publish to every inbox: replies go out through allow_responses, one per request received
    for identity in IDENTITIES.values():
        assert not identity.may_publish("_INBOX.*.x") and not identity.may_publish("_INBOX.>")


def test_only_encode_sends_the_farm_its_offers_and_cancels_and_only_media_hears_them() -> None:
    assert who_may_publish("farm.offer.worker1") == {"encode"}
    assert who_may_publish("farm.cancel.worker1") == {"encode"}
    assert who_may_subscribe("farm.offer.worker1") == {"media"}
    assert who_may_subscribe("farm.cancel.worker1") == {"media"}


def test_a_media_worker_publishes_only_its_results_progress_and_heartbeats() -> None:
    media = IDENTITIES["media"]
    allowed = {"farm.result", "farm.heartbeat", "encode.progress.*", "encode.progress", "$JS.API.INFO"}
    assert {r.subject for r in media.publish_rights()} == allowed
    for t in CATALOG:
        for subject in contracts.contract(t).subjects:
            assert media.may_publish(subject) == (t == "encode.progress")


@pytest.mark.parametrize("event_type", sorted(CATALOG))
def test_each_event_type_is_published_only_by_its_publisher(event_type: str) -> None:
    publishers = set()
    c = contracts.contract(event_type)
    example = c.fill({"account_id": "acct1", "publisher": PUBLISHER, "job_class": "first_party"})
    for subject in {c.type, example} if c.legacy else {example}:  # an account subject and the bare legacy type
        assert subject is not None
        publishers |= who_may_publish(subject)
        assert who_may_publish(subject), f"nobody may publish {subject}"
    assert publishers <= EVENT_PUBLISHERS[event_type]
    # and exactly by the services whose definition publishes it (the publisher identity: recording.completed)
    by_definition = {s for s in SERVICES if event_type in definition(s).publishes}
    assert publishers == (by_definition or {PUBLISHER})


@pytest.mark.parametrize("verb", ["CREATE", "UPDATE", "PURGE", "DELETE"])
def test_only_the_operator_creates_changes_purges_or_deletes_a_stream(verb: str) -> None:
    for spec in STREAMS:
        assert who_may_publish(f"$JS.API.STREAM.{verb}.{spec.name}") == {OPERATOR}


@pytest.mark.parametrize("owner", NAMES)
def test_each_identity_reads_its_own_replies_and_no_one_elses(owner: str) -> None:
    reply = f"{inbox_prefix(owner)}.abc.1"
    assert who_may_subscribe(reply) == {owner}
    assert who_may_subscribe(f"{inbox_prefix(owner)}.>") == {owner}


def test_the_stacks_publisher_is_first_party_for_every_account_and_reads_only_the_public_events() -> None:
    publisher = IDENTITIES[PUBLISHER]
    assert publisher.accounts == (publishersubjects.EVERY_ACCOUNT,) and publisher.first_party
    assert [r.subject for r in publisher.publish if r.subject.startswith("recording.")] == [
        "recording.completed.*.publisher.developer", "recording.completed.*.publisher.first_party",
        "recording.completed"]
    assert not publisher.may_publish("recording.completed.acct1.acme.developer")  # never another publisher's name
    for t in CATALOG:
        c = contracts.contract(t)
        assert publisher.may_subscribe(c.fill({"account_id": "acct1", "publisher": "publisher"}) or c.type) == (
            t in PUBLIC_EVENTS or t == "publisher.rejected"), t
        assert not publisher.may_subscribe(t)  # the bare legacy copy carries every account: not for readers
    assert not publisher.may_subscribe("publisher.acme.rejected")
    assert not publisher.may_subscribe("auth.check") and not publisher.may_subscribe("encode.status")
    assert not publisher.may_publish("upload.completed") and not publisher.may_publish("auth.check")


def test_a_durable_is_read_by_its_owner_and_the_operator_only() -> None:
    for owner in IDENTITIES.values():
        for d in owner.durables:
            nxt = f"$JS.API.CONSUMER.MSG.NEXT.{d.stream}.{d.name}"
            assert who_may_publish(nxt) == {owner.name, OPERATOR}
            assert who_may_publish(f"$JS.ACK.{d.stream}.{d.name}.1.2.3.4.0") == {owner.name}


@pytest.mark.parametrize(("name", "change", "expected"), [
    ("media", {"publish": (Right("auth.manage.account.create", "x"),)}, "auth.manage"),
    ("media", {"publish": (Right("upload.completed", "x"),)}, "upload.completed"),
    ("media", {"publish": (Right("farm.offer.*", "x"),)}, "farm's offers"),
    ("api", {"subscribe": (Right("_INBOX.>", "x"),)}, "another identity's replies"),
    ("api", {"subscribe": (Right("auth.check", "x"),)}, "answered only by auth"),
    ("api", {"publish": (Right("$JS.API.STREAM.DELETE.VIDEOS", "x"),)}, "operator only"),
    ("api", {"publish": (Right("_INBOX.>", "x"),)}, "only a named identity's inbox"),
    ("sweep", {"publish": (Right("replay.encode_uploads.upload.completed", "x"),)}, "weir replay"),
    ("publisher", {"subscribe": (Right("key.created", "x"),)}, "outside its accounts"),
    ("publisher", {"durables": (Durable("ENCODE", "publisher_all", (), "x"),)}, "not exactly one filter"),
    ("publisher", {"durables": (Durable("ENCODE", "publisher_all", (">",), "x"),)}, "would read dispatch.busy"),
    ("publisher", {"durables": (Durable("ENCODE", "publisher_all", ("*.*",), "x"),)}, "would read encode.started"),
    ("publisher", {"durables": (Durable("VIDEOS", "encode_uploads", ("upload.completed",), "x"),)},
     "encode's durable"),
    ("acme", {"subscribe": (Right("video.created.globex1", "x"),)}, "outside its accounts"),
    ("acme", {"subscribe": (Right("video.created.*", "x"),)}, "outside its accounts"),
    ("acme", {"subscribe": (Right("video.created", "x"),)}, "outside its accounts"),
    ("acme", {"subscribe": (Right("publisher.globex.rejected", "x"),)}, "outside its accounts"),
    ("acme", {"durables": (Durable("VIDEOS", "acme_v", ("*.*.globex1",), "x"),)}, "would read video.created.globex1"),
    ("acme", {"durables": (Durable("VIDEOS", "acme_v", ("video.created",), "x"),)}, "would read video.created"),
    ("acme", {"durables": (Durable("RECORDINGS", "acme_r", ("publisher.*.rejected",), "x"),)},
     "would read publisher.*.rejected"),
    ("acme", {"publish": (Right("recording.completed.globex1.acme.developer", "x"),)}, "another account"),
    ("acme", {"publish": (Right("recording.completed.acme1.globex.developer", "x"),)}, "another account"),
    ("acme", {"publish": (Right("recording.completed.acme1.acme.first_party", "x"),)}, "another account"),
    ("acme", {"publish": (Right("recording.completed", "x"),)}, "another account"),
    ("acme", {"publish": (Right("$JS.API.DIRECT.GET.VIDEOS.video.created.globex1", "x"),)}, "a direct get outside"),
    ("acme", {"publish": (Right("$JS.API.DIRECT.GET.VIDEOS", "x"),)}, "which its denials refuse"),
    ("acme", {"publish": (Right("$JS.API.CONSUMER.CREATE.VIDEOS", "x"),)}, "which its denials refuse"),
    ("acme", {"deny_publish": ()}, "lacks the denials"),
    # a publisher never makes a consumer: a create's deliver subject is in its body, unchecked (a push consumer)
    ("acme", {"durables": (Durable("VIDEOS", "acme_videos_acme1", ("*.*.acme1",), "x"),)}, "not made by the operator"),
    ("acme", {"publish": (Right("$JS.API.CONSUMER.CREATE.VIDEOS.acme_videos_acme1.*.*.acme1", "x"),)},
     "only looks up and fetches its own durables"),
    ("acme", {"publish": (Right("$JS.API.CONSUMER.DELETE.VIDEOS.acme_videos_acme1", "x"),)},
     "only looks up and fetches its own durables"),
    ("acme", {"publish": (Right("$JS.API.CONSUMER.PAUSE.VIDEOS.acme_videos_acme1", "x"),)},
     "only looks up and fetches its own durables"),
    ("api", {"publish": (Right("$JS.API.CONSUMER.DELETE.VIDEOS.api_x", "x"),)}, "only `weir streams apply` deletes"),
    ("operator", {"publish": ()}, "may not make acme's durable"),
    ("acme", {"accounts": ("*",)}, "reads every account"),
])
def test_a_declaration_that_breaks_a_rule_is_caught(name: str, change: dict[str, Any], expected: str) -> None:
    base = IDENTITIES[name] if name in IDENTITIES else publisher_like(name, ["acme1"])
    if change.get("publish"):
        change = {"publish": base.publish + change["publish"]}
    if "subscribe" in change:
        change = {"subscribe": base.subscribe + change["subscribe"]}
    broken = dataclasses.replace(base, **change)
    globex = publisher_like("globex", ["globex1"])
    acme = [] if name == "acme" else [publisher_like("acme", ["acme1"])]
    found = violations([*(i for n, i in IDENTITIES.items() if n != name), globex, *acme, broken])
    assert any(expected in v for v in found), found


def test_an_outside_team_gets_a_publisher_of_its_own_accounts() -> None:
    team = publisher_like("acme", ["acme1", "acme2"])
    assert team.role == PUBLISHER and team.inbox_prefix == "_INBOX.acme" and not team.first_party
    assert {(d.name, d.subjects) for d in team.durables} == {
        ("acme_videos_acme1", ("*.*.acme1",)), ("acme_encode_acme1", ("encode.*.acme1",)),
        ("acme_videos_acme2", ("*.*.acme2",)), ("acme_encode_acme2", ("encode.*.acme2",))}
    assert violations([*IDENTITIES.values(), team, publisher_like("globex", ["globex1"])]) == []
    for account in ("acme1", "acme2"):
        assert team.may_publish(f"recording.completed.{account}.acme.developer")
        assert not team.may_publish(f"recording.completed.{account}.acme.first_party")
        assert not team.may_publish(f"recording.completed.{account}.globex.developer")
        for t in PUBLIC_EVENTS:
            assert team.may_subscribe(f"{t}.{account}")
            assert not team.may_subscribe(t) and not team.may_subscribe(f"{t}.globex1")
            assert not team.may_subscribe(f"{t}.*")
            stream = contracts.contract(t).stream
            assert team.may_publish(f"$JS.API.DIRECT.GET.{stream}.{t}.{account}")
            assert not team.may_publish(f"$JS.API.DIRECT.GET.{stream}.{t}.globex1")
    assert not team.may_publish("recording.completed")
    assert not team.may_publish("recording.completed.globex1.acme.developer")
    assert team.may_subscribe("publisher.acme.rejected") and not team.may_subscribe("publisher.globex.rejected")
    assert not team.may_publish("upload.completed.acme1")
    assert not team.may_publish("$JS.API.CONSUMER.MSG.NEXT.ENCODE.publisher_encode")  # not the other publisher's
    for unfiltered in ("$JS.API.CONSUMER.CREATE.VIDEOS", "$JS.API.CONSUMER.CREATE.VIDEOS.acme_videos_acme1",
                       "$JS.API.CONSUMER.DURABLE.CREATE.VIDEOS.acme_videos_acme1", "$JS.API.DIRECT.GET.VIDEOS",
                       "$JS.API.STREAM.MSG.GET.VIDEOS", "$JS.API.CONSUMER.CREATE.VIDEOS.acme_videos_acme1.*.*.*",
                       "$JS.API.CONSUMER.LIST.VIDEOS", "$JS.API.STREAM.INFO.VIDEOS"):
        assert not team.may_publish(unfiltered), unfiltered
    # its durables are the operator's (`weir streams apply`): it looks them up, fetches and acks; it never creates,
    # updates (a create), deletes or pauses one, its own included
    for d in team.durables:
        assert d.made_by_operator
        assert team.may_publish(f"$JS.API.CONSUMER.INFO.{d.stream}.{d.name}")
        assert team.may_publish(f"$JS.API.CONSUMER.MSG.NEXT.{d.stream}.{d.name}")
        assert team.may_publish(f"$JS.ACK.{d.stream}.{d.name}.1.2.3.4.0")
        for verb in ("DELETE", "PAUSE", "LEADER.STEPDOWN", "UNPIN", "DURABLE.CREATE"):
            assert not team.may_publish(f"$JS.API.CONSUMER.{verb}.{d.stream}.{d.name}")
        assert not team.may_publish(d.create_subject()) and not team.may_publish(f"{d.create_subject()}.x")
        assert IDENTITIES[OPERATOR].may_publish(d.create_subject())
        assert IDENTITIES[OPERATOR].may_publish(f"$JS.API.CONSUMER.DELETE.{d.stream}.{d.name}")
    assert not any(r.subject.startswith("$JS.API.CONSUMER.CREATE") for r in team.publish_rights())
    first = publisher_like("studio", ["s1"], first_party=True)
    assert first.may_publish("recording.completed.s1.studio.first_party") and first.may_publish("recording.completed")
    assert violations([*IDENTITIES.values(), first]) == []
    for bad in ("", "a.b", "api", "x>", "$x"):
        with pytest.raises(ValueError):
            publisher_like(bad, ["a1"])
    for account in ("*", ">", "a.b", "", "a b"):
        with pytest.raises(ValueError):
            publisher_like("acme", [account])


def test_a_publishers_durable_filter_covers_its_accounts_public_events_of_the_stream_only() -> None:
    assert publishersubjects.account_filter("VIDEOS", "a1") == "*.*.a1"
    assert publishersubjects.account_filter("ENCODE", "a1") == "encode.*.a1"
    with pytest.raises(ValueError):
        publishersubjects.account_filter("AUTH", "a1")
    assert publishersubjects.PUBLIC_STREAMS == tuple(sorted({contracts.contract(t).stream for t in PUBLIC_EVENTS}))
    assert publishersubjects.recording_subjects("acme", ("a1",), False) == ("recording.completed.a1.acme.developer",)
    assert publishersubjects.rejected_subject("acme") == "publisher.acme.rejected"


def test_the_replay_durables_read_what_replay_writes() -> None:
    for identity in IDENTITIES.values():
        for d in identity.durables:
            if d.stream == contracts.REPLAY_STREAM:
                consumer = d.name.removesuffix("_replay")
                replayed = contracts.replay_subject(consumer, "upload.completed")
                assert all(identities.covers(f, replayed) for f in d.subjects)


def test_subject_matching_follows_nats_wildcards() -> None:
    assert identities.covers("a.>", "a.b.c") and identities.covers("a.*", "a.*") and identities.covers(">", "x")
    assert not identities.covers("a.*", "a.>") and not identities.covers("a.b", "a.*")
    assert not identities.covers("a.>", "a") and not identities.covers("a.*", "a.b.c")
    assert identities.overlaps("a.*", "*.b") and identities.overlaps("a.>", "a.b.c") and identities.overlaps("a", "a")
    assert not identities.overlaps("a.*", "a.b.c") and not identities.overlaps("a.>", "a")
    assert not identities.overlaps("a.b", "a.c")


# ------------------------------------------------------------------------------ the brokers and their identities


@pytest.mark.parametrize("service", SERVICES)
def test_every_subject_the_service_broker_declares_is_within_its_identity(
    service: str, brokers: dict[str, NatsBroker]
) -> None:
    declared = declared_by(brokers[service])
    assert declared.publish or declared.subscribe or declared.durables
    assert uncovered(IDENTITIES[service], declared) == []


@pytest.mark.parametrize("service", SERVICES)
def test_no_right_outlives_its_handler(service: str, brokers: dict[str, NatsBroker]) -> None:
    assert undeclared(IDENTITIES[service], declared_by(brokers[service])) == []


@pytest.mark.parametrize("service", SERVICES)
def test_the_asyncapi_document_lists_nothing_outside_the_identity(service: str, brokers: dict[str, NatsBroker]) -> None:
    """What the issue asks for in so many words: every channel of each service's document is within its rights."""
    identity = IDENTITIES[service]
    document = asyncapi_document(brokers[service], service=service)
    checked = 0
    for operation in document["operations"].values():
        channel = document["channels"][unquote(operation["channel"]["$ref"].rsplit("/", 1)[1])]
        address = brokerdeclared._as_subject(channel["address"])
        if channel["address"].startswith("{"):  # a reply, or an inbox the request names
            assert identity.responds or any(r.subject.startswith("_INBOX.") for r in identity.publish)
        elif operation["action"] == "send":
            assert identity.may_publish(address), (service, address)
        elif any(address in (d.subjects or ()) or f"replay.{d.name.removesuffix('_replay')}.>" == address
                 for d in identity.durables):
            pass  # read through one of its durables (the pull consumer's rights, not a core subscription)
        else:
            assert identity.may_subscribe(address), (service, address)
        checked += 1
    assert checked


@pytest.mark.parametrize("service", SERVICES)
def test_the_whole_document_sends_and_receives_the_declared_events(
    service: str, brokers: dict[str, NatsBroker]
) -> None:
    """With the service's own subscribers (auth hears key.revoked live), each document shows exactly
    shared/contracts.py's events."""
    assert check_routing({service: asyncapi_document(brokers[service], service=service)}, complete=True) == []


async def test_a_handler_added_without_its_permission_fails_here(tmp_path: Path) -> None:
    broker = await service_broker("encode", tmp_path)

    @broker.subscriber("encode.restart", title="encode.restart")
    async def restart(body: dict[str, str]) -> None: ...

    broker.publisher("video.reencoded", title="video.reencoded")
    missing = uncovered(IDENTITIES["encode"], declared_by(broker))
    assert missing == ["publish video.reencoded", "subscribe encode.restart"]


# ------------------------------------------------------------------------------------------------------ seeds


def test_seeds_are_made_once_private_and_kept(tmp_path: Path) -> None:
    directory = tmp_path / ".weir" / "nats"
    seeds = ensure_seeds(directory)
    assert set(seeds) == set(IDENTITIES)
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    keys = {}
    for name, path in seeds.items():
        assert path == seed_path(directory, name) == directory / f"{name}.nk"
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        seed = path.read_bytes().strip()
        assert seed.startswith(b"SU")
        keys[name] = nkeys.from_seed(bytearray(seed)).public_key.decode()
        assert public_key(path) == keys[name]
    assert len(set(keys.values())) == len(keys)
    assert [p.name for p in directory.iterdir() if p.name.startswith(".")] == []  # no temporary left behind

    os.chmod(seeds["api"], 0o644)
    os.chmod(directory, 0o755)
    again = ensure_seeds(directory)
    assert again == seeds
    assert public_keys(again) == keys  # a restarted stack keeps its identities
    assert stat.S_IMODE(seeds["api"].stat().st_mode) == 0o600
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700


def test_a_damaged_seed_is_an_error_not_a_new_identity(tmp_path: Path) -> None:
    ensure_seeds(tmp_path, ["api"])
    (tmp_path / "api.nk").write_text("SUnotaseed\n")
    with pytest.raises(SeedError, match=r"api\.nk"):
        ensure_seeds(tmp_path, ["api"])
    account = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_ACCOUNT)
    (tmp_path / "api.nk").write_bytes(account)
    with pytest.raises(SeedError, match="not a user seed"):
        ensure_seeds(tmp_path, ["api"])


def test_seeds_for_extra_identities(tmp_path: Path) -> None:
    seeds = ensure_seeds(tmp_path, ["acme"])
    assert list(seeds) == ["acme"]
    with pytest.raises(ValueError):
        ensure_seeds(tmp_path, ["../x"])


# --------------------------------------------------------------------------------------- server configuration


def _keys(tmp_path: Path, extra: list[str] | None = None) -> dict[str, str]:
    return public_keys(ensure_seeds(tmp_path, [*IDENTITIES, *(extra or [])]))


def test_the_configuration_lists_every_identity_with_its_key_and_rights(tmp_path: Path) -> None:
    keys = _keys(tmp_path)
    text = authorization_config(keys)
    assert "no_auth_user" not in text
    for name, identity in IDENTITIES.items():
        assert text.count(f'nkey: "{keys[name]}"') == 1
        for right in (*identity.publish_rights(), *identity.subscribe_rights()):
            assert f'"{right.subject}"' in text
    assert text.count("allow_responses") == sum(1 for i in IDENTITIES.values() if i.responds)
    assert "password" not in text
    for path in ensure_seeds(tmp_path).values():  # public keys only: no seed in the configuration
        assert path.read_text().strip() not in text


def test_nats_server_accepts_the_configuration(tmp_path: Path) -> None:
    team = publisher_like("acme")
    conf = tmp_path / "server.conf"
    conf.write_text(authorization_config(_keys(tmp_path, ["acme"]), extra=[team]))
    binary = Path(sys.executable).parent / "nats-server"
    done = subprocess.run([str(binary), "-t", "-c", str(conf)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr + done.stdout


def test_the_configuration_refuses_what_would_let_someone_in(tmp_path: Path) -> None:
    keys = _keys(tmp_path)
    with pytest.raises(KeyError, match="acme"):
        authorization_config(keys, extra=[publisher_like("acme")])
    with pytest.raises(ValueError, match="share a public key"):
        authorization_config({**keys, "api": keys["auth"]})
    with pytest.raises(ValueError, match="public key"):
        authorization_config({**keys, "api": "not-a-key"})
    with pytest.raises(ValueError, match="twice"):
        authorization_config(keys, extra=[IDENTITIES["api"]])
    nothing = Identity(name="nothing", role="nothing", description="may do nothing")
    text = authorization_config({"nothing": _keys(tmp_path, ["nothing"])["nothing"]}, identities={},
                                extra=[nothing])
    assert 'deny: [">"]' in text  # an identity without rights gets none, never all


def test_connect_options_name_the_seed_and_the_inbox() -> None:
    assert identities.connect_options("media", "/x/media.nk") == {"nkeys_seed": "/x/media.nk",
                                                                 "inbox_prefix": "_INBOX.media"}
