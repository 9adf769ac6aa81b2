-- The account of each video id encode has heard of (SPEC 12): from video.created, upload.completed, video.deleted,
-- or an accepted recording's subject. A team's recording names only its own accounts' videos, and encode.* events go
-- on `encode.<x>.<account_id>`. Expand only: the release before ignores the table and still runs on this schema.
CREATE TABLE video_accounts (
    video_id     text        PRIMARY KEY,
    account_id   text        NOT NULL,
    learned_from text        NOT NULL,  -- the event type that told it
    learned_at   timestamptz NOT NULL
);
