-- The marketplace backend's API keys (PRODUCT.md, "Who may call what"): made by an operator,
-- shown once, kept only as the SHA-256 of the key. A key bound to a seller reads only that
-- seller's data. A revoked key is kept (with when), so a request with it is told it was revoked.
CREATE TABLE api_keys (
    id         uuid        PRIMARY KEY DEFAULT gen_random_uuid(),
    name       text        NOT NULL CHECK (name <> '' AND length(name) <= 100),
    seller_id  uuid        REFERENCES sellers (id),
    key_hash   bytea       NOT NULL UNIQUE CHECK (length(key_hash) = 32),
    -- The key's first characters, so an operator can tell keys apart; far too few to use one.
    prefix     text        NOT NULL CHECK (prefix LIKE 'pfk\_%' AND length(prefix) <= 16),
    created_at timestamptz NOT NULL DEFAULT now(),
    revoked_at timestamptz,
    CONSTRAINT api_keys_revoked_after_created CHECK (revoked_at IS NULL OR revoked_at >= created_at)
);
