"""Encode's adapter to the farm: the live workers (from heartbeats), offering one output to them, and cancelling jobs.

An offer goes to each live worker in turn (its own subject) until one accepts. The answer is `busy` only when every
live worker answered busy; a timeout, "no responders", a lost connection or a refused offer is never busy.

Offers and cancels go out through publishers declared on encode's broker, so its AsyncAPI document lists both
subjects with their message models (`farm.offer.{instance}`, `farm.cancel.{instance}`: one subject per worker).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from faststream.nats import NatsBroker
from faststream.nats.publisher.usecase import LogicPublisher
from nats.errors import ConnectionClosedError, NoRespondersError, OutboundBufferLimitError, StaleConnectionError
from nats.errors import TimeoutError as NatsTimeout
from pydantic import ValidationError

from services.encode import domain
from services.encode.domain import AnswerKind, FarmAnswer, WorkerView
from shared.media.protocol import (
    CANCEL_PATTERN,
    OFFER_PATTERN,
    Cancel,
    Heartbeat,
    JobKey,
    Offer,
    OfferAnswer,
    cancel_subject,
    offer_subject,
)
from shared.messaging import error_in, unreadable_reply
from shared.videos import JobClass, is_large_output

log = logging.getLogger("weir.encode.farm")

# the message never left this process: nobody can have accepted it
_NOT_SENT = (ConnectionClosedError, OutboundBufferLimitError, StaleConnectionError, NoRespondersError)


@dataclass
class Registry:
    """The workers this instance has heard from, with the monotonic time it last did."""

    timeout_seconds: float
    large_height: int  # the large_output_height setting: at most one large developer output per worker
    workers: dict[str, WorkerView] = field(default_factory=dict)
    seen: dict[str, float] = field(default_factory=dict)

    def heard(self, hb: Heartbeat) -> bool:
        """Record a heartbeat; True when it shows a worker with more room than before (new, or a slot freed)."""
        developer = sum(1 for j in hb.running if j.job_class == JobClass.DEVELOPER)
        view = WorkerView(
            name=hb.worker, instance=hb.instance, slots=hb.slots, developer_running=developer,
            first_party_running=len(hb.running) - developer,
            large_developer_running=any(self.large(j.job_class, j.output) for j in hb.running),
            leaving=hb.leaving,
        )
        before = self.workers.get(hb.instance) if self.is_live(hb.instance) else None
        self.workers[hb.instance] = view
        self.seen[hb.instance] = time.monotonic()
        if view.leaving:
            return False
        if before is None or before.leaving:
            return True
        return domain.free_developer_slots(view) > domain.free_developer_slots(before) or (
            len(hb.running) < before.developer_running + before.first_party_running
        )

    def large(self, job_class: JobClass, height: int) -> bool:
        return is_large_output(job_class, height, self.large_height)

    def remember(self, view: WorkerView, age_seconds: float) -> None:
        """A worker known from the table (this instance just started): live until its heartbeat timeout passes."""
        self.workers.setdefault(view.instance, view)
        self.seen.setdefault(view.instance, time.monotonic() - age_seconds)

    def forget(self, instance: str) -> None:
        self.workers.pop(instance, None)
        self.seen.pop(instance, None)

    def is_live(self, instance: str) -> bool:
        seen = self.seen.get(instance)
        return seen is not None and time.monotonic() - seen <= self.timeout_seconds

    def live(self) -> list[WorkerView]:
        return [w for i, w in self.workers.items() if self.is_live(i) and not w.leaving]

    def heard_recently(self) -> list[WorkerView]:
        """Live workers, leaving ones too (their running jobs still hold slots)."""
        return [w for i, w in self.workers.items() if self.is_live(i)]

    def accepted(self, instance: str, job_class: JobClass, height: int) -> None:
        view = self.workers.get(instance)
        if view is not None:
            self.workers[instance] = view.with_accepted(job_class, self.large(job_class, height))


@dataclass
class Farm:
    """The farm as encode sees it: the registry of live workers and the two subjects encode sends them."""

    offers: LogicPublisher
    cancels: LogicPublisher
    registry: Registry
    answer_timeout: float

    @classmethod
    def declare(cls, broker: NatsBroker, registry: Registry, answer_timeout: float) -> Farm:
        """The farm's publishers, declared on encode's broker (its AsyncAPI document shows them)."""
        offers = broker.publisher(
            OFFER_PATTERN, schema=Offer, title=f"{OFFER_PATTERN}:Offer",
            description="Request, to one worker (its instance id in the subject): take this output now. Replies "
                        "OfferAnswer (accepted, or busy with a reason) at once, or a validation error "
                        '`{"error": {status, code, detail}}`. No answer in time means unreachable, never busy.',
        )
        cancels = broker.publisher(
            CANCEL_PATTERN, schema=Cancel, title=f"{CANCEL_PATTERN}:Cancel",
            description="To one worker: stop these jobs, encode does not want them (deleted, failed, restarted). "
                        "Repeated while the worker's heartbeats list such a job.",
        )
        return cls(offers=offers, cancels=cancels, registry=registry, answer_timeout=answer_timeout)

    async def offer(self, offer: Offer) -> FarmAnswer:
        """Offer one output to the live workers in turn; the first that accepts has it."""
        job_class = offer.job_class
        workers = domain.offer_order(self.registry.live(), job_class, self.registry.large(job_class, offer.output))
        busy: list[str] = []
        silent = 0
        for worker in workers:
            try:
                reply = await self.offers.request(offer, subject=offer_subject(worker.instance),
                                                  timeout=self.answer_timeout)
            except _NOT_SENT:
                silent += 1  # no responders or no connection: a worker that is gone, or encode cut off; never busy
                continue
            except (TimeoutError, NatsTimeout):
                # it may have accepted, with the answer lost: offering it elsewhere could run it twice at once.
                # It stays offered (in doubt) until heartbeats settle it.
                return domain.farm_answer(busy, silent + 1, in_doubt=True)
            try:
                answer = OfferAnswer.model_validate_json(reply.body)
            except ValidationError as exc:
                # a refusal (the worker could not read the offer) or an answer encode cannot read: the worker did
                # not take it, and it did not say busy either (counted as no answer: the output stays pending)
                refused = error_in(reply.body)
                if refused is None:
                    unreadable_reply(offer_subject(worker.instance), reply.headers, exc,
                                     outcome=f"not taken by worker {worker.name}, the output stays pending")
                else:
                    log.warning("worker %s did not take an offer of %s %dp: %s", worker.name, offer.video_id,
                                offer.output, refused.error.detail[:300])
                silent += 1
                continue
            if answer.accepted:
                self.registry.accepted(worker.instance, job_class, offer.output)
                return FarmAnswer(AnswerKind.ACCEPTED, tuple(busy), worker=answer.worker, instance=answer.instance)
            busy.append(answer.worker)
        return domain.farm_answer(busy, silent, in_doubt=False)

    async def cancel(self, instance: str, jobs: list[JobKey], reason: str | None) -> None:
        """Tell one worker to stop these jobs (a core publish: a lost cancel is sent again on its next heartbeat)."""
        await self.cancels.publish(Cancel(jobs=jobs, reason=reason), subject=cancel_subject(instance))
