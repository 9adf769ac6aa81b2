-- Videos and their upload state (the videos domain: api and sweep share this table and its row locks).
CREATE TABLE videos (
    id                    uuid PRIMARY KEY,
    app_id                uuid        NOT NULL,
    account_id            uuid        NOT NULL,
    key_id                uuid        NOT NULL,  -- the key that created it
    name                  text        NOT NULL,
    metadata              jsonb,
    status                text        NOT NULL DEFAULT 'created' CHECK (status IN
                              ('created', 'uploading', 'uploaded', 'processing', 'ready', 'failed', 'retired', 'deleted')),
    created_at            timestamptz NOT NULL DEFAULT now(),
    updated_at            timestamptz NOT NULL DEFAULT now(),
    object_key            text        NOT NULL,
    upload_id             text,                  -- the open multipart upload, recorded under the row lock
    completion_claimed_at timestamptz,           -- set and committed before assembling; cleared when recorded
    file_size             bigint,
    file_content_type     text,
    file_recorded_at      timestamptz,
    source_height         int,
    failure_reason        text,
    failure_message       text,
    retired_at            timestamptz,
    retire_reason         text,
    deleted_at            timestamptz,
    processing            jsonb,                 -- projection of encode.* events
    renditions            jsonb NOT NULL DEFAULT '[]'
);
-- the app's live videos, newest first (cursor pagination on created_at, id)
CREATE INDEX videos_listing ON videos (app_id, created_at DESC, id DESC) WHERE status NOT IN ('retired', 'deleted');
-- the sweep's candidates: no file recorded, not retired or deleted; cost follows candidates, not the table
CREATE INDEX videos_sweep_candidates ON videos (created_at) WHERE file_recorded_at IS NULL
    AND status NOT IN ('retired', 'deleted');
