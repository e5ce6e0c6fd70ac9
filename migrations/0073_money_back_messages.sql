-- An order whose money went back is an order message too, as its `paid` was: `refunded` (the
-- whole of it refunded) and `charged_back` (a dispute lost), once each. Written by the database
-- in the transaction that moves the order, whichever path moves it (a gateway's refund, an
-- operator's, a coin refund, a dispute): a service that shipped on `paid` learns the money went
-- back.
ALTER TABLE order_events DROP CONSTRAINT order_events_kind_check;
ALTER TABLE order_events ADD CONSTRAINT order_events_kind_check CHECK (kind IN
    ('created', 'paid', 'expired', 'late_payment', 'extra_payment', 'reopened',
     'past_due', 'reactivated', 'canceled', 'refunded', 'charged_back'));

CREATE FUNCTION orders_money_back_message() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO order_events (order_id, kind, payload)
    VALUES (NEW.id, NEW.status,
            jsonb_build_object('number', NEW.number, 'amount_refunded', NEW.amount_refunded))
    ON CONFLICT DO NOTHING;
    RETURN NULL;
END
$$;

CREATE TRIGGER orders_money_back_message
    AFTER UPDATE OF status ON orders
    FOR EACH ROW
    WHEN (OLD.status IS DISTINCT FROM NEW.status AND NEW.status IN ('refunded', 'charged_back'))
    EXECUTE FUNCTION orders_money_back_message();
