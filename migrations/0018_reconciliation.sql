-- Missed-webhook reconciliation. What a gateway says when asked is stored as an event of our
-- own, processed like a webhook; `source` tells them apart (a webhook can never be read as
-- one of ours, whatever its body says).
ALTER TABLE payment_events ADD COLUMN source text NOT NULL DEFAULT 'webhook'
    CHECK (source IN ('webhook', 'reconciliation'));

-- When the gateway was last asked about the session, so each run asks the least recently
-- checked first.
ALTER TABLE payment_sessions ADD COLUMN checked_at timestamptz;

-- What reconciliation found: payments no webhook reported (succeeded, failed) and gateways
-- that did not answer (unreachable) or refused the question (refused).
CREATE TABLE reconciliation_findings (
    id           bigserial   PRIMARY KEY,
    gateway      text        NOT NULL,
    session_id   text        NOT NULL,
    order_number bigint      NOT NULL,
    outcome      text        NOT NULL CHECK (outcome IN ('succeeded', 'failed', 'unreachable', 'refused')),
    detail       text        NOT NULL,
    found_at     timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX reconciliation_findings_recent ON reconciliation_findings (found_at);
