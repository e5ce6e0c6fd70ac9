-- Checks the existing events against 0006's constraints. VALIDATE CONSTRAINT takes a lock that
-- lets inserts go on, so webhooks keep landing while a large table is scanned.
ALTER TABLE payment_events VALIDATE CONSTRAINT payment_events_outcome_valid;
ALTER TABLE payment_events VALIDATE CONSTRAINT payment_events_processed_iff_final;
ALTER TABLE payment_events VALIDATE CONSTRAINT payment_events_waiting_for_iff_waiting;
