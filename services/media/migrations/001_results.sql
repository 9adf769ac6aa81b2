-- Per-output results of this farm's workers: recorded before the slot frees, delivered to encode until it answers.
CREATE TABLE results (
    video_id     text        NOT NULL,
    output       int         NOT NULL,
    attempt      int         NOT NULL,
    payload      text        NOT NULL,  -- the OutputResult message, as delivered
    recorded_at  timestamptz NOT NULL DEFAULT now(),
    delivered_at timestamptz,
    PRIMARY KEY (video_id, output, attempt)
);
CREATE INDEX results_undelivered ON results (recorded_at) WHERE delivered_at IS NULL;
