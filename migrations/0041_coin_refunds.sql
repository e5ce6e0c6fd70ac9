-- Refunds of orders paid with coins. No gateway is asked: the coins go back to the buyer's wallet
-- (a `coins_refund` transfer, spent to wallet) and the seller is debited, in the request's own
-- transaction. Such a request has no gateway, session or payment; it names what paid instead.
ALTER TABLE ledger_transfers DROP CONSTRAINT ledger_transfers_kind_check;
ALTER TABLE ledger_transfers ADD CONSTRAINT ledger_transfers_kind_check CHECK (kind IN (
    'sale_credit', 'fee', 'refund_debit', 'fee_refund', 'dispute_debit', 'dispute_fee_debit',
    'dispute_reversal', 'dispute_fee_reversal', 'release', 'payout_debit', 'payout_paid',
    'payout_reversal', 'adjustment', 'connected_sale', 'coins_grant', 'coins_reserve',
    'coins_spend', 'coins_release', 'coins_refund'));

ALTER TABLE refund_requests
    ADD COLUMN paid_with text NOT NULL DEFAULT 'gateway' CHECK (paid_with IN ('gateway', 'coins')),
    ALTER COLUMN gateway DROP NOT NULL,
    ALTER COLUMN session_id DROP NOT NULL,
    ALTER COLUMN payment_id DROP NOT NULL,
    ADD CONSTRAINT refund_requests_paid_with CHECK (
        CASE paid_with
            WHEN 'gateway' THEN gateway IS NOT NULL AND session_id IS NOT NULL AND payment_id IS NOT NULL
            ELSE gateway IS NULL AND session_id IS NULL AND payment_id IS NULL AND state IN ('succeeded', 'failed')
        END);

-- A coin-paid order's refunds never exceed what its coins paid (its total).
CREATE OR REPLACE FUNCTION refund_requests_within() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    captured numeric;
    asked numeric;
BEGIN
    IF NEW.paid_with = 'coins' THEN
        SELECT total INTO captured FROM orders WHERE number = NEW.order_number AND paid_with_coins;
        SELECT sum(amount) INTO asked FROM refund_requests
         WHERE order_number = NEW.order_number AND paid_with = 'coins' AND state = 'succeeded';
    ELSE
        SELECT amount INTO captured FROM payment_orders
         WHERE gateway = NEW.gateway AND session_id = NEW.session_id;
        SELECT sum(amount) INTO asked FROM refund_requests
         WHERE gateway = NEW.gateway AND session_id = NEW.session_id
           AND state IN ('requested', 'accepted', 'succeeded');
    END IF;
    IF captured IS NULL OR asked > captured THEN
        RAISE EXCEPTION 'refund requests of order % would reach %, more than the % paid',
            NEW.order_number, asked, COALESCE(captured, 0)
            USING ERRCODE = 'check_violation', CONSTRAINT = 'refund_requests_within_capture';
    END IF;
    RETURN NULL;
END;
$$;
