-- Validating takes a lock that lets writes go on.
ALTER TABLE jobs VALIDATE CONSTRAINT jobs_fairness_key_valid;
