-- Reconciliation asks a gateway about the charges of a subscription it bills whose period ended
-- with nothing reported since (payments::reconcile, "periods"): the renewal's event, paid or
-- failed, was lost, and without it the period has no order and no sale. When each period was
-- last asked about, so that it is asked at most hourly and the others come first. Owned by the
-- payment side; the subscription is the orders side's (its id, no foreign key across them).
CREATE TABLE subscription_period_checks (
    subscription_id uuid NOT NULL,
    period_end timestamptz NOT NULL,
    checked_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (subscription_id, period_end)
);
