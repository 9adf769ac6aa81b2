-- When an auth instance last accepted a secret key from a client address that is now blocked, so that the
-- `auth_failure` block's exception ("a key accepted from that address within the last minute still gets
-- through") holds on every instance, including one started after the block. An instance writes its keys for
-- an address when it learns of that address's block, and then at most every WEIR_RECENT_KEY_SHARE_SECONDS per
-- key while the block lasts; it reads only for requests that meet a block with a key it did not accept itself.
CREATE TABLE recent_keys (
    address     text        NOT NULL,
    key_id      uuid        NOT NULL,
    accepted_at timestamptz NOT NULL,
    PRIMARY KEY (address, key_id)
);

CREATE INDEX recent_keys_accepted_at ON recent_keys (accepted_at);
