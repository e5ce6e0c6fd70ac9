-- A job may carry a fairness key (the seller of a payment event, say): within a queue, claims
-- take turns between keys, so one seller's flood cannot hold up another seller's payment.
-- A nullable column without a default is a catalogue change: the table is not rewritten. The
-- check is added NOT VALID (no scan under the exclusive lock) and validated in the next step.
ALTER TABLE jobs ADD COLUMN fairness_key text;
ALTER TABLE jobs ADD CONSTRAINT jobs_fairness_key_valid
    CHECK (fairness_key <> '' AND length(fairness_key) <= 200) NOT VALID;
