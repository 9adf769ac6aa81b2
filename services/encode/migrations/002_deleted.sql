-- video.deleted (SPEC section 4: any video can become deleted): its processing stops for good. The video becomes
-- `deleted`, its outputs `cancelled` (never offered again; a late result of them is stale), and the deletion is
-- remembered even for a video encode never had, so that an upload.completed handled after it opens nothing.
ALTER TABLE videos DROP CONSTRAINT videos_state_check;
ALTER TABLE videos ADD CONSTRAINT videos_state_check
    CHECK (state IN ('processing', 'ready', 'failed', 'deleted'));

ALTER TABLE outputs DROP CONSTRAINT outputs_state_check;
ALTER TABLE outputs ADD CONSTRAINT outputs_state_check
    CHECK (state IN ('pending', 'offered', 'encoding', 'done', 'cancelled'));

CREATE TABLE deletions (
    video_id   text        PRIMARY KEY,
    deleted_at timestamptz NOT NULL,  -- when encode handled the video.deleted
    known      boolean     NOT NULL   -- encode had the video's processing state then
);
