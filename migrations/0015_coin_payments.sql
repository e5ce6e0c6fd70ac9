-- Orders paid with the buyer's coins. `coin_reservation` is set when the buyer first asks to pay
-- with coins (before the coins are reserved over the RPC), so an order that ends otherwise
-- (expired, paid through a gateway) knows to give a reservation back, even one whose answer was
-- lost.
ALTER TABLE orders ADD COLUMN coin_reservation text UNIQUE;
ALTER TABLE orders ADD COLUMN paid_with_coins boolean NOT NULL DEFAULT false;
ALTER TABLE orders ADD CONSTRAINT orders_coins_paid_has_reservation
    CHECK (NOT paid_with_coins OR (coin_reservation IS NOT NULL AND paid_at IS NOT NULL));
