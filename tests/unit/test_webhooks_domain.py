"""The webhooks service's decisions without a server (SPEC 13): the retry schedule, what an attempt's outcome means
for the delivery and the endpoint, per-video order, subscriptions, and the secrets that sign."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.webhooks.domain import (
    ALL_EVENTS,
    CAUSED_BY_SOURCE,
    GATED,
    SUBSCRIBABLE,
    WEBHOOK_DISABLED,
    AttemptDecision,
    AttemptError,
    AttemptResult,
    DeliveryState,
    DisableReason,
    Endpoint,
    EndpointSecrets,
    GiveUp,
    InvalidSubscription,
    Outcome,
    PendingDelivery,
    RetryPolicy,
    attempt_decision,
    deliverable,
    endpoints_for,
    first_due,
    gate_released,
    judge_attempt,
    next_attempt,
    next_due,
    rotate_secret,
    signing_secrets,
    subscribed,
    validate_subscription,
)
from services.webhooks.settings import WebhookSettings
from shared.contracts import PUBLIC_EVENTS
from shared.events import CATALOG

SETTINGS = WebhookSettings()
POLICY = RetryPolicy.from_settings(SETTINGS)
WINDOW = timedelta(seconds=SETTINGS.webhook_retry_window_seconds)
DISABLE_AFTER = timedelta(seconds=SETTINGS.webhook_disable_after_seconds)
OVERLAP = timedelta(seconds=SETTINGS.webhook_secret_overlap_seconds)
JITTER = SETTINGS.webhook_retry_jitter_share
T0 = datetime(2026, 12, 4, 9, 0, tzinfo=UTC)
MIDDLE = 0.5  # the draw that moves a wait neither way
SECOND = timedelta(seconds=1)


def s(seconds: float) -> timedelta:
    return timedelta(seconds=seconds)


# ------------------------------------------------------------------------------------------------ the settings


def test_the_defaults_are_spec_13s_numbers() -> None:
    assert SETTINGS.webhook_retry_intervals_seconds == [5, 5 * 60, 30 * 60, 2 * 3600, 5 * 3600, 10 * 3600]
    assert SETTINGS.webhook_retry_window_seconds == 24 * 3600
    assert SETTINGS.webhook_disable_after_seconds == 5 * 86400
    assert SETTINGS.webhook_delivery_timeout_seconds == 10
    assert SETTINGS.webhook_response_max_bytes == 64 * 1024
    assert SETTINGS.webhook_secret_overlap_seconds == 24 * 3600
    assert SETTINGS.webhook_deliveries_keep_seconds == 30 * 86400
    assert SETTINGS.webhook_allow_private is False
    assert SETTINGS.webhook_endpoint_concurrency == 1


def test_every_setting_says_what_it_is() -> None:
    for name, info in WebhookSettings.model_fields.items():
        if name.startswith("webhook_"):
            assert info.description, name


def test_allow_private_and_the_intervals_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WEIR_WEBHOOK_ALLOW_PRIVATE", "1")
    monkeypatch.setenv("WEIR_WEBHOOK_RETRY_INTERVALS_SECONDS", "[0.05, 0.1]")
    settings = WebhookSettings()
    assert settings.webhook_allow_private is True
    assert RetryPolicy.from_settings(settings).intervals == (s(0.05), s(0.1))


@pytest.mark.parametrize("values", [
    {"webhook_retry_intervals_seconds": []},
    {"webhook_retry_intervals_seconds": [5, 0]},
    {"webhook_retry_jitter_share": 1},
    {"webhook_retry_jitter_share": -0.1},
    {"webhook_secret_bytes": 16},
])
def test_settings_refuse_numbers_the_schedule_cannot_use(values: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        WebhookSettings.model_validate(values)


@pytest.mark.parametrize("kwargs", [
    {"intervals": ()},
    {"intervals": (s(5), s(0))},
    {"jitter_share": 1.0},
    {"jitter_share": -0.01},
])
def test_a_policy_refuses_what_could_retry_at_once_or_never(kwargs: dict[str, object]) -> None:
    base: dict[str, object] = {"intervals": POLICY.intervals, "jitter_share": JITTER, "window": WINDOW}
    with pytest.raises(ValueError):
        RetryPolicy(**{**base, **kwargs})  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------ the schedule


def schedule(policy: RetryPolicy, draws: list[float], first: datetime = T0) -> list[datetime]:
    """The times of every attempt of a delivery that always fails, its first at `first`."""
    times, now, attempt = [first], first, 1
    while not isinstance(after := next_attempt(policy, attempt=attempt, first_failure=first, now=now,
                                               draw=draws[(attempt - 1) % len(draws)]), GiveUp):
        assert after >= now
        times.append(after)
        now, attempt = after, attempt + 1
    return times


def test_without_jitter_the_attempts_follow_the_intervals_then_one_last_at_the_windows_end() -> None:
    times = schedule(POLICY, [MIDDLE])
    expected = [T0]
    for interval in POLICY.intervals:
        expected.append(expected[-1] + interval)
    while expected[-1] + POLICY.intervals[-1] < T0 + WINDOW:  # the last interval again while it fits
        expected.append(expected[-1] + POLICY.intervals[-1])
    expected.append(T0 + WINDOW)
    assert times == expected


def test_the_first_retry_is_seconds_away_and_the_last_attempt_is_at_the_windows_end() -> None:
    times = schedule(POLICY, [MIDDLE])
    assert times[1] - times[0] == POLICY.intervals[0]
    assert times[-1] == T0 + WINDOW
    assert len(times) == len(set(times))


def test_an_attempt_failing_at_or_past_the_windows_end_is_the_last() -> None:
    for now in (T0 + WINDOW, T0 + WINDOW + SECOND, T0 + 10 * WINDOW):
        assert next_attempt(POLICY, attempt=3, first_failure=T0, now=now, draw=MIDDLE) == GiveUp()


def test_a_wait_ending_past_the_window_is_cut_to_its_end() -> None:
    now = T0 + WINDOW - SECOND
    assert next_attempt(POLICY, attempt=1, first_failure=T0, now=now, draw=MIDDLE) == T0 + WINDOW


def test_past_the_list_the_last_interval_repeats() -> None:
    last = POLICY.intervals[-1]
    for attempt in (len(POLICY.intervals), len(POLICY.intervals) + 1, 1000):
        assert POLICY.interval_after(attempt) == last


@pytest.mark.parametrize(("draw", "factor"), [(0.0, 1 - JITTER), (MIDDLE, 1.0)])
def test_the_draw_moves_the_wait_within_the_share(draw: float, factor: float) -> None:
    for attempt, interval in enumerate(POLICY.intervals[:3], start=1):
        after = next_attempt(POLICY, attempt=attempt, first_failure=T0, now=T0, draw=draw)
        assert after == T0 + interval * factor


@pytest.mark.parametrize("draw", [-0.1, 1.0, 2.0])
def test_a_draw_outside_the_unit_interval_is_a_bug(draw: float) -> None:
    with pytest.raises(ValueError):
        next_attempt(POLICY, attempt=1, first_failure=T0, now=T0, draw=draw)


def test_attempts_count_from_one() -> None:
    with pytest.raises(ValueError):
        next_attempt(POLICY, attempt=0, first_failure=T0, now=T0, draw=MIDDLE)


def test_shrunk_settings_shrink_the_schedule() -> None:
    shrunk = WebhookSettings.model_validate({"webhook_retry_intervals_seconds": [0.05, 0.1],
                                             "webhook_retry_window_seconds": 0.5, "webhook_retry_jitter_share": 0})
    times = schedule(RetryPolicy.from_settings(shrunk), [MIDDLE])
    assert [t - T0 for t in times] == [s(0), s(0.05), s(0.15), s(0.25), s(0.35), s(0.45), s(0.5)]


@given(attempt=st.integers(1, 50), draw=st.floats(0, 1, exclude_max=True),
       elapsed=st.floats(0, 2 * 86400), jitter=st.floats(0, 0.99))
def test_any_next_attempt_is_after_now_within_the_jitter_and_never_past_the_window(
        attempt: int, draw: float, elapsed: float, jitter: float) -> None:
    policy = RetryPolicy(POLICY.intervals, jitter, WINDOW)
    now = T0 + s(elapsed)
    after = next_attempt(policy, attempt=attempt, first_failure=T0, now=now, draw=draw)
    if now >= T0 + WINDOW:
        assert after == GiveUp()
        return
    assert isinstance(after, datetime)
    assert now < after <= T0 + WINDOW
    interval = policy.interval_after(attempt)
    low, high = interval * (1 - jitter), interval * (1 + jitter)
    assert after == T0 + WINDOW or low - SECOND / 1000 <= after - now <= high + SECOND / 1000


@given(st.lists(st.floats(0, 1, exclude_max=True), min_size=1, max_size=20))
def test_any_schedule_rises_ends_at_the_windows_end_and_then_gives_up(draws: list[float]) -> None:
    times = schedule(POLICY, draws)
    assert times == sorted(times) and len(times) == len(set(times))
    assert times[-1] == T0 + WINDOW
    # the jitter never adds or drops more than the attempt or two the window's edge decides
    assert abs(len(times) - len(schedule(POLICY, [MIDDLE]))) <= 2


# ------------------------------------------------------------------------------------------ what an outcome means

ERRORS = list(AttemptError)


@pytest.mark.parametrize("status", range(100, 600))
def test_only_2xx_delivers_and_only_410_is_gone(status: int) -> None:
    expected = Outcome.DELIVERED if 200 <= status <= 299 else Outcome.GONE if status == 410 else Outcome.FAILED
    assert judge_attempt(AttemptResult(status=status)) is expected


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
def test_a_redirect_is_a_failure_since_none_is_followed(status: int) -> None:
    assert judge_attempt(AttemptResult(status=status)) is Outcome.FAILED


@pytest.mark.parametrize("error", ERRORS)
def test_every_error_is_a_failure_to_retry(error: AttemptError) -> None:
    assert judge_attempt(AttemptResult(error=error)) is Outcome.FAILED


def test_an_attempt_has_a_status_or_an_error() -> None:
    with pytest.raises(ValueError):
        AttemptResult()
    with pytest.raises(ValueError):
        AttemptResult(status=500, error=AttemptError.TIMEOUT)


def decide(result: AttemptResult, *, now: datetime, attempt: int = 1, first_failure: datetime | None = None,
           failing_since: datetime | None = None) -> AttemptDecision:
    return attempt_decision(result, POLICY, attempt=attempt, first_failure=first_failure,
                            endpoint_failing_since=failing_since, disable_after=DISABLE_AFTER, now=now, draw=MIDDLE)


OK, GONE, DOWN = AttemptResult(status=204), AttemptResult(status=410), AttemptResult(status=503)
FAILURES = [DOWN, AttemptResult(status=302), *(AttemptResult(error=e) for e in ERRORS)]


def test_a_success_delivers_and_makes_the_endpoint_healthy() -> None:
    decision = decide(OK, now=T0 + s(10), attempt=2, first_failure=T0, failing_since=T0 - s(3600))
    assert decision == AttemptDecision(DeliveryState.DELIVERED, None, T0, endpoint_failing_since=None)


@pytest.mark.parametrize("result", FAILURES)
def test_a_first_failure_schedules_the_first_retry_and_marks_the_endpoint_failing(result: AttemptResult) -> None:
    decision = decide(result, now=T0)
    assert decision == AttemptDecision(DeliveryState.PENDING, T0 + POLICY.intervals[0], T0, T0)


def test_a_later_failure_keeps_when_the_delivery_and_the_endpoint_began_failing() -> None:
    now = T0 + s(3600)
    decision = decide(DOWN, now=now, attempt=4, first_failure=T0, failing_since=T0 - s(60))
    assert decision == AttemptDecision(DeliveryState.PENDING, now + POLICY.intervals[3], T0, T0 - s(60))


def test_410_disables_the_endpoint_at_once_and_gives_the_delivery_up() -> None:
    decision = decide(GONE, now=T0)
    assert decision == AttemptDecision(DeliveryState.FAILED, None, T0, T0, DisableReason.GONE)
    healthy_before = decide(GONE, now=T0, attempt=3, first_failure=T0 - s(60), failing_since=None)
    assert healthy_before.disable is DisableReason.GONE and healthy_before.endpoint_failing_since == T0


def test_a_failure_past_the_window_gives_up_without_disabling() -> None:
    now = T0 + WINDOW
    decision = decide(DOWN, now=now, attempt=9, first_failure=T0, failing_since=T0)
    assert decision == AttemptDecision(DeliveryState.FAILED, None, T0, T0)


@pytest.mark.parametrize("result", FAILURES)
def test_failing_for_the_disable_period_disables_the_endpoint(result: AttemptResult) -> None:
    since = T0 - DISABLE_AFTER
    decision = decide(result, now=T0, attempt=2, first_failure=T0 - s(5), failing_since=since)
    assert decision == AttemptDecision(DeliveryState.FAILED, None, T0 - s(5), since, DisableReason.FAILING)


def test_failing_a_moment_less_than_the_disable_period_does_not_disable() -> None:
    decision = decide(DOWN, now=T0, failing_since=T0 - DISABLE_AFTER + SECOND)
    assert decision.disable is None and decision.state is DeliveryState.PENDING


def test_one_success_a_day_keeps_an_endpoint_enabled_for_ever() -> None:
    failing_since: datetime | None = None
    for day in range(3 * DISABLE_AFTER.days):
        now = T0 + timedelta(days=day)
        result = OK if day % 2 else DOWN
        decision = decide(result, now=now, failing_since=failing_since)
        assert decision.disable is None
        failing_since = decision.endpoint_failing_since


def test_an_endpoint_that_never_answers_is_disabled_after_the_period_and_not_before() -> None:
    """New events every hour, each failing every attempt: the endpoint is disabled at its first failure on or after
    the period's end, and never a failure earlier."""
    failing_since: datetime | None = None
    now = T0
    while True:
        decision = decide(DOWN, now=now, failing_since=failing_since)
        failing_since = decision.endpoint_failing_since
        if decision.disable is not None:
            break
        now += s(3600)
    assert decision.disable is DisableReason.FAILING
    assert now == T0 + DISABLE_AFTER


# ----------------------------------------------------------------------------------------------- per-video order

PENDING, DELIVERED, FAILED = DeliveryState.PENDING, DeliveryState.DELIVERED, DeliveryState.FAILED


def d(event_id: str, video: str | None, minute: int, state: DeliveryState = PENDING,
      due_minute: int = 0) -> PendingDelivery:
    return PendingDelivery(event_id, video, T0 + s(60 * minute), state, T0 + s(60 * due_minute))


def ids(deliveries: list[PendingDelivery]) -> list[str]:
    return [x.event_id for x in deliveries]


def test_a_later_event_of_a_video_waits_for_the_earlier_even_when_due_first() -> None:
    earlier, later = d("e1", "v1", 1, due_minute=30), d("e2", "v1", 2, due_minute=0)
    assert ids(deliverable([later, earlier], T0)) == []
    assert ids(deliverable([later, earlier], T0 + s(60 * 30))) == ["e1"]


@pytest.mark.parametrize("done", [DELIVERED, FAILED])
def test_once_the_earlier_is_delivered_or_given_up_the_next_goes(done: DeliveryState) -> None:
    assert ids(deliverable([d("e1", "v1", 1, done), d("e2", "v1", 2), d("e3", "v1", 3)], T0)) == ["e2"]


def test_events_without_a_video_and_other_videos_go_independently_oldest_first() -> None:
    deliveries = [d("v1-b", "v1", 5), d("a", None, 4), d("v2-a", "v2", 3), d("v1-a", "v1", 2, due_minute=60),
                  d("b", None, 1), d("c", None, 6, due_minute=60)]
    assert ids(deliverable(deliveries, T0)) == ["b", "v2-a", "a"]


def test_events_at_the_same_time_are_ordered_by_their_time_ordered_ids() -> None:
    first = PendingDelivery("0190-a", "v1", T0, PENDING, T0)
    second = PendingDelivery("0190-b", "v1", T0, PENDING, T0)
    assert ids(deliverable([second, first], T0)) == ["0190-a"]


def test_next_due_is_the_earliest_future_time_of_a_head_not_of_a_blocked_event() -> None:
    deliveries = [d("e1", "v1", 1, due_minute=30), d("e2", "v1", 2, due_minute=5), d("x", None, 3, due_minute=45),
                  d("y", None, 4, DELIVERED, due_minute=10)]
    assert next_due(deliveries, T0) == T0 + s(60 * 30)
    assert next_due(deliveries, T0 + s(60 * 30)) == T0 + s(60 * 45)
    assert next_due([d("z", None, 1)], T0) is None


DELIVERIES = st.lists(
    st.builds(d, event_id=st.uuids().map(str), video=st.sampled_from([None, "v1", "v2", "v3"]),
              minute=st.integers(0, 20), state=st.sampled_from(list(DeliveryState)), due_minute=st.integers(0, 20)),
    max_size=30, unique_by=lambda x: x.event_id)


@given(DELIVERIES, st.integers(0, 20))
def test_any_endpoints_deliveries_keep_the_order_rule(deliveries: list[PendingDelivery], minute: int) -> None:
    now = T0 + s(60 * minute)
    chosen = deliverable(deliveries, now)
    assert chosen == sorted(chosen, key=lambda x: x.order)
    videos = [x.video_id for x in chosen if x.video_id is not None]
    assert len(videos) == len(set(videos))  # at most one delivery of a video at a time
    for x in chosen:
        assert x.state is PENDING and x.due_at <= now
        assert not any(y.video_id == x.video_id and y.state is PENDING and y.order < x.order
                       for y in deliveries if x.video_id is not None)
    alone_due = {y.event_id for y in deliveries if y.video_id is None and y.state is PENDING and y.due_at <= now}
    assert alone_due <= set(ids(chosen))
    due = next_due(deliveries, now)
    assert due is None or due > now


# -------------------------------------------------------------------------------------------------- subscriptions


def test_the_subscribable_types_are_the_public_events_and_the_services_own() -> None:
    assert SUBSCRIBABLE == PUBLIC_EVENTS | {WEBHOOK_DISABLED}
    assert PUBLIC_EVENTS <= set(CATALOG)
    assert "credential.rejected" not in SUBSCRIBABLE and "key.created" not in SUBSCRIBABLE


@pytest.mark.parametrize("events", [["video.created"], ["*"], ["video.*"], ["encode.*", "upload.completed"],
                                    ["webhook.disabled"], sorted(SUBSCRIBABLE)])
def test_exact_types_all_and_prefix_wildcards_are_accepted(events: list[str]) -> None:
    assert validate_subscription(events) == tuple(sorted(set(events)))


@pytest.mark.parametrize(("entry", "why"), [
    ("video.create", "not an event type"),  # a typo fails now, not by never delivering
    ("credential.rejected", "not an event type"),  # internal
    ("key.created", "not an event type"),
    ("foo.*", "no event type has this prefix"),
    ("vid.*", "no event type has this prefix"),  # a prefix is whole segments
    (".*", "no event type has this prefix"),
    ("*.completed", "a wildcard is only"),
    ("video.*.x", "a wildcard is only"),
    ("vid*", "a wildcard is only"),
    ("**", "a wildcard is only"),
    ("", "not an event type"),
])
def test_entries_that_match_no_type_are_refused(entry: str, why: str) -> None:
    with pytest.raises(InvalidSubscription) as caught:
        validate_subscription(["video.created", entry])
    assert caught.value.entry == entry and why in caught.value.reason


def test_an_empty_list_is_refused_say_star_for_everything() -> None:
    with pytest.raises(InvalidSubscription):
        validate_subscription([])


def test_repeats_are_dropped_and_the_list_sorted() -> None:
    assert validate_subscription(["video.deleted", "video.created", "video.deleted"]) == \
        ("video.created", "video.deleted")


@pytest.mark.parametrize("event_type", sorted(SUBSCRIBABLE))
def test_every_type_reaches_star_its_prefix_and_its_own_name_only(event_type: str) -> None:
    prefix = event_type.split(".")[0] + ".*"
    assert subscribed([ALL_EVENTS], event_type)
    assert subscribed([prefix], event_type)
    assert subscribed([event_type], event_type)
    assert not subscribed(sorted(SUBSCRIBABLE - {event_type}), event_type)


def test_a_prefix_wildcard_matches_whole_segments_and_types_added_later() -> None:
    assert subscribed(["video.*"], "video.transcribed")  # a type the catalog gains later
    assert not subscribed(["video.*"], "videos.created")
    assert not subscribed(["video.*"], "video")
    assert subscribed(["*"], "anything.new")


def test_an_event_goes_to_the_enabled_endpoints_of_its_app_that_subscribe() -> None:
    endpoints = [
        Endpoint("all", "app1", ("*",)),
        Endpoint("videos", "app1", ("video.*",)),
        Endpoint("encodes", "app1", ("encode.completed",)),
        Endpoint("disabled", "app1", ("*",), enabled=False),
        Endpoint("other-app", "app2", ("*",)),
    ]
    assert endpoints_for("video.created", "app1", endpoints) == ["all", "videos"]
    assert endpoints_for("encode.completed", "app1", endpoints) == ["all", "encodes"]
    assert endpoints_for("encode.failed", "app2", endpoints) == ["other-app"]
    assert endpoints_for("video.created", "app3", endpoints) == []


# ------------------------------------------------------------------------------------------------ secret rotation


def test_a_new_endpoint_signs_with_its_one_secret() -> None:
    assert signing_secrets(EndpointSecrets("whsec_a"), T0) == ("whsec_a",)


def test_after_a_rotation_the_old_secret_signs_beside_the_new_until_the_overlap_ends() -> None:
    rotated = rotate_secret(EndpointSecrets("whsec_a"), "whsec_b", now=T0, overlap=OVERLAP)
    assert signing_secrets(rotated, T0) == ("whsec_b", "whsec_a")
    assert signing_secrets(rotated, T0 + OVERLAP - SECOND) == ("whsec_b", "whsec_a")
    assert signing_secrets(rotated, T0 + OVERLAP) == ("whsec_b",)


def test_a_second_rotation_within_the_overlap_keeps_the_first_secrets_own_end() -> None:
    once = rotate_secret(EndpointSecrets("whsec_a"), "whsec_b", now=T0, overlap=OVERLAP)
    twice = rotate_secret(once, "whsec_c", now=T0 + s(3600), overlap=OVERLAP)
    assert signing_secrets(twice, T0 + s(3600)) == ("whsec_c", "whsec_b", "whsec_a")
    assert signing_secrets(twice, T0 + OVERLAP) == ("whsec_c", "whsec_b")
    assert signing_secrets(twice, T0 + OVERLAP + s(3600)) == ("whsec_c",)


def test_a_rotation_drops_the_secrets_past_their_end() -> None:
    once = rotate_secret(EndpointSecrets("whsec_a"), "whsec_b", now=T0, overlap=OVERLAP)
    later = rotate_secret(once, "whsec_c", now=T0 + OVERLAP, overlap=OVERLAP)
    assert later == EndpointSecrets("whsec_c", (("whsec_b", T0 + 2 * OVERLAP),))


def test_with_no_overlap_only_the_new_secret_signs() -> None:
    rotated = rotate_secret(EndpointSecrets("whsec_a"), "whsec_b", now=T0, overlap=timedelta(0))
    assert signing_secrets(rotated, T0) == ("whsec_b",)


# ------------------------------------------------------------------------------------------- causes before effects


@pytest.mark.parametrize("event_type", sorted(PUBLIC_EVENTS | {WEBHOOK_DISABLED}))
@pytest.mark.parametrize("source_seen", [True, False])
def test_only_an_encoding_event_before_its_source_waits_and_only_for_the_hold(event_type: str,
                                                                              source_seen: bool) -> None:
    hold = timedelta(seconds=WebhookSettings().webhook_order_hold_seconds)
    due = first_due(event_type, source_seen=source_seen, now=T0, hold=hold)
    waits = event_type.startswith("encode.") and not source_seen
    assert due == (T0 + hold if waits else T0)


def test_every_event_caused_by_the_source_is_a_public_encoding_event() -> None:
    assert CAUSED_BY_SOURCE == {t for t in PUBLIC_EVENTS if t.startswith("encode.")}


@pytest.mark.parametrize("source_seen", [True, False])
@pytest.mark.parametrize("event_type", ["video.created", "encode.started"])
def test_with_several_instances_every_new_delivery_settles_first(event_type: str, source_seen: bool) -> None:
    hold, settle = timedelta(seconds=5), timedelta(seconds=0.25)
    due = first_due(event_type, source_seen=source_seen, now=T0, hold=hold, settle=settle)
    assert due == T0 + (hold if event_type.startswith("encode.") and not source_seen else settle)
    assert first_due(event_type, source_seen=source_seen, now=T0, hold=settle / 2, settle=settle) == T0 + settle


# ------------------------------------------------------------------------------------------ the order gate

GATE_LONGEST = timedelta(seconds=30)


@pytest.mark.parametrize("floor", [None, 0, 9, 10, 11])
@pytest.mark.parametrize("waited", [timedelta(0), GATE_LONGEST - timedelta(microseconds=1), GATE_LONGEST,
                                    GATE_LONGEST * 2])
def test_a_delivery_passes_the_gate_once_its_durable_acknowledged_its_event_or_it_waited_the_longest(
        floor: int | None, waited: timedelta) -> None:
    seq, due = 10, datetime(2026, 12, 8, tzinfo=UTC)
    passes = gate_released(seq, floor=floor, gated_due_at=due, now=due + waited, longest=GATE_LONGEST)
    assert passes is ((floor is not None and floor >= seq) or waited >= GATE_LONGEST)


def test_a_gated_delivery_is_a_head_that_is_never_due_on_its_own() -> None:
    assert GATED > datetime(9000, 1, 1, tzinfo=UTC)
