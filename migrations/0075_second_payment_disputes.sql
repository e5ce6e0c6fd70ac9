-- A second payment's disputes (a payment on a session that has its own: migration 0035, given
-- back). Recorded, so its give-back waits while one is open and gives nothing a chargeback gave
-- already (the buyer is not paid twice), and so an operator sees a dispute of money given back
-- already (the `taken_back_beyond_payment` check: contest it with the refund). They move no
-- seller's money: a second payment was never the seller's sale.
CREATE TABLE second_payment_disputes (
    second_payment_id bigint         NOT NULL REFERENCES second_payments (id),
    gateway           text           NOT NULL,
    dispute_id        text           NOT NULL CHECK (dispute_id <> ''),
    status            text           NOT NULL CHECK (status IN ('open', 'won', 'lost', 'refunded')),
    amount            numeric(20, 4) NOT NULL CHECK (amount >= 0),
    currency          char(3)        NOT NULL,
    created_at        timestamptz    NOT NULL DEFAULT now(),
    updated_at        timestamptz    NOT NULL DEFAULT now(),
    CONSTRAINT second_payment_disputes_dispute_key UNIQUE (gateway, dispute_id)
);
CREATE INDEX second_payment_disputes_payment ON second_payment_disputes (second_payment_id);
