-- `payfleet up`'s development API key is kept in plain text (development_settings) so a restart
-- and `payfleet demo` use the same one. It is marked, and only a process `up` started accepts a
-- marked key: `serve` on a database `up` once ran on (or on a copy of it) gives that key nothing.
ALTER TABLE api_keys ADD COLUMN development boolean NOT NULL DEFAULT false;

UPDATE api_keys SET development = true
 WHERE key_hash IN (SELECT sha256(convert_to(value, 'UTF8'))
                      FROM development_settings WHERE name = 'PAYFLEET_DEV_API_KEY');
