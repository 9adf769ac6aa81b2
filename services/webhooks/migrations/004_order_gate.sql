-- Several webhooks instances read one durable, each part of the stream: a delivery of an event waits (its due time
-- kept aside, in gated_due_at) until the durable has acknowledged every message up to the event's own, so that an
-- earlier event of its video, read by another instance, is recorded first and goes first (services/webhooks/
-- domain.gate_released). Expand-only: a webhooks instance of an earlier release leaves these empty.
ALTER TABLE deliveries
    ADD COLUMN gate_stream   text,
    ADD COLUMN gate_durable  text,
    ADD COLUMN gate_seq      bigint,
    ADD COLUMN gated_due_at  timestamptz;
CREATE INDEX deliveries_gated ON deliveries (gate_stream, gate_durable, gate_seq) WHERE gate_seq IS NOT NULL;
