"""The rules for a request whose NATS connection drops (SPEC 15), without a server: which waiting requests lost
their reply at a reconnect and are sent once more (`lost_in_reconnect`), and how long after the edge saw its
connection go away a new check still waits for the next one (`sends_while_reconnecting`)."""

from __future__ import annotations

import pytest

from services.api.settings import ApiSettings
from shared.authclient import sends_while_reconnecting
from shared.natsconn import lost_in_reconnect

BUDGET = ApiSettings().auth_timeout_ms / 1000


@pytest.mark.parametrize(("sent_on", "reconnects", "retried", "lost"), [
    (0, 1, False, True),  # went out on the first connection, which dropped (or was made while it was being
    # made again: nats-py may still have written it to the dead socket): sent again
    (0, 3, False, True),  # several reconnects since: still lost
    (1, 1, False, False),  # went out on the current connection
    (2, 1, False, False),  # a later connection than the reconnect being handled: not its loss
    (0, 1, True, False),  # already sent again once: never a third time
    (1, 2, True, False),  # its second sending was lost too: it waits out its deadline
])
def test_a_request_is_lost_only_with_the_connection_it_went_out_on(sent_on: int, reconnects: int, retried: bool,
                                                                  lost: bool) -> None:
    assert lost_in_reconnect(sent_on, reconnects, retried) is lost


def test_checks_wait_for_the_next_connection_only_within_one_budget_of_seeing_it_gone() -> None:
    down = 100.0
    assert sends_while_reconnecting(down, down, BUDGET)
    assert sends_while_reconnecting(down, down + BUDGET * 0.99, BUDGET)
    assert not sends_while_reconnecting(down, down + BUDGET, BUDGET)  # NATS stays away: fail at once, not wait
    assert not sends_while_reconnecting(down, down + 10 * BUDGET, BUDGET)
