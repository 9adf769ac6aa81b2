-- The outbox: a service writes its state change and its event here in one transaction;
-- the relay publishes unsent rows to JetStream and marks them sent only after the PubAck.
CREATE TABLE outbox (
    seq        bigserial PRIMARY KEY,
    id         uuid        NOT NULL UNIQUE,
    subject    text        NOT NULL,
    payload    bytea       NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    sent_at    timestamptz
);
CREATE INDEX outbox_unsent ON outbox (seq) WHERE sent_at IS NULL;
CREATE INDEX outbox_sent_at ON outbox (sent_at) WHERE sent_at IS NOT NULL;

-- Wakes the relay at commit (one notification per transaction, whatever it inserted).
CREATE FUNCTION outbox_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('weir_outbox_' || TG_TABLE_SCHEMA, '');
    RETURN NULL;
END $$;
CREATE TRIGGER outbox_notify AFTER INSERT ON outbox FOR EACH STATEMENT EXECUTE FUNCTION outbox_notify();

-- The inbox: which consumer handled which event; written in the handler's own transaction,
-- so a redelivery or a replay changes nothing twice.
CREATE TABLE inbox (
    consumer   text        NOT NULL,
    event_id   uuid        NOT NULL,
    event_type text        NOT NULL,
    handled_at timestamptz NOT NULL DEFAULT now(),
    times      int         NOT NULL DEFAULT 1,
    PRIMARY KEY (consumer, event_id)
);
