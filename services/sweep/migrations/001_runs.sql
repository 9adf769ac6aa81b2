-- The sweep's ledger: one row per run, written when it starts and completed when it ends.
CREATE TABLE runs (
    id               uuid PRIMARY KEY,
    trigger          text        NOT NULL CHECK (trigger IN ('daily', 'on_demand')),
    daily_for        date,                   -- the day a daily run is for (one completed daily run per day)
    dry_run          boolean     NOT NULL,
    force            boolean     NOT NULL,
    outcome          text        NOT NULL CHECK (outcome IN ('running', 'completed', 'stopped', 'failed', 'interrupted')),
    started_at       timestamptz NOT NULL,
    finished_at      timestamptz,
    duration_seconds double precision,
    examined         int         NOT NULL DEFAULT 0,
    retired          jsonb       NOT NULL DEFAULT '{}',  -- by reason
    left_alone       jsonb       NOT NULL DEFAULT '{}',  -- by reason
    would_retire     jsonb       NOT NULL DEFAULT '{}',  -- what the survey would retire, by reason (the valve's count)
    dry_run_retire   jsonb       NOT NULL DEFAULT '{}',  -- what a dry run found it would retire under the locks
    errors           int         NOT NULL DEFAULT 0,
    bytes_removed    bigint      NOT NULL DEFAULT 0,
    note             text
);
CREATE INDEX runs_recent ON runs (started_at DESC);
CREATE INDEX runs_daily ON runs (daily_for) WHERE trigger = 'daily';
