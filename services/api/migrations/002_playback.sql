-- Playback (SPEC 14): each video's policy and artwork, and the apps' playback signing keys. Expand-only: release
-- 1.0.0's api and sweep run on this schema (its inserts leave the new columns to their defaults).
ALTER TABLE videos ADD COLUMN playback_policy text NOT NULL DEFAULT 'public'
    CHECK (playback_policy IN ('public', 'signed'));
ALTER TABLE videos ADD COLUMN artwork jsonb;  -- poster and storyboard, from the encode.completed that carried them

-- public halves only: the api never keeps a private key (one it makes is shown once)
CREATE TABLE playback_keys (
    id             uuid PRIMARY KEY,
    app_id         uuid        NOT NULL,
    algorithm      text        NOT NULL,
    public_key_pem text        NOT NULL,
    fingerprint    text        NOT NULL,
    created_at     timestamptz NOT NULL DEFAULT now(),
    revoked_at     timestamptz
);
CREATE INDEX playback_keys_app ON playback_keys (app_id, created_at DESC, id DESC);
