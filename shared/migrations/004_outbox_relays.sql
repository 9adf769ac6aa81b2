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

-- The writer reads whether to notify after its INSERT, so from before that read until its commit it holds the outbox's
-- ROW EXCLUSIVE lock, which it takes anyway. A relay about to sleep says so, then takes the table in SHARE mode a
-- moment: every writer that read "awake" has then ended, so a last look for rows sees what it wrote, and every later
-- writer reads "sleeping". Writers take no lock of their own (an advisory lock per commit cost them 0.15 of their
-- rate: bench/RESULTS.md).
CREATE OR REPLACE FUNCTION outbox_notify() RETURNS trigger LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
BEGIN
    IF (SELECT bool_or(sleeping) OR NOT bool_or(NOT sleeping AND seen > now() - interval '30 seconds')
        FROM outbox_relays) IS NOT FALSE THEN
        PERFORM pg_notify('weir_outbox_' || TG_TABLE_SCHEMA, '');
    END IF;
    RETURN NULL;
END $$;
