-- A subscription's periods are whole intervals from its first period's start, counted in UTC
-- (orders::subscriptions::open_due): a month on from the 31st of January ends on the 28th of
-- February and the next on the 31st of March. The first period's end is counted the same way
-- here, whatever the server's or the session's time zone, so that later periods fall on the
-- same calendar (in a zone with daylight saving time a month could otherwise end an hour off
-- it). Replacing a function takes no lock on the tables.
CREATE OR REPLACE FUNCTION orders_start_subscription() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO subscriptions (order_number, seller_id, buyer_id, product_id, gateway, "interval",
                               amount, currency, current_period_start, current_period_end)
    SELECT NEW.number, NEW.seller_id, NEW.buyer_id, i.product_id, NEW.gateway, NEW."interval",
           NEW.subtotal, NEW.currency, NEW.paid_at,
           ((NEW.paid_at AT TIME ZONE 'UTC') + ('1 ' || NEW."interval")::interval) AT TIME ZONE 'UTC'
    FROM order_items i
    WHERE i.order_id = NEW.id AND i.line = 1
    ON CONFLICT (order_number) DO NOTHING;
    RETURN NULL;
END
$$;
