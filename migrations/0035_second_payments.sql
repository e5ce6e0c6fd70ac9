-- A second, different payment on a session that has one already (Mercado Pago preferences and
-- Razorpay orders take several payments): not the session's payment, never absorbed into it,
-- given back once and recorded here, with the refunds that gave it back.
CREATE TABLE second_payments (
    id               bigserial      PRIMARY KEY,
    gateway          text           NOT NULL,
    session_id       text           NOT NULL CHECK (session_id <> ''),
    payment_id       text           NOT NULL CHECK (payment_id <> ''),
    amount           numeric(20, 4) CHECK (amount > 0),
    currency         char(3),
    amount_refunded  numeric(20, 4) NOT NULL DEFAULT 0 CHECK (amount_refunded >= 0),
    event_id         bigint         REFERENCES payment_events (id),
    created_at       timestamptz    NOT NULL DEFAULT now(),
    updated_at       timestamptz    NOT NULL DEFAULT now(),
    CONSTRAINT second_payments_payment_key UNIQUE (gateway, payment_id),
    CONSTRAINT second_payments_refunds_within CHECK (amount IS NULL OR amount_refunded <= amount)
);

-- Each refund of a second payment, once.
CREATE TABLE second_payment_refunds (
    second_payment_id bigint         NOT NULL REFERENCES second_payments (id),
    refund_id         text           NOT NULL CHECK (refund_id <> ''),
    amount            numeric(20, 4) NOT NULL CHECK (amount > 0),
    created_at        timestamptz    NOT NULL DEFAULT now(),
    PRIMARY KEY (second_payment_id, refund_id)
);
