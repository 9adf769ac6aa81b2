-- The relays of this outbox and whether each sleeps (shared/outbox.py): a commit notifies only while a relay sleeps,
-- or while no relay says it is awake (one of a release before this one, which does not register, is then still
-- woken; beside a registered one it finds the rows by its poll). A notifying commit takes the notification queue's
-- database-wide lock until it ends, so commits that notify cannot share a WAL flush: under load, when the relays are
-- awake, writers now skip it (bench.bus).
CREATE TABLE outbox_relays (
    relay    text        PRIMARY KEY,
    sleeping boolean     NOT NULL,
    seen     timestamptz NOT NULL DEFAULT now()
);

-- The writer takes the outbox's relay lock (shared) before it reads whether to notify, and holds it until its
-- transaction ends: a relay about to sleep takes it exclusively once it says so, so every writer that read "awake"
-- has committed (or not) by the time the relay looks for rows a last time, and every later one reads "sleeping".
CREATE OR REPLACE FUNCTION outbox_notify() RETURNS trigger LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
BEGIN
    PERFORM pg_advisory_xact_lock_shared(hashtext('weir_outbox'), hashtext(TG_TABLE_SCHEMA));
    IF (SELECT bool_or(sleeping) OR NOT bool_or(NOT sleeping AND seen > now() - interval '30 seconds')
        FROM outbox_relays) IS NOT FALSE THEN
        PERFORM pg_notify('weir_outbox_' || TG_TABLE_SCHEMA, '');
    END IF;
    RETURN NULL;
END $$;
