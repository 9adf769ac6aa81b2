-- When any auth instance last accepted a secret key from a client address, so that the `auth_failure` block's
-- exception ("a key accepted from that address within the last minute still gets through") holds on every
-- instance, including one started after the acceptance. Written at most once per pair per instance every
-- WEIR_RECENT_KEY_SHARE_SECONDS; read only for requests that meet a block.
CREATE TABLE recent_keys (
    address     text        NOT NULL,
    key_id      uuid        NOT NULL,
    accepted_at timestamptz NOT NULL,
    PRIMARY KEY (address, key_id)
);

CREATE INDEX recent_keys_accepted_at ON recent_keys (accepted_at);
