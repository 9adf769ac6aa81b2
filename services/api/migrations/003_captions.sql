-- Caption tracks (services/api/captions.py): the video's list, in upload order, each file stored as WebVTT under the
-- video's prefix. Expand-only: an api or sweep of an earlier release runs on this schema (its inserts leave the list
-- empty, and nothing it does reads or writes it).
ALTER TABLE videos ADD COLUMN captions jsonb NOT NULL DEFAULT '[]';
