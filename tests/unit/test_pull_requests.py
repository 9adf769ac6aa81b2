"""shared.pull.Requests: which pull requests are open on the server and when to ask for more (pure)."""

from __future__ import annotations

import itertools

import pytest

from shared.pull import Requests

BATCH, WAIT = 8, 1.0


def test_the_first_turn_asks_for_a_batch_and_no_more_until_half_of_it_came() -> None:
    r = Requests(BATCH, WAIT)
    assert r.top_up(0.0) == BATCH
    for came in range(1, BATCH + 1):
        r.message()
        asked = r.top_up(0.0)
        owed_before = BATCH - came
        assert asked == (BATCH - owed_before if owed_before <= BATCH // 2 else 0), came
        if asked:
            break
    assert r.owed == BATCH


@pytest.mark.parametrize("batch", [1, 2, 3, 8, 64])
def test_never_more_than_a_batch_owed_whatever_comes(batch: int) -> None:
    """Every sequence of messages, ends and turns keeps what is owed within one batch, and a turn with half a batch
    or less owed always asks."""
    for steps in itertools.product(("message", "ended", "turn"), repeat=6):
        r = Requests(batch, WAIT)
        r.top_up(0.0)
        for step in steps:
            if step == "message":
                r.message()
            elif step == "ended":
                r.ended()
            else:
                owed = r.owed
                asked = r.top_up(0.0)
                assert asked == (batch - owed if owed <= batch // 2 else 0)
            assert 0 <= r.owed <= batch


def test_a_message_fills_the_oldest_request_and_an_end_is_the_oldest_s() -> None:
    r = Requests(BATCH, WAIT)
    r.top_up(0.0)  # 8
    for _ in range(5):
        r.message()  # the first owes 3
    assert r.top_up(0.1) == 5  # a second request, of 5
    assert [q.owed for q in r.open] == [3, 5]
    r.ended()  # the first expired with 3 unsent
    assert [q.owed for q in r.open] == [5]
    for _ in range(5):
        r.message()
    assert not r.open


def test_a_request_whose_end_never_came_is_forgotten_after_its_expiry_and_a_grace() -> None:
    r = Requests(BATCH, WAIT)
    r.top_up(0.0)
    gone = r.open[0].gone_at
    assert gone > WAIT
    assert r.next_check(0.0) == gone
    r.forget(gone - 0.001)
    assert r.open
    assert r.top_up(gone) == BATCH  # forgotten at its time, and asked for again
    assert [q.gone_at for q in r.open] == [pytest.approx(2 * gone)]  # each request: its time, the same span


def test_nothing_open_checks_again_after_the_wait_and_a_request_not_sent_is_withdrawn() -> None:
    r = Requests(BATCH, WAIT)
    assert r.next_check(5.0) == WAIT
    r.top_up(5.0)
    r.withdraw()
    assert not r.open and r.owed == 0
    r.message()
    r.ended()
    r.withdraw()  # nothing open: nothing happens
    assert not r.open


def test_a_new_connection_counts_on_nothing_the_old_one_asked_for() -> None:
    r = Requests(BATCH, WAIT)
    r.top_up(0.0)
    r.reset()
    assert not r.open and r.top_up(0.0) == BATCH
