"""How a process connects to NATS as itself: its identity's NKEY seed (WEIR_NATS_NKEY_SEED), its own reply inbox
prefix `_INBOX.<identity>` (no identity reads another's replies), and TLS (WEIR_NATS_TLS_CA, and _CERT/_KEY where the
server asks for a client certificate; `require_tls` refuses a connection that is in plaintext nevertheless).

A file that is not what its setting says is a `BusConfigError` naming the setting, raised before any connect.
`ConnectionWatch` holds each connection's error and reconnect callbacks and tells apart what the server refuses; a
request sent on a connection that then dropped learns it at the reconnect, and is sent once more (`request`,
`shared.authclient.CheckSender`).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import re
import ssl
import weakref
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, NoReturn, TypeVar
from urllib.parse import urlsplit

import nkeys  # type: ignore[import-untyped]
from faststream.nats.security import NatsNKey, NatsSecurity
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.protocol.parser import AUTHORIZATION_VIOLATION, PERMISSIONS_ERR

from shared.metrics import Metrics
from shared.settings import CommonSettings

log = logging.getLogger("weir.nats")

T = TypeVar("T")
_VIOLATION = re.compile(r"permissions violation for (publish|subscription) to \"?([^\"\s']+)", re.I)


class BusConfigError(RuntimeError):
    """The NATS settings cannot work (a seed or certificate file that is not there)."""


class ConnectionRefused(RuntimeError):
    """The server refused this identity (authorization violation)."""


class ConnectionLost(RuntimeError):
    """The connection a request went out on dropped before its reply came: the reply is lost (NATS replies are at
    most once), and the request may be sent again on the new connection."""


class PermissionRefused(RuntimeError):
    """The server refused a publish or subscribe outside the identity's rights."""

    def __init__(self, identity: str, operation: str, subject: str) -> None:
        super().__init__(f"NATS identity {identity!r} may not {operation} {subject!r}")
        self.identity = identity
        self.operation = operation
        self.subject = subject


INBOX_ROOT = "_INBOX"
# distinct subjects a watch names on /metrics (and keeps in `last_violation`); past them, "(other)": a subject may
# carry ids (an inbox, a JetStream ack), and one time series per id would grow /metrics without end
MAX_SUBJECT_LABELS = 100
OTHER_SUBJECTS = "(other)"


def connection_number(nc: NATS) -> int:
    """Which of the client's connections a publish made now may go out on: 0 the first, n after its n-th reconnect.
    While reconnecting nats-py holds a publish for the next connection, yet a flush asked for before the drop can
    still write it to the dead socket (its flusher checks the state only between flushes): such a publish counts
    as the lost connection's, so the reconnect sends it again (twice at worst, never not at all)."""
    return int(nc.stats["reconnects"])


def lost_in_reconnect(sent_on: int, reconnects: int, retried: bool) -> bool:
    """At a reconnect (the client's `reconnects`-th), a request still waiting that went out on an earlier connection
    (`sent_on`, from `connection_number`) lost its reply: send it again, unless it was sent again once already."""
    return not retried and sent_on < reconnects


def inbox_prefix(name: str) -> str:
    """Where an identity's replies come (`nats.connect(..., inbox_prefix=...)`, `NatsBroker(inbox_prefix=...)`): it
    may subscribe only below it, so no identity reads another's replies."""
    return f"{INBOX_ROOT}.{name}"


def identity(settings: CommonSettings, default: str) -> str:
    return settings.nats_identity or default


def _file(setting: str, path: str) -> str:
    try:
        with open(path, "rb"):
            pass
    except OSError as exc:
        raise BusConfigError(f"WEIR_{setting.upper()} names {path!r}, which is not a readable file "
                             f"({exc.strerror or type(exc).__name__})") from None
    if not Path(path).is_file():
        raise BusConfigError(f"WEIR_{setting.upper()} names {path!r}, which is not a readable file")
    return path


def _seed(setting: str, path: str) -> str:
    """A seed file nats-py can sign with: read and decoded here, so a damaged one stops the process at start with
    the setting's name (nats-py would raise nkeys' own error out of its connect, or retry for ever)."""
    data = Path(_file(setting, path)).read_bytes()
    try:
        nkeys.from_seed(bytearray(data.strip())).wipe()
    except Exception:  # nkeys' errors; never the seed itself in the message
        raise BusConfigError(f"WEIR_{setting.upper()} names {path!r}, which does not hold an NKEY seed") from None
    return path


def _encrypted_key() -> NoReturn:
    # ssl would otherwise ask for the key's passphrase on the terminal, and a service would hang there
    raise BusConfigError("WEIR_NATS_TLS_KEY names an encrypted key: give the client certificate's key unencrypted")


def tls_context(settings: CommonSettings) -> ssl.SSLContext | None:
    """TLS to the server when a CA is configured (verifying the server), with a client certificate when given.
    A file that is not what its setting says is a BusConfigError naming the setting."""
    if not settings.nats_tls_ca:
        if settings.nats_tls_cert or settings.nats_tls_key:
            raise BusConfigError("WEIR_NATS_TLS_CERT/KEY need WEIR_NATS_TLS_CA to verify the server by")
        return None
    ca = _file("nats_tls_ca", settings.nats_tls_ca)
    context = TlsContext(ssl.PROTOCOL_TLS_CLIENT)  # as ssl.create_default_context: verifies the server's name
    try:
        context.load_verify_locations(cafile=ca)
    except ssl.SSLError as exc:
        raise BusConfigError(f"WEIR_NATS_TLS_CA names {ca!r}, which holds no CA certificate (PEM): "
                             f"{exc.reason or exc}") from None
    if settings.nats_tls_cert or settings.nats_tls_key:
        if not (settings.nats_tls_cert and settings.nats_tls_key):
            raise BusConfigError("a client certificate needs both WEIR_NATS_TLS_CERT and WEIR_NATS_TLS_KEY")
        cert, key = _file("nats_tls_cert", settings.nats_tls_cert), _file("nats_tls_key", settings.nats_tls_key)
        try:
            context.load_cert_chain(cert, key, password=_encrypted_key)
        except ssl.SSLError as exc:
            raise BusConfigError(f"WEIR_NATS_TLS_CERT and WEIR_NATS_TLS_KEY ({cert!r}, {key!r}) are not a "
                                 f"certificate (PEM) and its own key: {exc.reason or exc}") from None
    return context


def seed_file(settings: CommonSettings, name: str) -> str | None:
    """The identity's seed file: WEIR_NATS_NKEY_SEED, else `<name>.nk` in WEIR_NATS_NKEY_SEED_DIR (as `weir up`
    writes them), else none."""
    if settings.nats_nkey_seed:
        return _seed("nats_nkey_seed", settings.nats_nkey_seed)
    if settings.nats_nkey_seed_dir:
        return _seed("nats_nkey_seed_dir", str(Path(settings.nats_nkey_seed_dir) / f"{name}.nk"))
    return None


def security(settings: CommonSettings, default_identity: str) -> NatsSecurity | None:
    """FastStream's security object for a broker: the NKEY seed and TLS (None: neither is configured)."""
    context = tls_context(settings)
    seed = seed_file(settings, identity(settings, default_identity))
    if seed:
        return NatsNKey.from_file(seed, ssl_context=context,
                                  use_ssl=context is not None)
    if context is not None:
        return NatsSecurity(ssl_context=context, use_ssl=True)
    return None


class TlsContext(ssl.SSLContext):
    """The client's TLS context, counting the TLS sessions started with it: nats-py does not say whether its
    connection speaks TLS, and every TLS session (asyncio's or uvloop's) starts with the context's `wrap_bio`."""

    sessions_started = 0

    def wrap_bio(self, *args: Any, **kwargs: Any) -> ssl.SSLObject:
        self.sessions_started += 1
        return super().wrap_bio(*args, **kwargs)


def tls_in_use(nc: NATS) -> bool:
    """The connection started TLS with Weir's own context (nats-py starts it, when it does, before CONNECT)."""
    context = nc.options.get("tls")
    return isinstance(context, TlsContext) and context.sessions_started > 0


def require_tls(settings: CommonSettings, nc: NATS) -> None:
    """With WEIR_NATS_TLS_CA set, a connection that is not TLS is a BusConfigError: nats-py upgrades to TLS only
    when the server's INFO asks for it, so a server without TLS (or anything in between that drops the request)
    would get the seed's signature and every message in plaintext. Call it once connected."""
    if settings.nats_tls_ca and not tls_in_use(nc):
        server = nc.connected_url.netloc if nc.connected_url else settings.nats_url
        raise BusConfigError(f"WEIR_NATS_TLS_CA is set, but the NATS server at {server} did not offer TLS: "
                             "not talking to it in plaintext")


def connect_options(settings: CommonSettings, default_identity: str) -> dict[str, Any]:
    """The same for a plain nats-py connection (`nats.connect(**...)`): seed, TLS and the reply inbox prefix."""
    options: dict[str, Any] = {"inbox_prefix": inbox_prefix(identity(settings, default_identity))}
    context = tls_context(settings)
    if context is not None:
        options["tls"] = context
    seed = seed_file(settings, identity(settings, default_identity))
    if seed:
        options["nkeys_seed"] = seed
    return options


class ConnectionWatch:
    """The error and reconnect callbacks of one connection.

    Before the first connection, an authorization violation (no, an unknown or a wrong seed) or a TLS handshake that
    cannot succeed sets `refused`: the service exits at start instead of retrying in silence. A connection cut before
    the first one succeeds is diagnosed by `probe` (`tls_probe`): with TLS 1.3 the server's reset can overtake its
    alert on the client's certificate. A permissions violation is logged and counted, and fails at once every request
    to that subject waiting through `request` (`PermissionRefused`); the server's text comes lower-cased.
    """

    def __init__(self, name: str, metrics: Metrics | None = None,
                 probe: Callable[[], Awaitable[BaseException | None]] | None = None, caller_says: bool = False) -> None:
        self.identity = name
        self.caller_says = caller_says  # a failed first connect is the caller's to report (a tool's one line)
        self.metrics = metrics
        self.probe = probe  # what the server says to a handshake that only reads (`tls_probe`), for a cut connection
        self._probing: asyncio.Task[None] | None = None
        self.connected_once = False
        self.refused = asyncio.Event()
        self.reason = ""  # why the server refused the connection (set with `refused`)
        self.last_violation: dict[str, PermissionRefused] = {}  # the latest refusals, by subject (bounded)
        self._labelled: set[str] = set()  # subjects named on /metrics so far
        self._waiting: dict[str, set[asyncio.Future[Any]]] = {}
        self._sent_on: dict[asyncio.Future[Any], int] = {}  # requests to send again if lost: the connection of each
        self._on_reconnect: list[Callable[[], object]] = []
        self._nc: weakref.ref[NATS] | None = None  # the connection watched (`attach`)

    def on_reconnect(self, hook: Callable[[], object]) -> None:
        """`hook` runs each time the connection is made again (what was missed meanwhile may matter); one that
        returns an awaitable is awaited."""
        self._on_reconnect.append(hook)

    async def reconnected_cb(self) -> None:
        """nats-py's `reconnected_cb` (through the broker's, which logs the reconnection). nats-py calls it once the
        subscriptions are made again on the new connection and what it held meanwhile is sent: the requests whose
        reply was lost with the old connection are told (`ConnectionLost`), then the hooks run."""
        nc = self._nc() if self._nc is not None else None
        if nc is not None:
            reconnects = int(nc.stats["reconnects"])
            for future, sent_on in list(self._sent_on.items()):
                if lost_in_reconnect(sent_on, reconnects, retried=False) and not future.done():
                    future.set_exception(ConnectionLost())
        for hook in self._on_reconnect:
            try:
                result = hook()
                if inspect.isawaitable(result):
                    await result
            except Exception:  # one hook's failure does not keep the others from running
                log.exception("NATS (%s): a reconnect hook failed", self.identity)

    def count_retried(self, subject: str, requests: int = 1) -> None:
        """Requests to `subject` sent again on a new connection (`weir_nats_requests_retried_total`)."""
        if self.metrics is not None:
            self.metrics.inc("nats_requests_retried_total", requests,
                             help="requests sent again on a new connection: the one they went out on dropped "
                             "(auth.check, encode.status)",
                             subject=subject)

    async def error_cb(self, exc: Exception) -> None:
        text = str(exc)
        lowered = text.lower()
        if AUTHORIZATION_VIOLATION in lowered or "authorization" in type(exc).__name__.lower():
            log.error("NATS refused identity %r: authorization violation (check WEIR_NATS_NKEY_SEED: no seed, "
                      "an unknown one or a wrong one)", self.identity)
            self._count("nats_authorization_violations_total", "connections the server refused")
            self._refuse(f"NATS refused identity {self.identity!r}: authorization violation")
            return
        if PERMISSIONS_ERR in lowered:
            match = _VIOLATION.search(text)
            operation = "publish to" if match is None or match.group(1).lower() == "publish" else "subscribe to"
            told = match.group(2) if match else "?"
            # the server's text comes lower-cased: the waiting requests' subjects say how it is spelled
            spelled = [s for s in self._waiting if s.lower() == told.lower()]
            subject = spelled[0] if spelled else told
            refusal = PermissionRefused(self.identity, operation, subject)
            self.last_violation.pop(subject, None)
            self.last_violation[subject] = refusal
            while len(self.last_violation) > MAX_SUBJECT_LABELS:
                del self.last_violation[next(iter(self.last_violation))]
            log.error("permission violation: NATS identity %r may not %s %r", self.identity, operation, subject)
            self._count("nats_permission_violations_total", "publishes and subscribes the server refused",
                        operation=operation.split()[0], subject=subject)
            for key in spelled:
                for future in self._waiting.pop(key, set()):
                    if not future.done():
                        future.set_exception(PermissionRefused(self.identity, operation, key))
            return
        tls = _tls_failure(exc)
        if tls is not None and not self.connected_once:
            self._tls_refused(tls)
            return
        if self.probe is not None and not self.connected_once and self._probing is None:
            self._probing = asyncio.ensure_future(self._probe(self.probe))
        if self.caller_says and not self.connected_once:
            return
        log.warning("NATS (%s): %s", self.identity, text or type(exc).__name__)

    def _tls_refused(self, tls: str) -> None:
        log.error("NATS (%s): %s", self.identity, tls)
        self._count("nats_tls_failures_total", "TLS handshakes with the server that failed")
        self._refuse(f"NATS identity {self.identity!r} cannot connect: {tls}")

    async def _probe(self, probe: Callable[[], Awaitable[BaseException | None]]) -> None:
        """A connection was cut before the first one succeeded: ask the server what it says to a handshake that
        only reads; a refusal of this client's certificate refuses the identity (the next cut probes again)."""
        try:
            said = await probe()
        except Exception as exc:  # the probe is a diagnosis: the connect attempts go on as before
            log.debug("NATS (%s): TLS probe failed: %r", self.identity, exc)
            said = None
        finally:
            self._probing = None
        tls = None if said is None else _tls_failure(said)
        if tls is not None and not self.connected_once:
            self._tls_refused(tls)

    def _refuse(self, reason: str) -> None:
        """Before the first connection: the server will not have this connection, so stop trying."""
        if not self.connected_once and not self.refused.is_set():
            self.reason = reason
            self.refused.set()

    def _count(self, name: str, help: str, operation: str = "", subject: str = "") -> None:
        if self.metrics is None:
            return
        if subject:
            if subject not in self._labelled:
                if len(self._labelled) >= MAX_SUBJECT_LABELS:
                    subject = OTHER_SUBJECTS
                else:
                    self._labelled.add(subject)
            self.metrics.inc(name, help=help, identity=self.identity, operation=operation, subject=subject)
        else:
            self.metrics.inc(name, help=help, identity=self.identity)

    async def connected(self, connect: Awaitable[T]) -> T:
        """`connect` (a broker's or nats-py's), or ConnectionRefused as soon as the server refuses the identity (or
        the TLS handshake cannot succeed). The connect attempt stops with it (and when this call is cancelled)."""
        task = asyncio.ensure_future(connect)
        refused = asyncio.ensure_future(self.refused.wait())
        try:
            await asyncio.wait({task, refused}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            refused.cancel()
            if not task.done():  # refused, or this call cancelled: no connect attempt goes on behind it
                task.cancel()
                await asyncio.wait({task}, timeout=5)
        if not task.done() or task.cancelled():
            raise ConnectionRefused(self.reason or f"NATS refused identity {self.identity!r}")
        failed = task.exception()
        if failed is not None and self.refused.is_set():
            # FastStream's own error callback raises an authorization violation out of the connect: the same refusal
            raise ConnectionRefused(self.reason) from failed
        result = task.result()
        self.connected_once = True
        if isinstance(result, NATS):
            self.attach(result)
        return result

    def attach(self, nc: NATS) -> None:
        """This watch is `nc`'s (its error and reconnect callbacks): `request(None, nc, ...)` finds it."""
        _WATCHES[nc] = self
        self._nc = weakref.ref(nc)

    async def refusable(self, subject: str, call: Awaitable[T], *, sent_on: int | None = None) -> T:
        """`call` (a request or publish to `subject`), failing with PermissionRefused as soon as the server refuses
        the subject to this identity; with `sent_on` (its `connection_number`), failing with ConnectionLost at the
        reconnect when that connection dropped before the reply came."""
        loop = asyncio.get_running_loop()
        refusal: asyncio.Future[Any] = loop.create_future()
        self._waiting.setdefault(subject, set()).add(refusal)
        if sent_on is not None:
            self._sent_on[refusal] = sent_on
        task = asyncio.ensure_future(call)
        try:
            await asyncio.wait({task, refusal}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.forget(subject, refusal)
            self._sent_on.pop(refusal, None)
            if not task.done():  # refused, or this call cancelled: the request waits no longer
                task.cancel()
        if task.done():  # answered (or failed on its own) before any refusal
            return task.result()
        raise refusal.exception() or PermissionRefused(self.identity, "publish to", subject)

    def fail_waiting(self, subject: str, future: asyncio.Future[Any]) -> None:
        """Register `future` (resolved by its owner) to fail as soon as `subject` is refused; the owner removes it
        with `forget` (cheaper than `refusable` on a hot path: no task)."""
        self._waiting.setdefault(subject, set()).add(future)

    def forget(self, subject: str, future: asyncio.Future[Any]) -> None:
        waiting = self._waiting.get(subject)
        if waiting is not None:
            waiting.discard(future)
            if not waiting:
                del self._waiting[subject]


_WATCHES: weakref.WeakKeyDictionary[NATS, ConnectionWatch] = weakref.WeakKeyDictionary()  # each connection's watch

_NOT_REFUSALS = (ssl.SSLEOFError, ssl.SSLZeroReturnError, ssl.SSLSyscallError, ssl.SSLWantReadError,
                 ssl.SSLWantWriteError)


def tls_probe(settings: CommonSettings, server: str, *, timeout: float = 2.0
              ) -> Callable[[], Awaitable[BaseException | None]] | None:
    """With TLS configured, what `server` says to a TLS handshake made as this process makes it, after which the
    probe reads and never writes (None when TLS is not configured): the server's alert, as the SSLError it raises,
    or None when the server says nothing within `timeout` (the certificate is accepted: it waits for CONNECT) or the
    connection is cut. nats-server sends its INFO in plaintext first, then the client starts TLS, as nats-py does."""
    context = tls_context(settings)
    if context is None:
        return None
    url = urlsplit(server if "://" in server else f"nats://{server}")
    host, port = url.hostname or "127.0.0.1", url.port or 4222

    async def probe() -> BaseException | None:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
        try:
            await asyncio.wait_for(reader.readline(), timeout)  # INFO
            await asyncio.wait_for(writer.start_tls(context, server_hostname=host), timeout)
            await asyncio.wait_for(reader.read(1), timeout)  # with TLS 1.3, the verdict on our certificate
        except ssl.SSLError as exc:
            return exc
        except (OSError, TimeoutError, asyncio.IncompleteReadError):
            return None
        finally:
            writer.close()
        return None

    return probe


def _tls_failure(exc: BaseException) -> str | None:
    """What a failed TLS handshake says, when it will fail again the same way (not a connection cut mid-way)."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return (f"the server's TLS certificate is not trusted ({exc.verify_message or exc.reason}): "
                "WEIR_NATS_TLS_CA must name the certificate authority that issued it")
    if not isinstance(exc, ssl.SSLError) or isinstance(exc, _NOT_REFUSALS):
        return None
    reason = str(exc.reason or exc)
    if "CERTIFICATE_REQUIRED" in reason.upper():
        return (f"the server asks for a client certificate and got none ({reason}): set WEIR_NATS_TLS_CERT and "
                "WEIR_NATS_TLS_KEY")
    if "ALERT" in reason.upper():
        return (f"the server refused this client's TLS certificate ({reason}): WEIR_NATS_TLS_CERT and "
                "WEIR_NATS_TLS_KEY must name a certificate issued by a certificate authority the server trusts")
    return f"the TLS handshake with the server failed ({reason})"


async def request(watch: ConnectionWatch | None, nc: NATS, subject: str, payload: bytes, *, timeout: float,
                  headers: dict[str, str] | None = None, resend_if_lost: bool = False) -> Msg:
    """nats-py's request, failing at once (PermissionRefused) when this identity may not publish to `subject`; the
    connection's own watch when none is given.

    `resend_if_lost` (for a request that may be answered twice, such as a read): when the connection it went out on
    drops before the reply comes, it is sent once more on the new connection, waiting only what is left of
    `timeout`. Not for one that must not be done twice (`auth.manage.*` creates)."""
    watch = watch or _WATCHES.get(nc)
    if watch is None:
        return await nc.request(subject, payload, timeout=timeout, headers=headers)
    if not resend_if_lost:
        return await watch.refusable(subject, nc.request(subject, payload, timeout=timeout, headers=headers))
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    try:
        return await watch.refusable(subject, nc.request(subject, payload, timeout=timeout, headers=headers),
                                     sent_on=connection_number(nc))
    except ConnectionLost:
        left = deadline - loop.time()
        if left <= 0:
            raise TimeoutError(f"no reply to {subject} within {timeout} s") from None
    watch.count_retried(subject)
    return await watch.refusable(subject, nc.request(subject, payload, timeout=left, headers=headers))
