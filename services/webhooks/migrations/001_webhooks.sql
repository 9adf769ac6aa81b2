-- Developers' endpoints (SPEC 13). `secret` signs every delivery; `retiring` holds the secrets rotated out that
-- still sign until their time ([[secret, until], ...], newest first). `failing_since`: its first failed attempt
-- since its last success (the 5-day rule).
CREATE TABLE endpoints (
    id                uuid        PRIMARY KEY,
    app_id            text        NOT NULL,
    account_id        text        NOT NULL,
    url               text        NOT NULL,
    events            text[]      NOT NULL,
    description       text        NOT NULL DEFAULT '',
    enabled           boolean     NOT NULL DEFAULT true,
    disabled_reason   text,
    disabled_at       timestamptz,
    failing_since     timestamptz,
    secret            text        NOT NULL,
    retiring          jsonb       NOT NULL DEFAULT '[]',
    secret_rotated_at timestamptz,
    created_at        timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX endpoints_app ON endpoints (app_id, created_at);

-- Each video's app and account, learned from the videos' events: encoding events name neither.
CREATE TABLE videos (
    video_id   text PRIMARY KEY,
    app_id     text NOT NULL,
    account_id text NOT NULL
);

-- Every public event received, as delivered (the envelope's JSON): what deliveries send, and what a developer's
-- replay picks its slice from. Kept as long as deliveries. `app_id` NULL: an encoding event read before its
-- video's video.created (another stream); delivered when that comes.
CREATE TABLE events (
    id          uuid        PRIMARY KEY,
    type        text        NOT NULL,
    app_id      text,
    video_id    text,
    occurred_at timestamptz NOT NULL,
    body        bytea       NOT NULL,
    received_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX events_app_time ON events (app_id, occurred_at);
CREATE INDEX events_received ON events (received_at);
CREATE INDEX events_waiting ON events (video_id) WHERE app_id IS NULL;

-- One event to one endpoint. A replay makes a new delivery of the same event (the same webhook-id), named by its
-- replay; live, an event is delivered to an endpoint once. `in_flight_until`: an attempt is under way until then
-- (past it, its instance died and the delivery is due again). `video_id` and `occurred_at` order a video's
-- deliveries (services/webhooks/domain.py).
CREATE TABLE deliveries (
    id              uuid        PRIMARY KEY,
    endpoint_id     uuid        NOT NULL REFERENCES endpoints (id) ON DELETE CASCADE,
    event_id        uuid        NOT NULL REFERENCES events (id) ON DELETE CASCADE,
    event_type      text        NOT NULL,
    video_id        text,
    occurred_at     timestamptz NOT NULL,
    replay_id       uuid,
    state           text        NOT NULL DEFAULT 'pending' CHECK (state IN ('pending', 'delivered', 'failed')),
    attempts        int         NOT NULL DEFAULT 0,
    due_at          timestamptz NOT NULL DEFAULT now(),
    in_flight_until timestamptz,
    first_failure   timestamptz,
    created_at      timestamptz NOT NULL DEFAULT now(),
    finished_at     timestamptz
);
CREATE UNIQUE INDEX deliveries_once ON deliveries (endpoint_id, event_id) WHERE replay_id IS NULL;
CREATE INDEX deliveries_pending ON deliveries (endpoint_id, due_at) WHERE state = 'pending';
CREATE INDEX deliveries_log ON deliveries (endpoint_id, created_at DESC, id DESC);
CREATE INDEX deliveries_event ON deliveries (event_id);

-- Each attempt: when, its status code or error, its latency, the address connected to, the first bytes answered.
CREATE TABLE attempts (
    delivery_id uuid             NOT NULL REFERENCES deliveries (id) ON DELETE CASCADE,
    n           int              NOT NULL,
    at          timestamptz      NOT NULL,
    status_code int,
    error       text,
    latency_ms  double precision NOT NULL,
    address     text             NOT NULL DEFAULT '',
    response    bytea            NOT NULL DEFAULT '',
    PRIMARY KEY (delivery_id, n)
);
