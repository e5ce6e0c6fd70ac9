-- Events that cannot be applied yet, or ever, are kept visibly instead of being retried until
-- their job dies:
--   waiting   it refers to a payment not known to have succeeded yet (a refund or dispute that
--             arrived first); applied when that payment's event is processed, however late.
--             `waiting_for` names what it waits for: 'session:<id>' or 'payment:<id>'.
--   rejected  it can never be applied as it is (a refund larger than its payment, an amount in
--             another currency, a value beyond a column). Kept with its reason; an operator
--             replays it after a fix.
-- Only applied and ignored are final (processed_at set); the others can be processed again.
ALTER TABLE payment_events
    DROP CONSTRAINT payment_events_outcome_iff_processed,
    DROP CONSTRAINT payment_events_outcome_valid,
    ADD COLUMN waiting_for text CHECK (waiting_for <> ''),
    -- NOT VALID: checked for new rows now, for the existing ones by 0007 under a lock that
    -- lets webhooks keep landing (payment_events only grows).
    ADD CONSTRAINT payment_events_outcome_valid
        CHECK (outcome IS NULL OR outcome IN ('applied', 'ignored', 'waiting', 'rejected')) NOT VALID,
    ADD CONSTRAINT payment_events_processed_iff_final
        CHECK ((processed_at IS NOT NULL) = COALESCE(outcome IN ('applied', 'ignored'), false)) NOT VALID,
    ADD CONSTRAINT payment_events_waiting_for_iff_waiting
        CHECK ((waiting_for IS NOT NULL) = COALESCE(outcome = 'waiting', false)) NOT VALID;

-- A processed event is final: neither its mark nor its outcome may change.
CREATE OR REPLACE FUNCTION payment_events_immutable() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'DELETE' THEN
        RAISE EXCEPTION 'payment_events is append-only' USING ERRCODE = 'raise_exception';
    END IF;
    IF NEW.gateway IS DISTINCT FROM OLD.gateway OR NEW.event_id IS DISTINCT FROM OLD.event_id
       OR NEW.raw_body IS DISTINCT FROM OLD.raw_body OR NEW.headers IS DISTINCT FROM OLD.headers
       OR NEW.received_at IS DISTINCT FROM OLD.received_at OR NEW.event_type IS DISTINCT FROM OLD.event_type THEN
        RAISE EXCEPTION 'payment_events rows are immutable (event %)', OLD.id USING ERRCODE = 'raise_exception';
    END IF;
    IF OLD.processed_at IS NOT NULL AND (NEW.processed_at IS DISTINCT FROM OLD.processed_at
       OR NEW.outcome IS DISTINCT FROM OLD.outcome OR NEW.outcome_detail IS DISTINCT FROM OLD.outcome_detail
       OR NEW.waiting_for IS DISTINCT FROM OLD.waiting_for) THEN
        RAISE EXCEPTION 'payment event % is already processed', OLD.id USING ERRCODE = 'raise_exception';
    END IF;
    RETURN NEW;
END;
$$;

-- A dispute closed because the buyer was refunded: the refunds carry the money.
ALTER TABLE payment_disputes
    DROP CONSTRAINT payment_disputes_status_check,
    ADD CONSTRAINT payment_disputes_status_valid CHECK (status IN ('open', 'won', 'lost', 'refunded'));

-- This migration also taught the queue's jobs_next_state to raise on an outcome it does not
-- know: that part moved with the queue's schema to crates/queue/migrations (db.rs accepts the
-- checksum this file had before the move).
