-- Idempotency keys belong to the caller that sent them ('admin', or 'key:<api key id>'): one
-- caller's key can neither replay another's answer nor hold up its request. Keys made before
-- callers had credentials belong to no caller that can send them again.
ALTER TABLE idempotency_keys ADD COLUMN owner text NOT NULL DEFAULT 'anonymous'
    CHECK (owner <> '' AND length(owner) <= 100);
ALTER TABLE idempotency_keys ALTER COLUMN owner DROP DEFAULT;
ALTER TABLE idempotency_keys DROP CONSTRAINT idempotency_keys_pkey;
ALTER TABLE idempotency_keys ADD PRIMARY KEY (owner, key);

-- `up` used to keep its development admin token in plain text; it now keeps none (a new one is
-- made and printed at every start, and only its digest is held, in memory).
DELETE FROM development_settings WHERE name = 'PAYFLEET_ADMIN_TOKEN';
