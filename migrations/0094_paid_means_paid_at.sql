-- Rules the code keeps and other parts read, made the schema's, for the rows written from now
-- on (NOT VALID: no scan under the tables' locks; 0095 checks the rows already there):
-- - an order has `paid_at` exactly when it is in a paid state (0011 held one direction only):
--   the order_money view's `is_sale` and the poster read `paid_at`, and `apply_payment` takes a
--   set `paid_at` for "paid already";
-- - a payment's amount and currency are known together, and never less than what was refunded
--   of it (payments::apply reads an amount without a currency as not captured);
-- - a seller's sale credit names its order and when it becomes available: the release job
--   selects by `available_at` and keys its releases by order number, and a credit without them
--   would stay pending for ever or stop every release run.
SET LOCAL lock_timeout = '2s';

ALTER TABLE orders ADD CONSTRAINT orders_paid_at_only_when_paid CHECK (
    paid_at IS NULL OR status IN ('paid', 'partially_refunded', 'refunded', 'disputed', 'charged_back')) NOT VALID;
ALTER TABLE payment_orders ADD CONSTRAINT payment_orders_amount_with_currency CHECK (
    (amount IS NULL) = (currency IS NULL)) NOT VALID;
ALTER TABLE payment_orders ADD CONSTRAINT payment_orders_refunded_within_amount CHECK (
    amount IS NULL OR amount_refunded <= amount) NOT VALID;
ALTER TABLE ledger_transfers ADD CONSTRAINT ledger_transfers_sale_credit_complete CHECK (
    kind <> 'sale_credit' OR (available_at IS NOT NULL AND order_number IS NOT NULL)) NOT VALID;
