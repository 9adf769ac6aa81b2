-- The subject each row is published on when it is not its type: the account subject of a public event
-- (`video.created.<account_id>`, SPEC 12). `subject` keeps the type, so the relay of the release before (which
-- publishes `subject`) still sends what its consumers read; this release's relay sends both (shared/outbox.py).
ALTER TABLE outbox ADD COLUMN IF NOT EXISTS bus_subject text;
