-- no-transaction
-- The coin reservations still held: the `coin_reservation_unsettled` consistency check reads them
-- every run without reading every reservation ever made.
CREATE INDEX CONCURRENTLY IF NOT EXISTS coin_reservations_held
    ON coin_reservations (created_at) WHERE state = 'reserved';
