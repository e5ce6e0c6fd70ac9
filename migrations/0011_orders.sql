-- Orders are created by checkout. A payment that no checkout asked for is not an order: it is
-- recorded as an unmatched payment for an operator. The orders the previous release made up
-- from payment events are exactly that, so they move there.

CREATE TABLE unmatched_payments (
    id           bigserial     PRIMARY KEY,
    gateway      text          NOT NULL,
    session_id   text          NOT NULL CHECK (session_id <> ''),
    payment_id   text,
    status       text          NOT NULL,
    amount       numeric(20, 4),
    currency     char(3),
    -- The event that revealed it.
    event_id     bigint        REFERENCES payment_events (id),
    created_at   timestamptz   NOT NULL DEFAULT now(),
    updated_at   timestamptz   NOT NULL DEFAULT now(),
    CONSTRAINT unmatched_payments_session_key UNIQUE (gateway, session_id)
);

INSERT INTO unmatched_payments (gateway, session_id, payment_id, status, amount, currency, created_at)
SELECT o.gateway, o.session_id, po.payment_id, COALESCE(po.status, 'pending'), o.total, o.currency, o.created_at
FROM orders o LEFT JOIN payment_orders po ON po.order_id = o.id;

ALTER TABLE payment_orders DROP COLUMN order_id;
DROP TABLE orders;

-- The gateway's payment id is unique among recorded payments.
DROP INDEX payment_orders_payment_id;
CREATE UNIQUE INDEX payment_orders_payment_id_key ON payment_orders (gateway, payment_id) WHERE payment_id IS NOT NULL;

-- Order numbers: one counter row, incremented inside the checkout's transaction, so numbers are
-- sequential with no gaps (a rolled-back checkout gives its number back) and no duplicates.
CREATE TABLE order_numbers (
    singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    last      bigint  NOT NULL CHECK (last >= 0)
);
INSERT INTO order_numbers VALUES (true, 0);

CREATE TABLE checkouts (
    id         bigserial   PRIMARY KEY,
    buyer_id   text        NOT NULL CHECK (buyer_id <> '' AND length(buyer_id) <= 200),
    gateway    text        NOT NULL,
    coupon_id  uuid        REFERENCES coupons (id),
    created_at timestamptz NOT NULL DEFAULT now()
);

-- Idempotent checkout: one row per Idempotency-Key.
CREATE TABLE idempotency_keys (
    key          text        PRIMARY KEY CHECK (key <> '' AND length(key) <= 255),
    -- SHA-256 of the request body as parsed (a different body under the same key is refused).
    request_hash bytea       NOT NULL,
    -- Set in the checkout's own transaction.
    checkout_id  bigint      REFERENCES checkouts (id),
    -- The first complete answer, returned as it is to every repeat.
    response     jsonb,
    -- A request is working on the key until then (a crashed one lets go by itself), and which.
    locked_until timestamptz,
    locked_by    text,
    created_at   timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT idempotency_keys_response_after_checkout CHECK (response IS NULL OR checkout_id IS NOT NULL)
);

CREATE TABLE orders (
    id              bigserial     PRIMARY KEY,
    number          bigint        NOT NULL UNIQUE CHECK (number > 0),
    checkout_id     bigint        NOT NULL REFERENCES checkouts (id),
    seller_id       uuid          NOT NULL REFERENCES sellers (id),
    buyer_id        text          NOT NULL,
    kind            text          NOT NULL CHECK (kind IN ('one_off', 'subscription')),
    "interval"      text          CHECK ("interval" IN ('day', 'week', 'month', 'year')),
    currency        char(3)       NOT NULL CHECK (currency ~ '^[A-Z]{3}$'),
    subtotal        numeric(20, 4) NOT NULL,
    discount        numeric(20, 4) NOT NULL DEFAULT 0,
    total           numeric(20, 4) NOT NULL,
    platform_fee    numeric(20, 4) NOT NULL,
    seller_net      numeric(20, 4) NOT NULL,
    amount_refunded numeric(20, 4) NOT NULL DEFAULT 0,
    -- The business truth.
    status          text          NOT NULL DEFAULT 'awaiting_payment',
    -- The provider's truth, beside it (payment_orders.status, kept in step by processing).
    payment_status  text          NOT NULL DEFAULT 'pending',
    gateway         text          NOT NULL,
    -- Payment attempts: a failed attempt's session is spent; reopening payment starts the next.
    payment_attempt integer       NOT NULL DEFAULT 1 CHECK (payment_attempt > 0),
    -- Names this order's sessions at the gateways, unguessable and unique across installations.
    payment_token   uuid          NOT NULL DEFAULT gen_random_uuid(),
    session_id      text,
    payment_url     text,
    coupon_id       uuid          REFERENCES coupons (id),
    expires_at      timestamptz   NOT NULL,
    paid_at         timestamptz,
    expired_at      timestamptz,
    created_at      timestamptz   NOT NULL DEFAULT now(),
    updated_at      timestamptz   NOT NULL DEFAULT now(),
    CONSTRAINT orders_session_key UNIQUE (gateway, session_id),
    CONSTRAINT orders_status_valid CHECK (status IN
        ('awaiting_payment', 'payment_failed', 'paid', 'partially_refunded', 'refunded', 'disputed',
         'charged_back', 'expired', 'cancelled')),
    CONSTRAINT orders_payment_status_valid CHECK (payment_status IN
        ('pending', 'succeeded', 'failed', 'partially_refunded', 'refunded', 'disputed', 'charged_back')),
    CONSTRAINT orders_interval_iff_subscription CHECK ((kind = 'subscription') = ("interval" IS NOT NULL)),
    CONSTRAINT orders_link_complete CHECK ((session_id IS NULL) = (payment_url IS NULL)),
    CONSTRAINT orders_amounts_add_up CHECK (
        subtotal > 0 AND discount >= 0 AND discount <= subtotal AND total = subtotal - discount
        AND platform_fee >= 0 AND seller_net >= 0 AND platform_fee + seller_net = total
        AND amount_refunded >= 0 AND amount_refunded <= total),
    -- Anything past payment must have been paid, once.
    CONSTRAINT orders_paid_states_have_paid_at CHECK (
        status NOT IN ('paid', 'partially_refunded', 'refunded', 'disputed', 'charged_back') OR paid_at IS NOT NULL),
    CONSTRAINT orders_expired_has_expired_at CHECK (status <> 'expired' OR expired_at IS NOT NULL)
);

CREATE INDEX orders_checkout ON orders (checkout_id);
CREATE INDEX orders_seller ON orders (seller_id, created_at);

CREATE TABLE order_items (
    order_id   bigint        NOT NULL REFERENCES orders (id),
    line       integer       NOT NULL CHECK (line > 0),
    product_id uuid          NOT NULL REFERENCES products (id),
    name       text          NOT NULL,
    unit_price numeric(20, 4) NOT NULL CHECK (unit_price > 0),
    quantity   integer       NOT NULL CHECK (quantity > 0),
    subtotal   numeric(20, 4) NOT NULL,
    discount   numeric(20, 4) NOT NULL DEFAULT 0,
    PRIMARY KEY (order_id, line),
    CONSTRAINT order_items_amounts_add_up CHECK (
        subtotal = unit_price * quantity AND discount >= 0 AND discount <= subtotal)
);

-- An order that used a coupon holds one of its redemptions until it expires.
CREATE TABLE coupon_redemptions (
    order_id    bigint      PRIMARY KEY REFERENCES orders (id),
    coupon_id   uuid        NOT NULL REFERENCES coupons (id),
    released_at timestamptz
);

-- What happened to an order, once each, written in the transaction that made it happen: the
-- messages the order side publishes ("order paid") come from here.
CREATE TABLE order_events (
    id         bigserial   PRIMARY KEY,
    order_id   bigint      NOT NULL REFERENCES orders (id),
    kind       text        NOT NULL CHECK (kind IN ('created', 'paid', 'expired', 'late_payment', 'extra_payment', 'reopened')),
    payload    jsonb       NOT NULL DEFAULT '{}'::jsonb,
    created_at timestamptz NOT NULL DEFAULT now()
);
-- An order is created, paid, expires once; it may be reopened (and paid again by mistake)
-- several times.
CREATE UNIQUE INDEX order_events_once ON order_events (order_id, kind) WHERE kind NOT IN ('reopened', 'extra_payment');
