-- A subscription a gateway bills (Stripe's, started by a Checkout Session in subscription
-- mode) is named by the gateway's id in its renewals' events. The id is recorded on the
-- subscription's first payment, from that payment's own event (a field the seller cannot
-- edit), and a renewal finds its subscription through it: one first payment per gateway
-- subscription.
ALTER TABLE payment_orders ADD COLUMN subscription_ref text CHECK (subscription_ref <> '');
CREATE UNIQUE INDEX payment_orders_subscription_ref ON payment_orders (gateway, subscription_ref)
    WHERE subscription_ref IS NOT NULL;
