-- Each step of a subscription is an order message of its first order (routing key
-- `order.subscription.<step>`): `past_due`, `reactivated` (active again), `canceled`. Written by
-- the database in the transaction that moves the subscription, whichever path moves it.
ALTER TABLE order_events DROP CONSTRAINT order_events_kind_check;
ALTER TABLE order_events ADD CONSTRAINT order_events_kind_check CHECK (kind IN
    ('created', 'paid', 'expired', 'late_payment', 'extra_payment', 'reopened',
     'past_due', 'reactivated', 'canceled'));
-- A subscription may fall past due and recover once per period; it is canceled once.
DROP INDEX order_events_once;
CREATE UNIQUE INDEX order_events_once ON order_events (order_id, kind)
    WHERE kind NOT IN ('reopened', 'extra_payment', 'late_payment', 'past_due', 'reactivated');

CREATE FUNCTION subscriptions_step_message() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO order_events (order_id, kind, payload)
    SELECT o.id,
           CASE NEW.status WHEN 'past_due' THEN 'past_due' WHEN 'active' THEN 'reactivated' ELSE 'canceled' END,
           jsonb_build_object('subscription_id', NEW.id, 'status', NEW.status,
                              'period_start', NEW.current_period_start, 'period_end', NEW.current_period_end)
    FROM orders o WHERE o.number = NEW.order_number
    ON CONFLICT DO NOTHING;
    RETURN NULL;
END
$$;

CREATE TRIGGER subscriptions_step_message
    AFTER UPDATE OF status ON subscriptions
    FOR EACH ROW
    WHEN (OLD.status IS DISTINCT FROM NEW.status)
    EXECUTE FUNCTION subscriptions_step_message();
