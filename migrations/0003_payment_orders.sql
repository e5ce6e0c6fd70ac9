-- The provider's truth: what the gateway says happened to a payment session. Facts are kept
-- separately (refunds, disputes) so that the status is derived from them, whatever order the
-- events arrived in.
CREATE TABLE payment_orders (
    id               bigserial PRIMARY KEY,
    gateway          text          NOT NULL,
    session_id       text          NOT NULL CHECK (session_id <> ''),
    payment_id       text,
    status           text          NOT NULL DEFAULT 'pending',
    currency         char(3),
    amount           numeric(20, 4),
    amount_refunded  numeric(20, 4) NOT NULL DEFAULT 0,
    succeeded_at     timestamptz,
    failed_at        timestamptz,
    created_at       timestamptz   NOT NULL DEFAULT now(),
    updated_at       timestamptz   NOT NULL DEFAULT now(),
    CONSTRAINT payment_orders_session_key UNIQUE (gateway, session_id),
    CONSTRAINT payment_orders_status_valid CHECK (status IN
        ('pending', 'succeeded', 'failed', 'partially_refunded', 'refunded', 'disputed', 'charged_back')),
    CONSTRAINT payment_orders_amounts_valid CHECK (
        (amount IS NULL OR amount >= 0) AND amount_refunded >= 0),
    CONSTRAINT payment_orders_currency_upper CHECK (currency IS NULL OR currency = upper(currency))
);

CREATE TABLE payment_refunds (
    id               bigserial PRIMARY KEY,
    payment_order_id bigint        NOT NULL REFERENCES payment_orders (id),
    gateway          text          NOT NULL,
    refund_id        text          NOT NULL CHECK (refund_id <> ''),
    amount           numeric(20, 4) NOT NULL CHECK (amount > 0),
    currency         char(3)       NOT NULL,
    event_id         bigint        NOT NULL REFERENCES payment_events (id),
    created_at       timestamptz   NOT NULL DEFAULT now(),
    CONSTRAINT payment_refunds_refund_key UNIQUE (gateway, refund_id)
);

-- Disputes move open -> won | lost; a late "created" never reopens a decided dispute.
CREATE TABLE payment_disputes (
    id               bigserial PRIMARY KEY,
    payment_order_id bigint        NOT NULL REFERENCES payment_orders (id),
    gateway          text          NOT NULL,
    dispute_id       text          NOT NULL CHECK (dispute_id <> ''),
    status           text          NOT NULL CHECK (status IN ('open', 'won', 'lost')),
    amount           numeric(20, 4) NOT NULL CHECK (amount >= 0),
    currency         char(3)       NOT NULL,
    updated_at       timestamptz   NOT NULL DEFAULT now(),
    CONSTRAINT payment_disputes_dispute_key UNIQUE (gateway, dispute_id)
);

-- Refunds and disputes often name only the gateway's payment id.
CREATE INDEX payment_orders_payment_id ON payment_orders (gateway, payment_id) WHERE payment_id IS NOT NULL;
