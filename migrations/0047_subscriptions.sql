-- Subscriptions (docs/state_machine.md). A paid subscription order starts one, in the
-- transaction that confirms it, whatever path confirmed it (one event, a batch of first
-- payments, coins): the trigger below is the one place that does it.
CREATE TABLE subscriptions (
    id                   uuid          PRIMARY KEY DEFAULT gen_random_uuid(),
    -- The order whose payment started it.
    order_number         bigint        NOT NULL UNIQUE REFERENCES orders (number),
    seller_id            uuid          NOT NULL REFERENCES sellers (id),
    buyer_id             text          NOT NULL,
    -- The order's first line (a subscription order's lines share one interval).
    product_id           uuid          NOT NULL REFERENCES products (id),
    gateway              text          NOT NULL,
    "interval"           text          NOT NULL CHECK ("interval" IN ('day', 'week', 'month', 'year')),
    -- What each renewal charges: the order's subtotal (a coupon discounts the first period only).
    amount               numeric(20, 4) NOT NULL CHECK (amount > 0),
    currency             char(3)       NOT NULL CHECK (currency ~ '^[A-Z]{3}$'),
    status               text          NOT NULL DEFAULT 'active',
    current_period_start timestamptz   NOT NULL,
    current_period_end   timestamptz   NOT NULL,
    cancel_at_period_end boolean       NOT NULL DEFAULT false,
    canceled_at          timestamptz,
    created_at           timestamptz   NOT NULL DEFAULT now(),
    updated_at           timestamptz   NOT NULL DEFAULT now(),
    CONSTRAINT subscriptions_status_valid CHECK (status IN ('active', 'past_due', 'canceled')),
    CONSTRAINT subscriptions_period_forward CHECK (current_period_end > current_period_start),
    -- Canceled once, at a time; nothing else is canceled.
    CONSTRAINT subscriptions_canceled_at_iff_canceled CHECK ((status = 'canceled') = (canceled_at IS NOT NULL))
);

-- The billing run's question: which live subscriptions' periods have ended.
CREATE INDEX subscriptions_period_end ON subscriptions (current_period_end) WHERE status <> 'canceled';
CREATE INDEX subscriptions_seller ON subscriptions (seller_id, created_at);

CREATE FUNCTION orders_start_subscription() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO subscriptions (order_number, seller_id, buyer_id, product_id, gateway, "interval",
                               amount, currency, current_period_start, current_period_end)
    SELECT NEW.number, NEW.seller_id, NEW.buyer_id, i.product_id, NEW.gateway, NEW."interval",
           NEW.subtotal, NEW.currency, NEW.paid_at, NEW.paid_at + ('1 ' || NEW."interval")::interval
    FROM order_items i
    WHERE i.order_id = NEW.id AND i.line = 1
    ON CONFLICT (order_number) DO NOTHING;
    RETURN NULL;
END
$$;

-- Only the first time a subscription order is paid (a late payment on an expired order sets no
-- paid_at: it is given back, and starts nothing).
CREATE TRIGGER orders_start_subscription
    AFTER UPDATE OF paid_at ON orders
    FOR EACH ROW
    WHEN (OLD.paid_at IS NULL AND NEW.paid_at IS NOT NULL AND NEW.kind = 'subscription')
    EXECUTE FUNCTION orders_start_subscription();
