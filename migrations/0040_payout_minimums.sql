-- A seller's payout minimum per currency (50.00 BRL is not 50.00 JPY): the seller's own
-- `payout_minimum` stays the minimum of a currency not listed here.
CREATE TABLE seller_payout_minimums (
    seller_id uuid           NOT NULL REFERENCES sellers (id),
    currency  char(3)        NOT NULL CHECK (currency ~ '^[A-Z]{3}$'),
    minimum   numeric(20, 4) NOT NULL CHECK (minimum >= 0),
    PRIMARY KEY (seller_id, currency)
);
