-- Imports from a URL (POST /v1/videos/{id}/import): the job lives on the video's row, claimed by any api instance
-- under a lease (services/api/imports.py). Expand-only: an api or sweep of an earlier release runs on this schema
-- (its inserts leave no import, and nothing it does reads or writes these columns).
ALTER TABLE videos
    ADD COLUMN import_url           text,
    ADD COLUMN import_state         text CHECK (import_state IN ('queued', 'fetching', 'completed', 'failed',
                                                                 'cancelled')),
    ADD COLUMN import_attempts      integer NOT NULL DEFAULT 0,
    ADD COLUMN import_next_at       timestamptz,   -- queued: not before then; fetching: the lease, taken over after
    ADD COLUMN import_bytes         bigint,        -- read so far (the attempt's), or the file's
    ADD COLUMN import_error         jsonb,         -- the last failed attempt's {code, message, status?}
    ADD COLUMN import_started_at    timestamptz,
    ADD COLUMN import_finished_at   timestamptz;
-- what the importers look for: only the rows with an import to do (a handful among every video)
CREATE INDEX videos_import_due ON videos (import_next_at) WHERE import_state IN ('queued', 'fetching');
