-- The refund barriers (0037, 0041) summed amounts without looking at their currency: a refund
-- recorded in another currency than its payment's (a gateway's report misread, a hand-written
-- statement) added its number to the payment's, and a refund request in another currency was
-- never held back from the seller's payouts (ledger::payouts reads them by currency). The code
-- refuses both (payments::apply, payments::order_refunds); now the schema does too. Replacing
-- a function takes no lock on the tables.
CREATE OR REPLACE FUNCTION payment_refunds_within() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    paid numeric;
    paid_currency text;
    refunded numeric;
BEGIN
    SELECT amount, currency INTO paid, paid_currency FROM payment_orders WHERE id = NEW.payment_order_id;
    SELECT sum(amount) INTO refunded FROM payment_refunds WHERE payment_order_id = NEW.payment_order_id;
    IF paid IS NULL OR refunded > paid OR NEW.currency IS DISTINCT FROM paid_currency THEN
        RAISE EXCEPTION 'refunds of payment % would reach % %, more than (or not in the currency of) the % % paid',
            NEW.payment_order_id, refunded, NEW.currency, COALESCE(paid, 0), paid_currency
            USING ERRCODE = 'check_violation', CONSTRAINT = 'payment_refunds_within_payment';
    END IF;
    RETURN NULL;
END;
$$;

CREATE OR REPLACE FUNCTION refund_requests_within() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    captured numeric;
    captured_currency text;
    asked numeric;
BEGIN
    IF NEW.paid_with = 'coins' THEN
        SELECT total, currency INTO captured, captured_currency FROM orders
         WHERE number = NEW.order_number AND paid_with_coins;
        SELECT sum(amount) INTO asked FROM refund_requests
         WHERE order_number = NEW.order_number AND paid_with = 'coins' AND state = 'succeeded';
    ELSE
        SELECT amount, currency INTO captured, captured_currency FROM payment_orders
         WHERE gateway = NEW.gateway AND session_id = NEW.session_id;
        SELECT sum(amount) INTO asked FROM refund_requests
         WHERE gateway = NEW.gateway AND session_id = NEW.session_id
           AND state IN ('requested', 'accepted', 'succeeded');
    END IF;
    IF captured IS NULL OR asked > captured OR NEW.currency IS DISTINCT FROM captured_currency THEN
        RAISE EXCEPTION 'refund requests of order % would reach % %, more than (or not in the currency of) the % % paid',
            NEW.order_number, asked, NEW.currency, COALESCE(captured, 0), captured_currency
            USING ERRCODE = 'check_violation', CONSTRAINT = 'refund_requests_within_capture';
    END IF;
    RETURN NULL;
END;
$$;
