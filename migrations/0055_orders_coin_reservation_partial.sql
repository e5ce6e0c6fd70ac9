-- orders.coin_reservation is set on few orders (those paid, or being paid, with coins), yet the
-- index of its unique constraint held an entry for every order, and a planner without
-- statistics (a new database, a server without autovacuum) took `coin_reservation IS NULL`,
-- true of nearly every order, for a selective condition: each batch of payments read every
-- order through it (README, "Statements that do not trust the planner"). A partial unique
-- index keeps the same rule on the orders that have a reservation (NULLs were never compared)
-- and cannot be used to look for the orders without one.
ALTER TABLE orders DROP CONSTRAINT orders_coin_reservation_key;
CREATE UNIQUE INDEX orders_coin_reservation_key ON orders (coin_reservation) WHERE coin_reservation IS NOT NULL;
