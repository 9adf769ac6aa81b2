-- The W3C trace context of the work that wrote each outbox row (also in the envelope, as `traceparent`): the relay
-- publishes the row under a span in that trace (shared/tracing.py). NULL when that work was not traced.
ALTER TABLE outbox ADD COLUMN traceparent text;
