-- A refund the gateway reported failed or canceled, by its id: ended for good (a gateway never
-- takes such a refund up again). A `succeeded` report of the same refund arriving later (a
-- delivery retried for hours, an old `charge.refunded` snapshot of the refunds list) must not
-- record it as done; and one recorded done before its failure is reported stays visible to an
-- operator (the consistency check `refund_failed_after_done`), as the buyer may not have the
-- money back.
CREATE TABLE refunds_ended (
    gateway   text        NOT NULL,
    refund_id text        NOT NULL,
    state     text        NOT NULL CONSTRAINT refunds_ended_state CHECK (state IN ('failed', 'canceled')),
    ended_at  timestamptz NOT NULL DEFAULT now(),
    -- An operator paid the buyer back another way (`payfleet money refund-repaid`): the
    -- finding closes.
    repaid_at timestamptz,
    PRIMARY KEY (gateway, refund_id)
);
