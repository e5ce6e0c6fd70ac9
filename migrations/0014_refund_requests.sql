-- Refunds an operator asks for. The request is written (with the job that carries it out) before
-- the gateway is called, under the order's lock and within what is left to refund, so two
-- requests can never refund more than was paid; the gateway is asked with the request's own
-- idempotency key, so asking again (a retry, the job after the request itself) refunds once.
CREATE TABLE refund_requests (
    id              bigserial     PRIMARY KEY,
    -- The caller's Idempotency-Key: the same key is the same request.
    idempotency_key text          NOT NULL UNIQUE CHECK (idempotency_key <> '' AND length(idempotency_key) <= 255),
    order_number    bigint        NOT NULL REFERENCES orders (number),
    gateway         text          NOT NULL,
    session_id      text          NOT NULL,
    payment_id      text          NOT NULL,
    amount          numeric(20, 4) NOT NULL CHECK (amount > 0),
    currency        char(3)       NOT NULL,
    reason          text          NOT NULL DEFAULT '' CHECK (length(reason) <= 500),
    -- The key the gateway is asked with: random, so two deployments behind one gateway account
    -- never share one.
    gateway_key     uuid          NOT NULL DEFAULT gen_random_uuid(),
    -- requested: not yet answered by the gateway; accepted: the gateway took it and reports the
    -- outcome by its refund event; succeeded: refunded and recorded; failed: the gateway refused.
    state           text          NOT NULL DEFAULT 'requested'
                                  CHECK (state IN ('requested', 'accepted', 'succeeded', 'failed')),
    refund_id       text,
    failure         text,
    created_at      timestamptz   NOT NULL DEFAULT now(),
    updated_at      timestamptz   NOT NULL DEFAULT now(),
    CONSTRAINT refund_requests_answered CHECK ((state IN ('accepted', 'succeeded')) = (refund_id IS NOT NULL)),
    CONSTRAINT refund_requests_failure_reason CHECK ((state = 'failed') = (failure IS NOT NULL))
);

CREATE INDEX refund_requests_order ON refund_requests (order_number);
CREATE UNIQUE INDEX refund_requests_refund ON refund_requests (gateway, refund_id) WHERE refund_id IS NOT NULL;
