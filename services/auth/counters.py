"""Request-limit counters: exact across instances in a JetStream counter stream; local windows when it cannot answer.

A counter is the subject `limits.<rule>.<key>.<window start>` of the `LIMITS` stream (`allow_msg_counter`, ADR-49,
nats-server 2.12+): a publish with `Nats-Incr: +k` adds k under the stream's lock and the PubAck carries the new
total (`"val":"42"`), so any number of auth instances count exactly, with no read-then-increment.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from nats.aio.client import Client as NATS
from nats.errors import BadSubjectError, NoRespondersError
from nats.errors import Error as NatsError

from services.auth.domain.rules import HOUR_SECONDS, subject_token
from services.auth.settings import AuthSettings
from shared.contracts import COUNTER_PREFIX, LIMITS_STREAM
from shared.metrics import Metrics
from shared.streams import StreamSpec, stream_named, subject_matches

log = logging.getLogger("weir.auth.counters")

INCR_HEADER = "Nats-Incr"  # ADR-49: `+k` / `-k`, any big integer; the stream refuses a message without it
SUBJECT_PREFIX = COUNTER_PREFIX
PROBE_SUBJECT = f"{SUBJECT_PREFIX}.probe"  # `+0` here asks the store to answer without counting anything


def counter_stream(settings: AuthSettings | None = None) -> StreamSpec:
    """The counter stream, as declared once in `shared.streams` (`weir streams apply` provisions it)."""
    # A counter stream refuses per-message TTLs (`allow_msg_ttl`, `Nats-TTL`), so windows expire by the stream's
    # max_age (twice the hour rules' window): a new window is a new subject and the old one ages out, and
    # max_msgs_per_subject=1 keeps only each counter's latest message (its total), so size follows live counters.
    del settings
    return stream_named(LIMITS_STREAM)


COUNTER_STREAM = counter_stream()

Mode = Literal["shared", "local"]


# ------------------------------------------------------------------------------------------------ subjects


def counter_subject(rule: str, key: str, start: int) -> str:
    """`limits.<rule>.<key>.<window start>`: one counter per rule, key and window (tokens as the domain makes them)."""
    return f"{SUBJECT_PREFIX}.{subject_token(rule)}.{subject_token(key)}.{start}"


class InvalidCounterSubject(ValueError):
    """A subject that names no single counter of the stream: a caller's bug, never a reason to fall back."""


def check_subject(subject: str, patterns: tuple[str, ...]) -> None:
    tokens = subject.split(".")
    if any(t == "" or t in ("*", ">") or any(c.isspace() for c in t) for t in tokens):
        # the server would count `limits.*` against some matching counter instead of refusing it
        raise InvalidCounterSubject(f"not a counter subject: {subject!r} (empty token, wildcard or whitespace)")
    if not any(subject_matches(p, subject) for p in patterns):
        raise InvalidCounterSubject(f"{subject!r} is not captured by the counter stream's subjects {patterns}")


# ------------------------------------------------------------------------------------------------ errors


class CounterStoreError(RuntimeError):
    """The shared store did not give a total: refused, unreachable or too slow."""


class CounterStoreTimeout(CounterStoreError):
    """No answer within the budget (`counter_store_timeout_ms`)."""


class CounterStoreFailingOver(CounterStoreError):
    """The shared store stopped answering moments ago: counting waits for it (no local count) for a while."""


class CounterStoreUnavailable(CounterStoreError):
    """Not connected, or nothing answers on the subject (the stream does not exist or its server is gone)."""


# ------------------------------------------------------------------------------------------------ stores


class CounterStore(Protocol):
    async def read(self, subject: str) -> int:
        """The counter's current total (0 for one never counted), without counting anything."""
        ...

    async def incr(self, subject: str, by: int = 1) -> int:
        """Add `by` to the counter and return its total after this increment."""
        ...

    async def give_back(self, subject: str, by: int) -> None:
        """Take back `by` counts that were taken and never used (leases returned)."""
        ...


@dataclass(eq=False)
class _Waiter:
    by: int
    fut: asyncio.Future[int]


class JetStreamCounters:
    """The shared store: exact across instances; concurrent increments of one counter share a publish.

    While a subject's publish is in flight its later callers queue and the next publish carries their sum (k); the
    total T in its PubAck gives them, in queue order, T-k+1 ... T. A caller whose budget runs out while queued is
    not counted; one already sent may be, so a miss over-counts, never admits too much. A late PubAck is still
    awaited for `late_ack_ms` and reported to `on_late(subject, k, total)`, so a slow store does not refuse below
    the limit (ResilientCounters learns which counts are still free)."""

    def __init__(
        self,
        nc: NATS,
        *,
        stream: str = COUNTER_STREAM.name,
        timeout_ms: int,
        subjects: tuple[str, ...] = COUNTER_STREAM.subjects,
        probe_subject: str = PROBE_SUBJECT,
        batch: bool = True,
        late_ack_ms: int = 0,
    ) -> None:
        if timeout_ms <= 0:
            raise ValueError("timeout_ms must be positive")
        self._nc = nc
        self.stream = stream
        self.timeout_s = timeout_ms / 1000
        self.late_ack_s = max(late_ack_ms / 1000, self.timeout_s) if late_ack_ms > 0 else 0.0
        self.on_late: Callable[[str, int, int], None] | None = None  # (subject, k, total) of a late PubAck
        # (subject, delta) of a publish the store never acknowledged: applied or not, nobody will know (a leader
        # killed between applying it and answering); its counts may stay in the store unused
        self.on_doubt: Callable[[str, int], None] | None = None
        self._late: set[asyncio.Task[Any]] = set()
        check_subject(probe_subject, subjects)
        self._probe_subject = probe_subject
        self.subjects = subjects
        # subject -> callers waiting for the next publish; a key is present while a publish for it is in flight
        self._queues: dict[str, list[_Waiter]] = {}
        self._flushers: set[asyncio.Task[None]] = set()
        self.batch = batch  # False: one publish per increment (the benchmark's comparison)
        self.publishes = 0  # requests sent, for the benchmark and tests of batching
        self._valid: set[str] = set()  # subjects already checked

    @classmethod
    def from_settings(cls, nc: NATS, settings: AuthSettings) -> JetStreamCounters:
        spec = counter_stream(settings)
        return cls(nc, stream=spec.name, timeout_ms=settings.counter_store_timeout_ms, subjects=spec.subjects,
                   late_ack_ms=settings.counter_store_late_ack_ms)

    async def incr(self, subject: str, by: int = 1) -> int:
        if by < 0:
            raise ValueError("a limit counter only grows")
        if subject not in self._valid:
            check_subject(subject, self.subjects)
            if len(self._valid) > 100_000:
                self._valid.clear()
            self._valid.add(subject)
        if not self.batch:
            return await self._publish(subject, by)
        queue = self._queues.get(subject)
        if queue is None:
            # an idle counter: this caller publishes its own increment; callers arriving meanwhile queue
            self._queues[subject] = []
            try:
                return await self._publish(subject, by)  # bounded by the budget (the request's timeout)
            finally:
                self._hand_over(subject)
        waiter = _Waiter(by, asyncio.get_running_loop().create_future())
        queue.append(waiter)
        try:
            async with asyncio.timeout(self.timeout_s):
                return await waiter.fut  # a timeout cancels the future, so a still-queued caller is not sent
        except TimeoutError:
            raise CounterStoreTimeout(
                f"counter store gave no total for {subject} within {self.timeout_s * 1000:g} ms"
            ) from None

    async def read(self, subject: str) -> int:
        """The total as the stream holds it: a direct get of the subject's last message (the stream allows direct
        gets), so a read writes nothing, unlike an increment by 0."""
        check_subject(subject, self.subjects)
        if not self._nc.is_connected:
            raise CounterStoreUnavailable("not connected to NATS")
        try:
            msg = await self._nc.request(f"$JS.API.DIRECT.GET.{self.stream}.{subject}", b"", timeout=self.timeout_s)
        except NoRespondersError:
            raise CounterStoreUnavailable(f"no stream answers direct gets for {subject}") from None
        except TimeoutError:
            raise CounterStoreTimeout(f"no answer for {subject} within {self.timeout_s * 1000:g} ms") from None
        except (NatsError, OSError) as exc:
            raise CounterStoreUnavailable(f"direct get of {subject} failed: {exc!r}") from exc
        status = (msg.headers or {}).get("Status")
        if status == "404":
            return 0  # never counted in this window
        if status is not None:
            detail = (msg.headers or {}).get("Description")
            raise CounterStoreError(f"direct get of {subject} answered {status}: {detail}")
        try:
            val = json.loads(msg.data)["val"]
            return int(val)
        except (ValueError, KeyError, TypeError):
            raise CounterStoreError(f"unreadable counter message for {subject}: {msg.data[:200]!r}") from None

    def _hand_over(self, subject: str) -> None:
        """After a publish: the callers that queued meanwhile go out together, from a flusher task."""
        if self._queues.get(subject):
            task = asyncio.create_task(self._flush(subject), name=f"counter-flush {subject}")
            self._flushers.add(task)
            task.add_done_callback(self._flushers.discard)
        else:
            self._queues.pop(subject, None)

    async def give_back(self, subject: str, by: int) -> None:
        """Subtract `by` counts this instance took and will not use (`Nats-Incr: -k`), at once, not batched."""
        if by < 0:
            raise ValueError("give back a positive number of counts")
        if by:
            check_subject(subject, self.subjects)
            await self._publish(subject, -by)

    async def ping(self) -> None:
        """Ask the store to answer (an increment by 0 of the probe counter); raises CounterStoreError if it cannot."""
        await self.incr(self._probe_subject, 0)

    async def close(self) -> None:
        """Wait for publishes in flight (each ends within the budget); stop awaiting late PubAcks."""
        if self._flushers:
            await asyncio.gather(*self._flushers, return_exceptions=True)
        for task in list(self._late):
            task.cancel()
        if self._late:
            await asyncio.gather(*self._late, return_exceptions=True)

    async def _flush(self, subject: str) -> None:
        while True:
            waiters = [w for w in self._queues.get(subject, ()) if not w.fut.done()]
            if not waiters:
                del self._queues[subject]  # no await between this check and the delete: no caller is stranded
                return
            self._queues[subject] = []  # callers arriving during the publish go out in the next one
            k = sum(w.by for w in waiters)
            try:
                total = await self._publish(subject, k)
            except Exception as exc:
                for w in waiters:
                    if not w.fut.done():
                        w.fut.set_exception(exc)
                continue
            except BaseException as exc:  # cancelled (loop shutting down): do not leave callers hanging
                for w in waiters:
                    if not w.fut.done():
                        w.fut.set_exception(CounterStoreUnavailable(f"counter publish aborted: {exc!r}"))
                for w in self._queues.pop(subject, ()):
                    if not w.fut.done():
                        w.fut.set_exception(CounterStoreUnavailable(f"counter publish aborted: {exc!r}"))
                raise
            count = total - k
            for w in waiters:
                count += w.by
                if not w.fut.done():
                    w.fut.set_result(count)

    async def _publish(self, subject: str, delta: int) -> int:
        if not self._nc.is_connected:
            # nats-py would buffer the publish until it reconnects and send it late: refuse now instead
            raise CounterStoreUnavailable("not connected to NATS")
        self.publishes += 1
        try:
            msg = await self._request(subject, delta)
        except NoRespondersError:
            raise CounterStoreUnavailable(
                f"no stream answers on {subject}: the {self.stream} stream is electing a leader, or not applied "
                "(`weir streams apply`)"
            ) from None
        except BadSubjectError:
            raise InvalidCounterSubject(f"not a counter subject: {subject!r}") from None
        except TimeoutError:  # nats.errors.TimeoutError is an asyncio.TimeoutError
            raise CounterStoreTimeout(f"no PubAck for {subject} within {self.timeout_s * 1000:g} ms") from None
        except (NatsError, OSError) as exc:
            raise CounterStoreUnavailable(f"counter publish to {subject} failed: {exc!r}") from exc
        return self._total(subject, msg.data)

    async def _request(self, subject: str, delta: int) -> Any:
        """The increment's PubAck within the budget. An increment (delta > 0) whose budget runs out goes on waiting
        for its PubAck, up to `late_ack_s`, for `on_late`: told in the same event-loop step as the PubAck is read,
        so before anything read after it (a probe's answer, and the re-sync that follows it)."""
        headers = {INCR_HEADER: f"{delta:+d}"}
        if delta <= 0 or not self.late_ack_s or self.on_late is None:
            try:
                return await self._nc.request(subject, b"", timeout=self.timeout_s, headers=headers)
            except TimeoutError:
                self._doubt(subject, delta)
                raise
        late = False

        async def send() -> Any:
            msg = await self._nc.request(subject, b"", timeout=self.late_ack_s, headers=headers)
            if late:
                self._late_ack(subject, delta, msg.data)
            return msg

        task = asyncio.ensure_future(send())
        try:
            return await asyncio.wait_for(asyncio.shield(task), self.timeout_s)
        except TimeoutError:
            late = True
            self._late.add(task)
            task.add_done_callback(lambda t: self._late_done(t, subject, delta))
            raise
        except BaseException:
            task.cancel()
            raise

    def _late_done(self, task: asyncio.Task[Any], subject: str, delta: int) -> None:
        self._late.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self._doubt(subject, delta)  # never answered: counted or not (over-counting, never under)

    def _doubt(self, subject: str, delta: int) -> None:
        if delta and self.on_doubt is not None:
            self.on_doubt(subject, delta)

    def _late_ack(self, subject: str, delta: int, data: bytes) -> None:
        try:
            total = self._total(subject, data)
        except CounterStoreError as exc:
            log.warning("a late PubAck of %s was unreadable: %s", subject, exc)
            return
        if self.on_late is not None:
            try:
                self.on_late(subject, delta, total)
            except Exception:
                log.exception("a late PubAck of %s could not be used", subject)

    def _total(self, subject: str, data: bytes) -> int:
        try:
            ack: dict[str, Any] = json.loads(data)
        except ValueError:
            raise CounterStoreError(f"unreadable PubAck for {subject}: {data[:200]!r}") from None
        if "error" in ack:
            err = ack["error"]
            # e.g. 10168 "message counters is disabled": the subject's stream is not a counter stream
            raise CounterStoreError(
                f"{ack.get('stream') or 'stream'} refused the increment of {subject}: "
                f"{err.get('description')} (code {err.get('code')}, err_code {err.get('err_code')})"
            )
        if ack.get("stream") != self.stream:
            raise CounterStoreError(f"{subject} is stored by stream {ack.get('stream')!r}, not {self.stream!r}")
        val = ack.get("val")
        if not isinstance(val, str):
            raise CounterStoreError(f"PubAck for {subject} carries no counter value: {data[:200]!r}")
        return int(val)


@dataclass(slots=True)
class _LocalCount:
    count: int
    unsynced: int  # counted here and not (yet) in the shared store
    since: float  # first seen, on the local clock


class LocalCounters:
    """Per-instance fixed windows with the same interface, for when the shared store cannot answer.

    The subject names the window, so a counter is simply forgotten once it is older than `retain_seconds` (the
    stream's `max_age`, twice the longest window); at most `max_counters` are kept, the oldest dropped first.
    While the shared store answers, `observe` records its totals, so a fall-back continues from the last shared
    count rather than from zero; `take_unsynced` returns what was counted only here.
    """

    def __init__(
        self,
        *,
        retain_seconds: float = COUNTER_STREAM.max_age_seconds or 2 * HOUR_SECONDS,
        max_counters: int = 500_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._retain = retain_seconds
        self._max = max_counters
        self._clock = clock
        self._counts: dict[str, _LocalCount] = {}  # in order of first sight, so the oldest come first

    async def incr(self, subject: str, by: int = 1) -> int:
        return self.incr_now(subject, by)

    async def read(self, subject: str) -> int:
        return self.peek(subject)

    def peek(self, subject: str) -> int:
        entry = self._counts.get(subject)
        return entry.count if entry is not None else 0

    def incr_now(self, subject: str, by: int = 1) -> int:
        if by < 0:
            raise ValueError("a limit counter only grows")
        entry = self._entry(subject)
        entry.count += by
        entry.unsynced += by
        return entry.count

    def observe(self, subject: str, total: int) -> None:
        """The shared store's total for a counter, so a later local count starts from it."""
        entry = self._entry(subject)
        if total > entry.count:
            entry.count = total

    async def give_back(self, subject: str, by: int) -> None:
        self.give_back_now(subject, by)

    def give_back_now(self, subject: str, by: int) -> int:
        """Returns how many of the `by` were counted only here (so the shared store never had them)."""
        entry = self._counts.get(subject)
        if entry is None:
            return 0
        entry.count = max(0, entry.count - by)
        kept = min(by, entry.unsynced)
        entry.unsynced -= kept
        return kept

    def take_unsynced(self) -> dict[str, int]:
        """The increments counted only here since the last call (to add to the shared store when it is back)."""
        out: dict[str, int] = {}
        for subject, entry in self._counts.items():
            if entry.unsynced:
                out[subject] = entry.unsynced
                entry.unsynced = 0
        return out

    def add_unsynced(self, subject: str, by: int) -> None:
        self._entry(subject).unsynced += by

    def synced(self, subject: str, by: int) -> None:
        """`by` of the counts made here reached the shared store after all (a late PubAck): not to be added again."""
        entry = self._counts.get(subject)
        if entry is not None:
            entry.unsynced -= min(by, entry.unsynced)

    def __len__(self) -> int:
        return len(self._counts)

    def _entry(self, subject: str) -> _LocalCount:
        entry = self._counts.get(subject)
        if entry is None:
            now = self._clock()
            self._forget_old(now)
            entry = self._counts[subject] = _LocalCount(0, 0, now)
        return entry

    def _forget_old(self, now: float) -> None:
        horizon = now - self._retain
        while self._counts:
            oldest = next(iter(self._counts))
            if self._counts[oldest].since >= horizon and len(self._counts) < self._max:
                return
            del self._counts[oldest]


class ResilientCounters:
    """The circuit breaker: the shared store while it answers within its budget, local windows while it does not.

    On a failure or timeout the request is answered locally at once and the circuit opens: every later request
    is local (no request waits for the store) while a background probe asks the store every `probe_interval_s`.
    When it answers, the circuit closes, and what was counted locally meanwhile is added to the shared counters.
    Each switch logs one line, sets the `counter_store_shared` gauge and calls `on_switch(mode, reason)`.
    """

    def __init__(
        self,
        shared: JetStreamCounters,
        local: LocalCounters | None = None,
        *,
        probe_interval_s: float = 0.5,
        failover_s: float = 0.0,
        metrics: Metrics | None = None,
        on_switch: Callable[[Mode, str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.shared = shared
        self.local = local if local is not None else LocalCounters()
        self.probe_interval_s = probe_interval_s
        # the failover phase: for this long after the store stopped answering, nothing is counted locally (an
        # increment raises CounterStoreFailingOver); a replicated store elects a new leader meanwhile
        self.failover_s = failover_s
        self._clock = clock
        self._failing_since: float | None = None
        self._metrics = metrics
        self._on_switch = on_switch
        self._mode: Mode = "shared"
        self._probe: asyncio.Task[None] | None = None
        self._closed = False
        # counts whose shared increment ran out of its budget, by what became of their requests, for a late PubAck
        # of that increment (JetStreamCounters.on_late): undecided (503 while failing over), so the counts the store
        # applied are free for the next requests (`_late_to`, the leases); or decided on local windows, so the store
        # has counted them already and they are not added again when it is back
        self._undecided: dict[str, int] = {}
        self._decided_locally: dict[str, int] = {}
        self._late_to: Callable[[str, int, int], None] | None = None
        shared.on_doubt = self._doubt
        self._set_gauge()

    @property
    def mode(self) -> Mode:
        return self._mode

    @property
    def failing_over(self) -> bool:
        """The store stopped answering less than `failover_s` ago: exact counting waits for it."""
        return self._failing_since is not None and self._clock() - self._failing_since < self.failover_s

    async def incr(self, subject: str, by: int = 1) -> int:
        timed_out = False
        if self._mode == "shared":
            try:
                total = await self.shared.incr(subject, by)
            except CounterStoreError as exc:
                timed_out = isinstance(exc, CounterStoreTimeout)  # the store may apply it yet (a late PubAck)
                self._open(str(exc))
            else:
                self.local.observe(subject, total)
                return total
        check_subject(subject, self.shared.subjects)  # a bad subject is refused in both modes alike
        if self.failing_over:
            if timed_out:
                self._note_timed_out(self._undecided, subject, by)
            raise CounterStoreFailingOver("the limits store is failing over; retry in a moment")
        if timed_out:
            self._note_timed_out(self._decided_locally, subject, by)
        return self.local.incr_now(subject, by)

    def send_late_totals_to(self, on_late: Callable[[str, int, int], None]) -> None:
        """Where the counts go of an increment the shared store applied after its budget, when its requests were
        answered 503 meanwhile (decided nowhere): `on_late(subject, k, total)`, the counts total-k+1 .. total."""
        self._late_to = on_late
        self.shared.on_late = self._late_ack

    def _late_ack(self, subject: str, size: int, total: int) -> None:
        self.local.observe(subject, total)  # a total of the shared store: local windows go on from it
        undecided = min(size, self._undecided.get(subject, 0))
        local = min(size - undecided, self._decided_locally.get(subject, 0))
        if undecided:
            self._undecided[subject] -= undecided
            if self._late_to is not None:
                self._late_to(subject, undecided, total - (size - undecided))
        if local:
            self._decided_locally[subject] -= local
            self.local.synced(subject, local)  # the late increment counted them in the store
        # the rest (counts synced since, or an increment of unknown purpose) stays counted: over, never under
        self._unusable("late_unclaimed", size - undecided - local)

    def _doubt(self, subject: str, delta: int) -> None:
        self._unusable("unacked" if delta > 0 else "give_back_unacked", abs(delta))

    def _unusable(self, why: str, n: int) -> None:
        """Counts the shared store may hold that no request here will take: the instances then admit fewer than the
        limit in that window (never more), by at most this metric's growth."""
        if n and self._metrics is not None:
            self._metrics.inc("counter_counts_unusable_total", n, help="counts the shared store may hold that no "
                              "request will take (an unacknowledged increment, a give-back that did not reach it)",
                              why=why)

    def _note_timed_out(self, ledger: dict[str, int], subject: str, by: int) -> None:
        if len(ledger) > 10_000:
            ledger.clear()  # late PubAcks then over-count, as without this ledger
        ledger[subject] = ledger.get(subject, 0) + by

    async def read(self, subject: str) -> int:
        if self._mode == "shared":
            try:
                total = await self.shared.read(subject)
            except CounterStoreError as exc:
                self._open(str(exc))
            else:
                self.local.observe(subject, total)
                return total
        check_subject(subject, self.shared.subjects)
        return self.local.peek(subject)

    async def give_back(self, subject: str, by: int) -> None:
        """Unused leased counts back: to the shared store while it answers, else only to the local window (the
        shared total then keeps them: over-counting, never under)."""
        if self._mode == "shared":
            try:
                await self.shared.give_back(subject, by)
            except CounterStoreError as exc:
                self._open(str(exc))
                timed_out = isinstance(exc, CounterStoreTimeout)  # counted under "give_back_unacked" already
            else:
                return
        else:
            timed_out = False
        kept = self.local.give_back_now(subject, by)  # what local counting made and the store has not seen
        if not timed_out:
            self._unusable("give_back_failed", by - kept)

    async def close(self) -> None:
        self._closed = True
        if self._probe is not None:
            self._probe.cancel()
            await asyncio.gather(self._probe, return_exceptions=True)
            self._probe = None
        await self.shared.close()

    def _open(self, reason: str) -> None:
        if self._mode == "local":
            return
        self._failing_since = self._clock() if self.failover_s > 0 else None
        self._switch("local", reason)
        if not self._closed and (self._probe is None or self._probe.done()):
            self._probe = asyncio.create_task(self._probe_until_shared(), name="counter-store probe")

    def _switch(self, mode: Mode, reason: str) -> None:
        self._mode = mode
        if mode == "local" and self._failing_since is not None:
            log.warning("counter store: not answering (%s); counting only what is leased for up to %g s (a "
                        "failover), then local windows; probing every %g s", reason, self.failover_s,
                        self.probe_interval_s)
        elif mode == "local":
            log.warning("counter store: local windows on (%s); probing every %g s", reason, self.probe_interval_s)
        else:
            self._failing_since = None
            log.warning("counter store: shared counting on again (%s)", reason)
        self._set_gauge()
        if self._metrics is not None:
            self._metrics.inc("counter_store_switches_total", help="switches between shared and local", to=mode)
        if self._on_switch is not None:
            try:
                self._on_switch(mode, reason)
            except Exception:
                log.exception("counter store: on_switch hook failed")

    def _set_gauge(self) -> None:
        if self._metrics is not None:
            self._metrics.set(
                "counter_store_shared",
                1.0 if self._mode == "shared" else 0.0,
                help="1 while limits are counted in the shared store, 0 while on local windows",
            )

    async def _probe_until_shared(self) -> None:
        started = time.monotonic()
        while self._mode == "local":
            await asyncio.sleep(self.probe_interval_s)
            try:
                await self.shared.ping()
            except CounterStoreError:
                continue
            except Exception:  # a bug must not leave the instance on local windows for good without a word
                log.exception("counter store: probe failed unexpectedly")
                continue
            down_s = time.monotonic() - started
            self._switch("shared", f"the store answered after {math.ceil(down_s * 1000)} ms without it")
            await self._sync_local()

    async def _sync_local(self) -> None:
        """Add what was counted locally during the outage, so the shared totals include it (over, never under)."""
        unsynced = self.local.take_unsynced()
        self._decided_locally.clear()  # what they count is added now; a late PubAck from before over-counts
        if not unsynced:
            return
        subjects = list(unsynced)
        results = await asyncio.gather(*(self.shared.incr(s, unsynced[s]) for s in subjects), return_exceptions=True)
        failed = 0
        for subject, result in zip(subjects, results, strict=True):
            if isinstance(result, BaseException):
                self.local.add_unsynced(subject, unsynced[subject])  # kept for the next time the store is back
                if isinstance(result, CounterStoreTimeout):  # it may be applied yet: then not added again
                    self._note_timed_out(self._decided_locally, subject, unsynced[subject])
                failed += 1
            else:
                self.local.observe(subject, result)
        if failed:
            self._open(f"{failed} of {len(subjects)} local counts could not be added to the store")


def counters_from_settings(
    nc: NATS,
    settings: AuthSettings,
    *,
    metrics: Metrics | None = None,
    on_switch: Callable[[Mode, str], None] | None = None,
    probe_interval_s: float = 0.5,
) -> ResilientCounters:
    """The store an auth instance uses: shared within `counter_store_timeout_ms`, local windows otherwise."""
    spec = counter_stream(settings)
    return ResilientCounters(
        JetStreamCounters.from_settings(nc, settings),
        LocalCounters(retain_seconds=float(spec.max_age_seconds or 2 * HOUR_SECONDS)),
        probe_interval_s=probe_interval_s,
        failover_s=settings.counter_failover_seconds,
        metrics=metrics,
        on_switch=on_switch,
    )
