"""The bus identities on a real nats-server started with the generated configuration (shared/natsauth.py): who gets
in, what each identity may and may not do, and the JetStream flows the services run (outbox publish with its
PubAck, a durable pull consumer through FastStream, replay, auth's counters) with exactly their rights.

nats-py reports a permission violation asynchronously, to `error_cb` (`-ERR 'Permissions Violation for Publish to
"x"'`): each refusal here is asserted on that report, not on a timeout alone."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import nats
import pytest
from faststream.nats import NatsBroker, PullSub
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js import api
from nats.js.errors import NotFoundError

from services.api.domain import EncodeEvent
from services.auth.counters import JetStreamCounters
from shared.bus import subscriptions_in_place
from shared.consumer import ConsumerSpec, EventConsumer
from shared.events import (
    EncodeCompleted,
    EncodeProgress,
    EncodeStarted,
    Event,
    RecordingCompleted,
    UploadCompleted,
    VideoCreated,
    VideoDeleted,
    VideoRetired,
    WebhookDisabled,
    new_event,
)
from shared.identities import IDENTITIES, SERVICES, inbox_prefix
from shared.messaging import make_broker, no_declare
from shared.natsauth import new_seed
from shared.outbox import bus_subject
from shared.publishers import EventPublishers, Outgoing
from shared.replay import replay
from shared.settings import CommonSettings
from shared.streams import STREAMS, StreamSpec, apply_streams
from tests.integration.identityhelpers import (
    Client,
    IdentityServer,
    connected,
    identity_server,
    wait_until_ready,
)
from weir.readerdurables import apply_reader_durables

pytestmark = pytest.mark.timeout(120)
SETTINGS = CommonSettings(stream_replicas=1)
SHORT = 0.5  # a request that cannot be delivered waits this long


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[IdentityServer]:
    with identity_server(tmp_path_factory.mktemp("bus-identities")) as started:
        yield started


@pytest.fixture(scope="module")
async def ready(server: IdentityServer) -> IdentityServer:
    """The server up and every stream applied, by the operator (as `weir up` does)."""
    assert await wait_until_ready(server) == [f"created {spec.name}" for spec in STREAMS]
    return server


async def _quiet(exc: Exception) -> None:
    """nats-py's default error callback logs a traceback; the refusals here are expected."""


async def stream_messages(server: IdentityServer, stream: str) -> int:
    async with connected(server, "operator") as operator:
        info = await operator.nc.jetstream().stream_info(stream)
        return int(info.state.messages)


def upload_event(video_id: str) -> Any:
    return new_event(UploadCompleted(video_id=video_id, app_id="app1", account_id="acct1", key_id="key1",
                                     object_key=f"uploads/{video_id}", size=10, content_type="video/mp4",
                                     source_height=720), source="api", subject=video_id)


# ------------------------------------------------------------------------------------------------ who gets in


async def test_an_anonymous_client_is_refused(ready: IdentityServer) -> None:
    started = time.monotonic()
    with pytest.raises(nats.errors.Error, match=r"(?i)authorization violation"):
        await nats.connect(ready.url, allow_reconnect=False, connect_timeout=5, error_cb=_quiet)
    assert time.monotonic() - started < 5  # refused, not left to time out


async def test_a_client_with_an_unknown_seed_is_refused(ready: IdentityServer, tmp_path: Path) -> None:
    stranger = tmp_path / "stranger.nk"
    stranger.write_bytes(new_seed())
    with pytest.raises(nats.errors.Error, match=r"(?i)authorization violation"):
        await nats.connect(ready.url, allow_reconnect=False, connect_timeout=5, error_cb=_quiet,
                           nkeys_seed=str(stranger))


@pytest.mark.parametrize("name", list(IDENTITIES))
async def test_each_identity_connects_with_its_own_seed_and_inbox(ready: IdentityServer, name: str) -> None:
    async with connected(ready, name) as client:
        assert client.nc.is_connected
        assert client.nc.new_inbox().startswith(f"{inbox_prefix(name)}.")
        # its own inbox is its own to read (replies, PubAcks, fetched messages)
        sub = await client.nc.subscribe(f"{client.nc.new_inbox()}.*")
        assert await client.settled() == []
        await sub.unsubscribe()


# ------------------------------------------------------------------------------------------------ refusals


@contextlib.asynccontextmanager
async def responder(server: IdentityServer, name: str, subject: str, answer: bytes) -> AsyncIterator[list[bytes]]:
    """`name` answering `subject` (queue group as the service has it); yields what it received."""
    received: list[bytes] = []
    async with connected(server, name) as client:

        async def on_request(msg: Any) -> None:
            received.append(msg.data)
            await msg.respond(answer)

        await client.nc.subscribe(subject, queue=name, cb=on_request)
        await subscriptions_in_place(client.nc)
        yield received
        assert await client.settled() == []  # the reply went out through allow_responses


async def test_media_cannot_ask_auth_to_create_an_account(ready: IdentityServer) -> None:
    subject = "auth.manage.account.create"
    async with responder(ready, "auth", subject, b'{"account_id":"a1"}') as heard, \
            connected(ready, "media") as media, connected(ready, "api") as api_client:
        with pytest.raises((NatsTimeout, NoRespondersError)):
            await media.nc.request(subject, b'{"name":"mallory"}', timeout=SHORT)
        await media.violation("publish", subject)
        assert heard == []  # auth saw nothing: no account
        # the same request from api is answered (auth replies on api's inbox, by allow_responses)
        reply = await api_client.nc.request(subject, b'{"name":"acme"}', timeout=2)
        assert json.loads(reply.data) == {"account_id": "a1"}
        assert heard == [b'{"name":"acme"}']
        assert await api_client.settled() == []


async def test_media_cannot_publish_upload_completed(ready: IdentityServer) -> None:
    before = await stream_messages(ready, "VIDEOS")
    async with connected(ready, "media") as media:
        event = upload_event("forged1")
        with pytest.raises((NatsTimeout, NoRespondersError)):
            await media.nc.request("upload.completed", event.to_bytes(), timeout=SHORT,
                                   headers={"Nats-Msg-Id": event.id})
        await media.violation("publish", "upload.completed")
        # what media may publish, it may: its progress, into ENCODE, acknowledged on its inbox
        progress = new_event(EncodeProgress(video_id="v8", output=360, worker="w1", progress=0.5), source="media",
                             subject="v8")
        ack = await media.nc.jetstream().publish("encode.progress", progress.to_bytes(), stream="ENCODE",
                                                 headers={"Nats-Msg-Id": progress.id})
        assert ack.stream == "ENCODE"
    assert await stream_messages(ready, "VIDEOS") == before


async def test_media_cannot_read_another_identitys_replies(ready: IdentityServer) -> None:
    async with responder(ready, "auth", "auth.check", b'{"allowed":true}'), \
            connected(ready, "media") as media, connected(ready, "api") as api_client:
        overheard: list[bytes] = []

        async def keep(msg: Any) -> None:
            overheard.append(msg.data)

        for pattern in (f"{inbox_prefix('api')}.>", "_INBOX.>", "_INBOX.*.*.*"):
            await media.nc.subscribe(pattern, cb=keep)
            await media.violation("subscription", pattern)
        reply = await api_client.nc.request("auth.check", b"{}", timeout=2)
        assert reply.data == b'{"allowed":true}'
        await subscriptions_in_place(media.nc)
        assert overheard == []
        # nor may it publish into another identity's inbox (a forged reply)
        await media.nc.publish(f"{inbox_prefix('api')}.forged", b"{}")
        await media.violation("publish", f"{inbox_prefix('api')}.forged")


async def test_a_responder_may_answer_but_not_write_to_inboxes_at_will(ready: IdentityServer) -> None:
    async with connected(ready, "auth") as auth, connected(ready, "sweep") as sweep:
        await auth.nc.publish(f"{inbox_prefix('api')}.x.1", b"{}")
        await auth.violation("publish", f"{inbox_prefix('api')}.x.1")
        # sweep reports a run's progress to the inbox `weir sweep run` named: the operator's, and only that one
        await sweep.nc.publish(f"{inbox_prefix('operator')}.updates", b"{}")
        await sweep.nc.publish(f"{inbox_prefix('api')}.updates", b"{}")
        await sweep.violation("publish", f"{inbox_prefix('api')}.updates")
        assert len(sweep.violations()) == 1


async def test_api_cannot_delete_a_stream(ready: IdentityServer) -> None:
    async with connected(ready, "api") as api_client:
        js = api_client.nc.jetstream(timeout=SHORT)
        with pytest.raises((NatsTimeout, TimeoutError, NoRespondersError)):
            await js.delete_stream("VIDEOS")
        await api_client.violation("publish", "$JS.API.STREAM.DELETE.VIDEOS")
        with pytest.raises((NatsTimeout, TimeoutError, NoRespondersError)):
            await js.purge_stream("VIDEOS")
        await api_client.violation("publish", "$JS.API.STREAM.PURGE.VIDEOS")
    async with connected(ready, "operator") as operator:
        assert (await operator.nc.jetstream().stream_info("VIDEOS")).config.name == "VIDEOS"


async def test_the_operator_applies_the_streams_and_deletes_one(ready: IdentityServer) -> None:
    async with connected(ready, "operator") as operator:
        js = operator.nc.jetstream()
        again = await apply_streams(js, SETTINGS)
        assert again == [f"updated {spec.name}" for spec in STREAMS]
        scratch = StreamSpec("SCRATCH", ("scratch.things",), "made to be deleted")
        assert await apply_streams(js, SETTINGS, (scratch,)) == ["created SCRATCH"]
        assert await js.delete_stream("SCRATCH") is True
        with pytest.raises(NotFoundError):
            await js.stream_info("SCRATCH")
        assert await operator.settled() == []


async def test_the_operator_removes_a_parked_message_and_no_other_streams(ready: IdentityServer) -> None:
    """`weir dlq redrive` removes what was handled from the DLQ; a message of any other stream is not its to remove."""
    async with connected(ready, "api") as api_client:  # api_status parks what it cannot handle of encode's events
        ack = await api_client.nc.jetstream().publish("dlq.encode.started", b"{}", stream="DLQ")
    async with connected(ready, "operator") as operator:
        js = operator.nc.jetstream(timeout=SHORT)
        assert await js.delete_msg("DLQ", ack.seq) is True
        with pytest.raises((NatsTimeout, TimeoutError, NoRespondersError)):
            await js.delete_msg("VIDEOS", 1)
        await operator.violation("publish", "$JS.API.STREAM.MSG.DELETE.VIDEOS")
    async with connected(ready, "api") as api_client:
        with pytest.raises((NatsTimeout, TimeoutError, NoRespondersError)):
            await api_client.nc.jetstream(timeout=SHORT).delete_msg("DLQ", ack.seq)
        await api_client.violation("publish", "$JS.API.STREAM.MSG.DELETE.DLQ")


# ------------------------------------------------------------------------------------------------ publisher


async def test_the_publisher_publishes_recordings_and_hears_public_events_only(ready: IdentityServer) -> None:
    """The stack's own publisher: first-party, every account (an outside team's narrower rights:
    test_team_permissions.py)."""
    async with connected(ready, "publisher") as publisher, connected(ready, "encode") as encode:
        heard: asyncio.Queue[bytes] = asyncio.Queue()

        async def on_completed(msg: Any) -> None:
            heard.put_nowait(msg.data)

        await publisher.nc.subscribe("encode.completed.*", cb=on_completed)
        await subscriptions_in_place(publisher.nc)
        done = new_event(EncodeCompleted(video_id="v9", output=720, worker="w1", object_key="renditions/v9/720p-1.mp4",
                                         size=100), source="encode", subject="v9")
        ack = await encode.nc.jetstream().publish("encode.completed.acct1", done.to_bytes(), stream="ENCODE",
                                                  headers={"Nats-Msg-Id": done.id})
        assert ack.stream == "ENCODE"
        assert Event[EncodeCompleted].model_validate_json(await asyncio.wait_for(heard.get(), 5)).id == done.id

        recording = new_event(RecordingCompleted(recording_id="r1", object_key="recordings/r1", size=5),
                              source="publisher", subject="r1")
        for subject in ("recording.completed.acct1.publisher.first_party", "recording.completed"):
            pub_ack = await publisher.nc.jetstream().publish(subject, recording.to_bytes(), stream="RECORDINGS",
                                                             headers={"Nats-Msg-Id": f"{recording.id}-{subject}"})
            assert pub_ack.stream == "RECORDINGS" and pub_ack.seq >= 1
        assert await publisher.settled() == []

        for subject in ("upload.completed", "upload.completed.acct1", "auth.check", "video.retired", "farm.offer.w1",
                        "recording.completed.acct1.acme.developer"):
            await publisher.nc.publish(subject, b"{}")
            await publisher.violation("publish", subject)
        for subject in ("auth.check", "key.created", "dispatch.busy", "credential.rejected", "encode.status",
                        "encode.completed", "publisher.acme.rejected"):
            await publisher.nc.subscribe(subject)
            await publisher.violation("subscription", subject)
        assert await encode.settled() == []


async def test_the_publisher_reads_its_durable_and_cannot_widen_it(ready: IdentityServer) -> None:
    async with connected(ready, "publisher") as publisher, connected(ready, "encode") as encode:
        started = new_event(EncodeStarted(video_id="v10", output=360, worker="w1"), source="encode", subject="v10")
        await encode.nc.jetstream().publish("encode.started.acct1", started.to_bytes(), stream="ENCODE",
                                            headers={"Nats-Msg-Id": started.id})
        async with connected(ready, "operator") as operator:  # its durables are the operator's (weir streams apply)
            await apply_reader_durables(operator.nc.jetstream(), SETTINGS, [IDENTITIES["publisher"]])
            assert await operator.settled() == []
        js = publisher.nc.jetstream(timeout=2)
        sub = await js.pull_subscribe_bind(durable="publisher_encode", stream="ENCODE")
        msgs = await sub.fetch(10, timeout=2)
        assert started.id in {json.loads(m.data)["id"] for m in msgs}
        for m in msgs:
            await m.ack()
        await sub.unsubscribe()
        assert await publisher.settled() == []

        # the private dispatch.busy: neither through another create subject...
        wider = api.ConsumerConfig(durable_name="publisher_encode", name="publisher_encode",
                                   ack_policy=api.AckPolicy.EXPLICIT, filter_subject="dispatch.busy")
        with pytest.raises((NatsTimeout, TimeoutError)):
            await publisher.nc.jetstream(timeout=SHORT).add_consumer("ENCODE", wider)
        await publisher.violation("publish", "$JS.API.CONSUMER.CREATE.ENCODE.publisher_encode.dispatch.busy")
        # ...nor through its own durable's create subject: a publisher creates and updates no consumer at all
        body = json.dumps({"stream_name": "ENCODE", "config": wider.as_dict()}).encode()
        await publisher.nc.publish("$JS.API.CONSUMER.CREATE.ENCODE.publisher_encode.encode.*.*", body)
        await publisher.violation("publish", "$JS.API.CONSUMER.CREATE.ENCODE.publisher_encode.encode.*.*")
        # nor by reading encode's own durables
        await publisher.nc.publish("$JS.API.CONSUMER.MSG.NEXT.VIDEOS.encode_uploads", b"1")
        await publisher.violation("publish", "$JS.API.CONSUMER.MSG.NEXT.VIDEOS.encode_uploads")


# ------------------------------------------------------------------------------------- the services' JetStream flows


class _Conn:
    """Enough of a database connection for EventConsumer: every event is new, the handler records it."""

    async def fetchval(self, *args: Any, **kwargs: Any) -> Any:
        return True

    async def fetch(self, query: str, consumer: str, ids: list[str], *args: Any) -> list[Any]:
        return [(i,) for i in ids]

    def transaction(self) -> contextlib.AbstractAsyncContextManager[None]:
        return contextlib.nullcontext()


class _Pool:
    @contextlib.asynccontextmanager
    async def acquire(self, *args: Any, **kwargs: Any) -> AsyncIterator[_Conn]:
        yield _Conn()


@contextlib.asynccontextmanager
async def service_broker(server: IdentityServer, name: str) -> AsyncIterator[tuple[NatsBroker, Client]]:
    """The service's broker (shared/messaging.py) connected as the identity, its server errors recorded."""
    errors = Client(name=name, nc=None)  # type: ignore[arg-type]
    settings = CommonSettings(nats_url=server.url, stream_replicas=1)
    as_identity = settings.model_copy(update={"nats_nkey_seed": str(server.seeds[name]), "nats_identity": name})
    broker = make_broker(as_identity, name=name, error_cb=errors.on_error)
    errors.nc = await broker.connect()
    try:
        yield broker, errors
    finally:
        await broker.stop()


async def test_the_api_outbox_publish_is_acknowledged_with_its_rights(ready: IdentityServer) -> None:
    before = await stream_messages(ready, "VIDEOS")
    async with service_broker(ready, "api") as (broker, errors):
        # encode.started declared here too, as if api's code tried to publish it: its identity still may not
        publishers = EventPublishers(broker, ("upload.completed", "encode.started"), timeout=2)
        event = upload_event("v-outbox")
        ack = await publishers.publish("upload.completed", event.to_bytes(), event.id)
        assert ack.stream == "VIDEOS"
        # an event type api does not publish is refused, and the relay sees no PubAck for it (the row stays)
        forged = new_event(EncodeStarted(video_id="v1", output=360, worker="w"), source="api", subject="v1")
        publishers.timeout = SHORT
        (result,) = await publishers.publish_in_order([Outgoing("encode.started", forged.to_bytes(), forged.id)])
        assert isinstance(result, TimeoutError)
        await errors.violation("publish", "encode.started")
    assert await stream_messages(ready, "VIDEOS") == before + 1


HANDLED: set[str] = set()  # ids of the events the consumers below handled


async def _on_uploads(conn: Any, event: Event[UploadCompleted]) -> None:
    HANDLED.add(event.id)


async def _on_recordings(conn: Any, event: Event[RecordingCompleted]) -> None:
    HANDLED.add(event.id)


async def _on_deletions(conn: Any, event: Event[VideoDeleted]) -> None:
    HANDLED.add(event.id)


async def _on_videos(conn: Any, event: Event[VideoCreated]) -> None:
    HANDLED.add(event.id)


async def _on_status(conn: Any, event: EncodeEvent) -> None:
    HANDLED.add(event.id)


async def _on_webhooks_videos(conn: Any, event: Event[VideoCreated] | Event[VideoDeleted] | Event[UploadCompleted]
                              | Event[VideoRetired]) -> None:
    HANDLED.add(event.id)


async def _on_webhooks_own(conn: Any, event: Event[WebhookDisabled]) -> None:
    HANDLED.add(event.id)


def _disabled() -> Any:
    return new_event(WebhookDisabled(endpoint_id="e1", app_id="app1", account_id="acct1", reason="gone"),
                     source="webhooks", subject="e1")


def _recording() -> Any:
    return new_event(RecordingCompleted(recording_id="r2", object_key="recordings/r2", size=5), source="publisher",
                     subject="r2")


def _deletion() -> Any:
    return new_event(VideoDeleted(video_id="v-del", app_id="app1", account_id="acct1"), source="api", subject="v-del")


def _created() -> Any:
    return new_event(VideoCreated(video_id="v-new", app_id="app1", account_id="acct1"), source="api", subject="v-new")


def _started() -> Any:
    return new_event(EncodeStarted(video_id="v-st", output=360, worker="w1"), source="encode", subject="v-st")


# every durable a service reads: (service, consumer, its handler, who publishes its event, the event)
SERVICE_CONSUMERS: list[tuple[str, str, Any, str, Any]] = [
    ("encode", "encode_uploads", _on_uploads, "api", lambda: upload_event("v-consume")),
    ("encode", "encode_recordings", _on_recordings, "publisher", _recording),
    ("encode", "encode_deletions", _on_deletions, "api", _deletion),
    ("encode", "encode_videos", _on_videos, "api", _created),
    ("api", "api_status", _on_status, "encode", _started),
    ("webhooks", "webhooks_videos", _on_webhooks_videos, "api", _created),
    ("webhooks", "webhooks_encode", _on_status, "encode", _started),
    ("webhooks", "webhooks_own", _on_webhooks_own, "webhooks", _disabled),
]


def test_the_consumers_here_are_every_durable_of_the_services() -> None:
    declared = {(s, d.name) for s in SERVICES for d in IDENTITIES[s].durables if not d.name.endswith("_replay")}
    assert {(s, c) for s, c, *_ in SERVICE_CONSUMERS} == declared


@pytest.mark.parametrize(("service", "name", "handler", "publisher", "make"), SERVICE_CONSUMERS,
                         ids=[c for _, c, *_ in SERVICE_CONSUMERS])
async def test_a_service_consumes_its_events_with_its_rights(
    ready: IdentityServer, service: str, name: str, handler: Any, publisher: str, make: Any
) -> None:
    """EventConsumer as the service runs it: its durables made (`ensure`: info, create), its nats-py pulls (main
    and replay) bound and fetching, the handler's batch committed and each message acknowledged,
    all on the service's rights alone. The event comes from its publisher's identity, acknowledged by JetStream."""
    event = make()
    async with service_broker(ready, publisher) as (broker, errors):
        subject = bus_subject(event) or event.type  # as the outbox relay sends it (webhook.disabled: no bare type)
        ack = await EventPublishers(broker, (event.type,), timeout=2).publish(subject, event.to_bytes(), event.id)
        assert await errors.settled() == []
    async with service_broker(ready, service) as (broker, errors):
        consumer = EventConsumer(ConsumerSpec(name=name, handler=handler), pool=_Pool(),
                                 settings=CommonSettings(consumer_fetch_wait_seconds=0.2))
        js = broker.connection.jetstream()
        await consumer.ensure(js)
        consumer.register(broker)
        await broker.start()
        consumer.start()
        deadline = time.monotonic() + 10
        while event.id not in HANDLED:
            assert time.monotonic() < deadline, f"{name} did not handle {event.type}; errors: {errors.errors}"
            await asyncio.sleep(0.02)
        await consumer.drain(5)
        while (info := await js.consumer_info(ack.stream, name)).num_ack_pending or info.num_pending:
            assert time.monotonic() < deadline, info
            await asyncio.sleep(0.05)
        await js.consumer_info("REPLAY", f"{name}_replay")  # its replay durable is there too
        assert await errors.settled() == []


async def test_faststream_pull_subscribers_use_the_default_inbox_unless_told(ready: IdentityServer) -> None:
    """Why EventConsumer pulls with nats-py (on the connection's inbox prefix), not FastStream: the broker's inbox
    prefix does not reach a FastStream pull subscriber."""
    async with service_broker(ready, "encode") as (broker, errors):
        sub = broker.subscriber("video.deleted", stream=no_declare("VIDEOS"), durable="encode_deletions",
                                pull_sub=PullSub(batch_size=1, timeout=0.2))

        @sub
        async def nothing(body: bytes) -> None: ...

        await broker.start()
        deadline = time.monotonic() + 5
        while not any("subscription to \"_inbox." in e and '"_inbox.encode.' not in e for e in errors.errors):
            assert time.monotonic() < deadline, errors.errors
            await asyncio.sleep(0.05)


async def test_the_operator_replays_to_encode_and_encode_reads_its_replay_durable(ready: IdentityServer) -> None:
    async with service_broker(ready, "api") as (api_broker, _):
        event = upload_event("v-replay")
        await EventPublishers(api_broker, ("upload.completed",), timeout=2).publish(
            "upload.completed", event.to_bytes(), event.id)
    async with connected(ready, "encode") as encode:
        # encode's durables exist (as its EventConsumer makes them), so `weir replay` finds encode_uploads
        consumer = EventConsumer(ConsumerSpec(name="encode_uploads", handler=_never), pool=_Pool(),
                                 settings=SETTINGS)
        await consumer.ensure(encode.nc.jetstream())
        async with service_broker(ready, "operator") as (operator, errors):  # `weir replay`, on the CLI's broker
            publishers = EventPublishers(operator, timeout=2, replay=True)
            report = await replay(publishers, stream="VIDEOS", subject="upload.completed",
                                  since=datetime.now(UTC) - timedelta(hours=1), to=["encode_uploads"])
            assert report.delivered["encode_uploads"] >= 1
            assert await errors.settled() == []
        js = encode.nc.jetstream(timeout=2)
        config = consumer.consumer_config(durable="encode_uploads_replay", subjects=["replay.encode_uploads.>"])
        sub = await js.pull_subscribe("replay.encode_uploads.>", durable="encode_uploads_replay", stream="REPLAY",
                                      config=config)
        ids: set[str] = set()
        while event.id not in ids:
            for m in await sub.fetch(50, timeout=2):
                ids.add(json.loads(m.data)["id"])
                await m.ack()
        assert await encode.settled() == []


async def _never(conn: Any, e: Event[UploadCompleted]) -> None:
    raise AssertionError("not run here")


async def test_auth_counts_and_reads_its_counters_and_no_one_else_does(ready: IdentityServer) -> None:
    async with connected(ready, "auth") as auth, connected(ready, "api") as api_client:
        counters = JetStreamCounters(auth.nc, timeout_ms=2000)
        subject = "limits.test.key1.1700000000"
        assert await counters.incr(subject, 2) == 2
        assert await counters.incr(subject) == 3
        assert await counters.read(subject) == 3
        assert await auth.settled() == []
        await api_client.nc.publish(subject, b"", headers={"Nats-Incr": "+1"})
        await api_client.violation("publish", subject)
        await api_client.nc.publish(f"$JS.API.DIRECT.GET.LIMITS.{subject}", b"")
        await api_client.violation("publish", f"$JS.API.DIRECT.GET.LIMITS.{subject}")
        assert await counters.read(subject) == 3
