-- Accounts, their users, account tokens, apps and keys. Tokens and keys are stored only as a keyed hash
-- (HMAC-SHA256 under WEIR_KEY_HASH_SECRET) with their first 12 characters for display.
CREATE TABLE accounts (
    id         uuid PRIMARY KEY,
    name       text        NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE users (
    id         uuid PRIMARY KEY,
    account_id uuid        NOT NULL REFERENCES accounts (id),
    name       text        NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE account_tokens (
    id         uuid PRIMARY KEY,
    user_id    uuid        NOT NULL REFERENCES users (id),
    token_hash text        NOT NULL UNIQUE,
    prefix     text        NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    revoked_at timestamptz
);

CREATE TABLE apps (
    id              uuid PRIMARY KEY,
    account_id      uuid        NOT NULL REFERENCES accounts (id),
    name            text        NOT NULL,
    allowed_origins text[]      NOT NULL DEFAULT '{}',
    created_by      uuid        REFERENCES users (id),
    created_at      timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX apps_account ON apps (account_id);

CREATE TABLE keys (
    id         uuid PRIMARY KEY,
    app_id     uuid        NOT NULL REFERENCES apps (id),
    account_id uuid        NOT NULL REFERENCES accounts (id),
    kind       text        NOT NULL CHECK (kind IN ('secret', 'publishable')),
    key_hash   text        NOT NULL UNIQUE,
    prefix     text        NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    revoked_at timestamptz
);
CREATE INDEX keys_app ON keys (app_id);
