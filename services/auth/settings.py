from __future__ import annotations

from pydantic import Field, SecretStr

from shared.settings import ShedSettings


class AuthSettings(ShedSettings):
    limit_address_per_minute: int = Field(
        300, description="requests per client address not carried by a trusted identity"
    )
    limit_auth_failure_per_minute: int = Field(30, description="rejected credentials per client address")
    limit_key_per_minute: int = Field(300, description="requests per accepted secret key")
    limit_owner_per_minute: int = Field(1200, description="requests per account, all secret keys together")
    limit_upload_token_per_minute: int = Field(1200, description="requests per valid upload token")
    limit_app_create_per_hour: int = Field(10, description="app creations per user")
    limit_key_rotate_per_hour: int = Field(10, description="key rotations per user")
    limit_window_seconds: int = Field(60, description="length of the minute rules' window")
    counter_store_timeout_ms: int = Field(25, description="budget for the shared counter store before local fallback")
    counter_store_late_ack_ms: int = Field(
        5000, ge=0, description="after an increment's budget ran out, how long its PubAck is still awaited: an "
        "increment the store applied late still owns its counts: those of requests answered 503 (a failover) go to "
        "the instance's lease instead of being lost, and those decided on local windows are not added again when the "
        "store is back (a slow store would otherwise refuse below the limit); 0: not awaited")
    counter_store_failover_ms: int = Field(
        0, ge=0, description="after the shared store stops answering, how long limits stay exact before local "
        "windows take over: only counts already leased are spent, and past them a request answers 503 `unavailable` "
        "with Retry-After, so that a replicated store's leader election (4-9 s in NATS) is waited out without "
        "over-admitting. 0 (the default): local windows at once, as SPEC 3 says, so that losing a NATS node fails "
        "no request (SPEC 15); each instance then goes on from the last total it saw")

    @property
    def counter_failover_seconds(self) -> float:
        return self.counter_store_failover_ms / 1000

    throttled_window_seconds: int = Field(
        60, ge=1, description="who is throttled: 429s are tallied per window of this length (clock-aligned), for "
        "`weir status`'s most refused callers")
    throttled_windows: int = Field(
        5, ge=1, description="who is throttled: how many windows, the current one included, `GET /throttled` sums")
    throttled_capacity: int = Field(
        64, ge=1, description="who is throttled: callers held per window (space-saving counters: a flood of callers "
        "costs no more memory, and any caller refused more than 1/capacity of a window's 429s is held)")
    upload_token_ttl_seconds: int = Field(3600, description="lifetime of an upload token")
    key_cache_seconds: float = Field(30, description="how long a key lookup is cached (key.revoked empties it at once)")
    check_concurrency: int = Field(256, description="auth.check requests handled at once per instance")
    manage_concurrency: int = Field(
        16, ge=1, description="management requests (auth.manage.<op>) handled at once per operation and instance"
    )
    trusted_proxies: str = Field("", description="comma-separated addresses/CIDRs whose X-Forwarded-For is read")
    key_hash_secret: SecretStr = Field(SecretStr(""), description="server secret for the keyed hash of keys")
    upload_token_secret: SecretStr = Field(SecretStr(""), description="HMAC secret that signs upload tokens")
    block_recheck_ms: int = Field(
        250, ge=0, description="how long a reading of an address's auth_failure counter that found room is trusted"
        " before a request from that address reads it again (0: every batch reads it)"
    )
    recent_key_share_seconds: float = Field(
        5, gt=0, description="how often an instance records again that it lets a recently accepted key through an"
        " address's auth_failure block (the shared record that carries the exception to every instance)"
    )
    counter_lease_max: int = Field(
        256, ge=1, description="most counts an instance takes ahead from a shared counter at once (1: no leases)"
    )
    counter_lease_fraction: int = Field(
        8, ge=1, description="a lease takes at most this fraction of what is left of a budget"
    )
    counter_lease_idle_ms: int = Field(
        500, ge=1, description="unused leased counts go back to the shared counter after this long unused"
    )
