-- The trace of the job that made each result: its delivery to encode, from the job or later from the delivery loop,
-- continues that trace (shared/tracing.py), so what encode publishes of it stays in the video's trace.
ALTER TABLE results ADD COLUMN traceparent text;
