-- When the payment side first asked an outside gateway for an order attempt's session. A
-- gateway whose session must outlive its creation by a minimum (Stripe's 30 minutes) gets an
-- expiry computed from this time, not from the moment of each call: a retry (its answer lost
-- to a timeout, or never stored) asks with the same idempotency key and the same parameters,
-- which the gateway answers with the session it made. Kept two days (longer than a gateway
-- keeps an idempotency key), then pruned by the housekeeping.
CREATE TABLE payment_link_asks (
    gateway        text        NOT NULL,
    link_key       text        NOT NULL CHECK (link_key <> ''),
    first_asked_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (gateway, link_key)
);
CREATE INDEX payment_link_asks_age ON payment_link_asks (first_asked_at);
