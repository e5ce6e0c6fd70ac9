-- The payment side: one gateway session per order and payment attempt (asking twice gives the
-- same session).
CREATE TABLE payment_sessions (
    order_number bigint        NOT NULL,
    attempt      integer       NOT NULL CHECK (attempt > 0),
    gateway      text          NOT NULL,
    session_id   text          NOT NULL CHECK (session_id <> ''),
    url          text          NOT NULL CHECK (url <> ''),
    amount       numeric(20, 4) NOT NULL CHECK (amount > 0),
    currency     char(3)       NOT NULL,
    platform_fee numeric(20, 4) NOT NULL CHECK (platform_fee >= 0),
    -- What the gateway carries for us: the seller, the split.
    metadata     jsonb         NOT NULL DEFAULT '{}'::jsonb,
    created_at   timestamptz   NOT NULL DEFAULT now(),
    PRIMARY KEY (order_number, attempt),
    CONSTRAINT payment_sessions_session_key UNIQUE (gateway, session_id)
);

-- The internal gateway (and the mock, which behaves the same): the platform is merchant of
-- record. Its payments, refunds, and the signed events it delivers to the receiver.
CREATE TABLE internal_payments (
    session_id   text          PRIMARY KEY,
    gateway      text          NOT NULL CHECK (gateway IN ('internal', 'mock')),
    order_number bigint        NOT NULL,
    attempt      integer       NOT NULL,
    amount       numeric(20, 4) NOT NULL CHECK (amount > 0),
    currency     char(3)       NOT NULL,
    -- The split (seller, platform fee, seller's net), settled in the seller's ledger when paid.
    metadata     jsonb         NOT NULL,
    status       text          NOT NULL DEFAULT 'pending' CHECK (status IN ('pending', 'succeeded', 'failed')),
    payment_id   text          UNIQUE,
    decided_at   timestamptz,
    created_at   timestamptz   NOT NULL DEFAULT now(),
    CONSTRAINT internal_payments_order_key UNIQUE (gateway, order_number, attempt),
    CONSTRAINT internal_payments_decided CHECK ((status = 'pending') = (decided_at IS NULL)),
    CONSTRAINT internal_payments_paid_has_id CHECK ((status = 'succeeded') = (payment_id IS NOT NULL))
);

CREATE TABLE internal_refunds (
    refund_id       text          PRIMARY KEY,
    session_id      text          NOT NULL REFERENCES internal_payments (session_id),
    amount          numeric(20, 4) NOT NULL CHECK (amount > 0),
    -- The caller's key: the same refund asked twice is one refund.
    idempotency_key text          NOT NULL UNIQUE,
    created_at      timestamptz   NOT NULL DEFAULT now()
);

CREATE TABLE internal_events (
    id           text        PRIMARY KEY,
    gateway      text        NOT NULL CHECK (gateway IN ('internal', 'mock')),
    body         jsonb       NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now(),
    delivered_at timestamptz
);

-- Secrets `payfleet up` made for a development setup, kept so a restart (and `payfleet demo`)
-- use the same ones. `serve` and `work` never read this table.
CREATE TABLE development_settings (
    name       text        PRIMARY KEY,
    value      text        NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);
