"""The farm's messages and encode.status read tolerantly (SPEC section 11): a field a newer release adds is ignored,
and a value it adds to a closed set reads as the fallback `shared/videos.py` and the protocol name."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from shared.media.protocol import (
    Cancel,
    Heartbeat,
    JobKey,
    Offer,
    OfferAnswer,
    Outcome,
    OutputResult,
    OutputStatus,
    ProcessingStatus,
    ProcessingStatuses,
    ResultAck,
    RunningJob,
    StatusesRequest,
    StatusRequest,
)
from shared.videos import JobClass, OutputState, ProcessingState, ShownOutputState, shown_output_state

NOW = datetime(2026, 12, 3, 8, 0, tzinfo=UTC)
NEWER = {"added_by_a_newer_release": {"nested": [1, 2]}, "priority": 7}
KEY = {"video_id": "v1", "output": 720, "attempt": 2}

MESSAGES: list[BaseModel] = [
    JobKey(**KEY),
    Offer(**KEY, job_class=JobClass.FIRST_PARTY, object_key="sources/a/v1", source_height=1080),
    OfferAnswer(accepted=False, worker="media-1", instance="i1", reason="full"),
    RunningJob(**KEY, job_class=JobClass.DEVELOPER, started_at=NOW),
    Heartbeat(worker="media-1", instance="i1", slots=3, running=[RunningJob(**KEY, job_class=JobClass.DEVELOPER,
                                                                            started_at=NOW)], sent_at=NOW),
    Cancel(jobs=[JobKey(**KEY)], reason="deleted"),
    OutputResult(**KEY, worker="media-1", instance="i1", outcome=Outcome.COMPLETED, object_key="r", size=9,
                 finished_at=NOW),
    ResultAck(recorded=True, applied=False),
    StatusRequest(video_id="v1"),
    OutputStatus(height=720, state=ShownOutputState.ENCODING, worker="media-1", started_at=NOW, restarts=1),
    ProcessingStatus(video_id="v1", found=True, status=ProcessingState.PROCESSING, deadline_at=NOW,
                     outputs=[OutputStatus(height=720, state=ShownOutputState.DONE)], restarted=[720]),
    StatusesRequest(video_ids=["v1", "v2"]),  # encode.status.v2
    ProcessingStatuses(videos=[ProcessingStatus(video_id="v1", found=True, status=ProcessingState.PROCESSING,
                                                outputs=[OutputStatus(height=360, state=ShownOutputState.PENDING)]),
                               ProcessingStatus(video_id="v2", found=False)]),
]


def newer(message: BaseModel, **changed: Any) -> bytes:
    """The message as a newer release might send it: fields added at every level, some values changed."""

    def grow(value: Any) -> Any:
        if isinstance(value, dict):
            return {**{k: grow(v) for k, v in value.items()}, **NEWER}
        if isinstance(value, list):
            return [grow(v) for v in value]
        return value

    return json.dumps({**grow(message.model_dump(mode="json")), **changed}).encode()


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_farm_and_status_message_ignores_fields_it_does_not_know(message: BaseModel) -> None:
    assert type(message).model_validate_json(newer(message)) == message


def test_an_unknown_job_class_is_a_developer_job() -> None:
    offer = MESSAGES[1]
    assert Offer.model_validate_json(newer(offer, job_class="vip")).job_class is JobClass.DEVELOPER
    heartbeat = Heartbeat.model_validate_json(newer(MESSAGES[4], running=[
        {**KEY, "job_class": "vip", "started_at": NOW.isoformat()}]))
    assert [j.job_class for j in heartbeat.running] == [JobClass.DEVELOPER]
    for known in JobClass:
        assert Offer.model_validate_json(newer(offer, job_class=known.value)).job_class is known


def test_an_unknown_outcome_counts_as_failed() -> None:
    result = MESSAGES[6]
    assert OutputResult.model_validate_json(newer(result, outcome="transcoded_elsewhere")).outcome is Outcome.FAILED
    for known in Outcome:
        assert OutputResult.model_validate_json(newer(result, outcome=known.value)).outcome is known


def test_an_unknown_output_state_shows_as_pending_and_an_unknown_processing_state_as_none() -> None:
    status = ProcessingStatus.model_validate_json(newer(MESSAGES[10], status="paused", outputs=[
        {"height": 720, "state": "throttled", "eta_seconds": 3}]))
    assert status.status is None  # the api then shows its own status
    assert [o.state for o in status.outputs] == [ShownOutputState.PENDING]  # not done: no rendition yet
    for state in ShownOutputState:
        assert OutputStatus.model_validate({"height": 1, "state": state.value}).state is state
    for processing in ProcessingState:
        assert ProcessingStatus.model_validate({"video_id": "v", "found": True, "status": processing.value}
                                               ).status is processing


@pytest.mark.parametrize(("model", "body"), [
    (Offer, {**KEY, "job_class": 7, "object_key": "k"}),
    (OutputResult, {**KEY, "worker": "w", "instance": "i", "outcome": None, "finished_at": NOW.isoformat()}),
    (OutputStatus, {"height": 1, "state": ["done"]}),
])
def test_a_value_that_is_no_string_is_still_refused(model: type[BaseModel], body: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):  # the fallbacks are for a newer release's words, not for garbage
        model.model_validate(body)


def test_what_status_requests_show_of_each_stored_output_state() -> None:
    shown = {state: shown_output_state(state) for state in OutputState}
    assert shown == {OutputState.PENDING: ShownOutputState.PENDING, OutputState.OFFERED: ShownOutputState.PENDING,
                     OutputState.ENCODING: ShownOutputState.ENCODING, OutputState.DONE: ShownOutputState.DONE,
                     OutputState.CANCELLED: ShownOutputState.CANCELLED}


def test_the_api_and_encode_read_one_setting_for_the_videos_per_v2_request() -> None:
    """WEIR_STATUS_MAX_VIDEOS: what the api asks at most per encode.status.v2 request, and what encode answers."""
    from services.api.settings import ApiSettings
    from services.encode.settings import EncodeSettings

    api, encode = ApiSettings.model_fields["status_max_videos"], EncodeSettings.model_fields["status_max_videos"]
    assert api.default == encode.default
