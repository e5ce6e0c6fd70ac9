-- The idempotency key a give-back (payments::refunds::RefundPayment) asks its gateway under.
-- One per payment, so that a retry after a timeout never refunds twice. But a gateway keeps the
-- answer to a request that ran under a key (Stripe for at least a day, 4xx answers included):
-- a give-back the gateway refused outright (the payment not refundable yet, the seller's
-- account restricted, a balance too low), re-driven under the same key once the cause is
-- mended (`payfleet money give-back`), would get the same refusal back for as long as the
-- gateway keeps the key. So each outright refusal is counted, and the next ask goes under a key
-- of its own (`-<refusals>`). Once an ask under the current key ended without a clear answer
-- (a timeout, a 5xx, an answer that cannot be read), the gateway may have made the refund
-- under it, and a later 4xx under it may only say that the request differs from the one it
-- took (Razorpay's "different request with the same idempotency key"): the key is pinned, kept
-- for good, and no refusal moves it on.
CREATE TABLE give_back_keys (
    gateway text NOT NULL,
    -- The give-back's subject: its session, or `<session>:<payment>` for a second payment.
    subject text NOT NULL,
    refusals integer NOT NULL DEFAULT 0 CHECK (refusals >= 0),
    pinned boolean NOT NULL DEFAULT false,
    last_refusal text,
    updated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (gateway, subject)
);
