-- The trace of the work that opened the video's processing (its upload.completed's handling): the dispatch rounds and
-- the farm's jobs of the video continue it (shared/tracing.py), on whichever encode instance runs them.
ALTER TABLE videos ADD COLUMN traceparent text;
