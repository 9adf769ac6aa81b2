-- Idempotency keys of video creates (`Idempotency-Key`): a create sent again with its key answers the video the first
-- made. A key is the app's, kept WEIR_IDEMPOTENCY_KEY_TTL_SECONDS; expired rows are removed a few at a time by the
-- creates that come after. Expand-only: an earlier release's api never reads it.
CREATE TABLE idempotency_keys (
    app_id      uuid        NOT NULL,
    key         text        NOT NULL,
    fingerprint text        NOT NULL,  -- what the request asked for (services/api/domain.py request_fingerprint)
    video_id    uuid        NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (app_id, key)
);
CREATE INDEX idempotency_keys_created ON idempotency_keys (created_at);
