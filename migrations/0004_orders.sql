-- The business truth. For now an order is created by its first payment event; the checkout
-- issue creates orders up front (awaiting_payment) and grows this table.
CREATE TABLE orders (
    id               bigserial PRIMARY KEY,
    gateway          text          NOT NULL,
    session_id       text          NOT NULL,
    status           text          NOT NULL DEFAULT 'awaiting_payment',
    currency         char(3),
    total            numeric(20, 4),
    amount_refunded  numeric(20, 4) NOT NULL DEFAULT 0,
    paid_at          timestamptz,
    created_at       timestamptz   NOT NULL DEFAULT now(),
    updated_at       timestamptz   NOT NULL DEFAULT now(),
    CONSTRAINT orders_session_key UNIQUE (gateway, session_id),
    CONSTRAINT orders_status_valid CHECK (status IN
        ('awaiting_payment', 'payment_failed', 'paid', 'partially_refunded', 'refunded', 'disputed',
         'charged_back', 'expired', 'cancelled')),
    -- Anything past payment must have been paid, once.
    CONSTRAINT orders_paid_states_have_paid_at CHECK (
        status NOT IN ('paid', 'partially_refunded', 'refunded', 'disputed', 'charged_back') OR paid_at IS NOT NULL),
    CONSTRAINT orders_refund_within_total CHECK (
        amount_refunded >= 0 AND (total IS NULL OR amount_refunded <= total))
);

ALTER TABLE payment_orders ADD COLUMN order_id bigint REFERENCES orders (id);
