-- Each video's processing state (SPEC section 6): its outputs, deadline, busy_at, restarts; and the farm's workers.
CREATE TABLE videos (
    video_id              text        PRIMARY KEY,  -- the api's video id, or a first-party recording id
    job_class             text        NOT NULL CHECK (job_class IN ('developer', 'first_party')),
    object_key            text        NOT NULL,
    source_height         int,                      -- NULL until probed
    state                 text        NOT NULL DEFAULT 'processing' CHECK (state IN ('processing', 'ready', 'failed')),
    processing_started_at timestamptz NOT NULL,
    deadline_at           timestamptz NOT NULL,
    busy_at               timestamptz,
    last_round            text,                     -- 'heard' | 'silent': the last round that offered anything
    next_round_at         timestamptz NOT NULL,
    round_until           timestamptz,              -- an instance runs this video's round until then (a lease)
    failure_reason        text,
    failure_message       text,
    finished_at           timestamptz
);
CREATE INDEX videos_due ON videos (next_round_at) WHERE state = 'processing';

CREATE TABLE outputs (
    video_id        text        NOT NULL REFERENCES videos ON DELETE CASCADE,
    height          int         NOT NULL,
    state           text        NOT NULL DEFAULT 'pending'
                                CHECK (state IN ('pending', 'offered', 'encoding', 'done')),
    attempt         int         NOT NULL DEFAULT 0,  -- grows with every offer; results name the attempt they are of
    offered_at      timestamptz,
    worker          text,
    worker_instance text,
    started_at      timestamptz,
    object_key      text,
    size            bigint,
    failures        int         NOT NULL DEFAULT 0,
    restarts        int         NOT NULL DEFAULT 0,  -- stuck restarts
    returns         int         NOT NULL DEFAULT 0,  -- back to pending from a dead worker or a hand-back
    PRIMARY KEY (video_id, height)
);
CREATE INDEX outputs_pending ON outputs (video_id) WHERE state = 'pending';
CREATE INDEX outputs_by_instance ON outputs (worker_instance) WHERE state = 'encoding';

CREATE TABLE workers (
    instance  text        PRIMARY KEY,
    name      text        NOT NULL,
    slots     int         NOT NULL,
    last_seen timestamptz NOT NULL,
    leaving   boolean     NOT NULL DEFAULT false,
    dead_at   timestamptz
);
