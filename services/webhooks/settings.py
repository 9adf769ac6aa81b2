"""The webhooks service's numbers (SPEC 13), each a `WEIR_WEBHOOK_*` variable with SPEC's default."""

from __future__ import annotations

from pydantic import Field, field_validator

from shared.settings import CommonSettings


class WebhookSettings(CommonSettings):
    webhook_retry_intervals_seconds: list[float] = Field(
        [5, 300, 1800, 7200, 18000, 36000], min_length=1, description="wait before each further attempt of a "
        "failed delivery (after the 1st attempt, the 2nd, ...); the last one repeats until the retry window ends, "
        "where one last attempt is made (JSON list, e.g. [0.05, 0.1] in tests)")
    webhook_retry_jitter_share: float = Field(0.2, ge=0, lt=1, description="each wait is drawn within this share "
                                              "either side of its interval, so that an endpoint back from an outage "
                                              "is not hit by every delivery at once")
    webhook_retry_window_seconds: float = Field(86400, gt=0, description="how long a delivery is retried, from its "
                                                "first failed attempt; then it is given up")
    webhook_disable_after_seconds: float = Field(5 * 86400, gt=0, description="an endpoint whose deliveries have "
                                                 "failed without a success for this long is disabled (and "
                                                 "`webhook.disabled` published)")
    webhook_delivery_timeout_seconds: float = Field(10, gt=0, description="the whole of one attempt (connect, "
                                                    "send, read the answer): longer is a failed attempt (SPEC 13 "
                                                    "says 10 s; issue 31's text says 30 s)")
    webhook_response_max_bytes: int = Field(64 * 1024, ge=0, description="most bytes of an endpoint's answer read "
                                            "(and kept in the delivery log); the rest is not read")
    webhook_secret_overlap_seconds: float = Field(86400, ge=0, description="after a rotation, how long the old "
                                                  "signing secret still signs beside the new one")
    webhook_secret_bytes: int = Field(32, ge=24, le=32, description="random bytes of a new signing secret "
                                      "(whsec_<base64>; Standard Webhooks asks 24 to 64)")
    webhook_deliveries_keep_seconds: float = Field(30 * 86400, gt=0, description="how long deliveries, their "
                                                   "attempts, status codes and latencies are kept")
    webhook_allow_private: bool = Field(False, description="deliver to loopback, private (RFC 1918, ULA), shared "
                                        "(100.64/10) and special-purpose addresses: development only (`weir up` "
                                        "sets it); link-local, multicast, unspecified and reserved addresses stay "
                                        "refused")
    webhook_endpoint_concurrency: int = Field(1, ge=1, description="deliveries in flight to one endpoint at once "
                                              "(other endpoints are never held up by it)")

    webhook_endpoint_claim_ahead: int = Field(1, ge=0, description="deliveries claimed for an endpoint beyond "
                                              "those in flight, each sent as soon as one in flight ends (per-video "
                                              "order kept: they are other videos'), so that the endpoint's next "
                                              "attempt does not wait for the database; a claim waiting so is held "
                                              "a delivery timeout longer")

    webhook_claim_grace_seconds: float = Field(5, gt=0, description="an attempt is claimed for the delivery timeout "
                                               "and this much more: past it, its instance is taken for dead and the "
                                               "delivery is due again (the same webhook-id)")
    webhook_scan_seconds: float = Field(1.0, gt=0, description="longest wait between two looks for due deliveries "
                                        "(new ones made here wake it at once; another instance's are seen so)")
    webhook_locked_retry_seconds: float = Field(0.01, gt=0, description="when an endpoint with deliveries due was "
                                                "locked by another instance's claim or record, look at it again "
                                                "after this long")
    webhook_max_in_flight: int = Field(256, ge=1, description="attempts under way at once in one instance, all "
                                       "endpoints together")

    webhook_order_hold_seconds: float = Field(5.0, ge=0, description="how long an encoding event of a video waits "
                                              "for the video's upload.completed (read from another stream) before "
                                              "it is delivered anyway: the cause is sent before its effects")

    webhook_order_settle_seconds: float = Field(0.0, ge=0, description="how long a new delivery waits before it "
                                                "may go (the gate below keeps the order across instances)")

    webhook_order_gate: bool = Field(False, description="for several instances: a delivery waits until the durable "
                                     "that read its event has acknowledged every message up to it, so that an "
                                     "earlier event of its video read by another instance is recorded, and goes, "
                                     "first (one instance keeps a video's events in order without it)")

    webhook_order_gate_longest_seconds: float = Field(30.0, gt=0, description="the longest a delivery waits at the "
                                                      "gate (an earlier message that keeps failing)")

    webhook_order_gate_poll_seconds: float = Field(0.02, gt=0, description="how soon the deliverer reads the ack "
                                                   "floors again while deliveries wait at the gate")

    @field_validator("webhook_retry_intervals_seconds")
    @classmethod
    def _positive(cls, intervals: list[float]) -> list[float]:
        if any(i <= 0 for i in intervals):
            raise ValueError("every retry interval must be above 0")
        return intervals
