-- A subscription's renewals are orders of their own: one per (subscription, period), paid
-- through the same event path as any order, so each is one sale with its fee, its holding
-- period, its refunds and disputes, its invoice line and its payout, as an order's are.
ALTER TABLE orders ADD COLUMN renews uuid REFERENCES subscriptions (id);
ALTER TABLE orders ADD COLUMN period_start timestamptz;
ALTER TABLE orders ADD COLUMN period_end timestamptz;
ALTER TABLE orders ADD CONSTRAINT orders_renewal_has_its_period CHECK (
    (renews IS NULL) = (period_start IS NULL) AND (renews IS NULL) = (period_end IS NULL)
    AND (renews IS NULL OR (kind = 'subscription' AND period_end > period_start)));
-- Once per period, whatever runs the billing and however often.
CREATE UNIQUE INDEX orders_one_renewal_per_period ON orders (renews, period_start) WHERE renews IS NOT NULL;

-- How the payment simulator answers the internal gateway's renewals of this subscription
-- (`POST /admin/subscriptions/{id}/simulate`).
ALTER TABLE subscriptions ADD COLUMN simulated_renewals text NOT NULL DEFAULT 'succeed'
    CHECK (simulated_renewals IN ('succeed', 'fail'));

-- A renewal order's payment starts no subscription of its own.
DROP TRIGGER orders_start_subscription ON orders;
CREATE TRIGGER orders_start_subscription
    AFTER UPDATE OF paid_at ON orders
    FOR EACH ROW
    WHEN (OLD.paid_at IS NULL AND NEW.paid_at IS NOT NULL AND NEW.kind = 'subscription'
          AND NEW.renews IS NULL)
    EXECUTE FUNCTION orders_start_subscription();

-- A renewal's outcome moves its subscription, in the transaction that records it, whichever
-- path records it: paid makes a past-due subscription active again, a failure (or the renewal
-- expiring unpaid) makes an active one past due. Only the current period's renewal counts: a late event about an earlier one
-- changes nothing. A canceled subscription stays canceled.
CREATE FUNCTION orders_renewal_outcome() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.paid_at IS NOT NULL AND OLD.paid_at IS NULL THEN
        UPDATE subscriptions SET status = 'active', updated_at = now()
        WHERE id = NEW.renews AND status = 'past_due' AND current_period_start = NEW.period_start;
    ELSIF NEW.status IN ('payment_failed', 'expired') AND OLD.status <> NEW.status AND NEW.paid_at IS NULL THEN
        UPDATE subscriptions SET status = 'past_due', updated_at = now()
        WHERE id = NEW.renews AND status = 'active' AND current_period_start = NEW.period_start;
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER orders_renewal_outcome
    AFTER UPDATE OF status, paid_at ON orders
    FOR EACH ROW
    WHEN (NEW.renews IS NOT NULL)
    EXECUTE FUNCTION orders_renewal_outcome();
