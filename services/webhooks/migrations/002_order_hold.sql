-- Whether the video's source event (upload.completed) was received: until it is, its encoding events' deliveries
-- wait (services/webhooks/domain.first_due), and its coming makes them due.
ALTER TABLE videos ADD COLUMN source_seen boolean NOT NULL DEFAULT false;
CREATE INDEX deliveries_video_pending ON deliveries (video_id) WHERE state = 'pending';
-- `weir status`: deliveries given up in the last hour
CREATE INDEX deliveries_failed ON deliveries (finished_at) WHERE state = 'failed';
