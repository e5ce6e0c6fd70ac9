-- An order whose money went back is an order message too, as its `paid` was: `refunded` (the
-- whole of it refunded) and `charged_back` (a dispute lost), once each (the unique index
-- `order_events_once` applies to both). Written in the transaction that moves the order
-- (`orders::apply_payment`, `orders::coin_payment::record_refund`): a service that shipped on
-- `paid` learns the money went back.
ALTER TABLE order_events DROP CONSTRAINT order_events_kind_check;
ALTER TABLE order_events ADD CONSTRAINT order_events_kind_check CHECK (kind IN
    ('created', 'paid', 'expired', 'late_payment', 'extra_payment', 'reopened',
     'past_due', 'reactivated', 'canceled', 'refunded', 'charged_back'));
