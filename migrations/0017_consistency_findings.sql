-- What the consistency checks found: one open row per (check, subject) while the violation
-- lasts, resolved by the first run that no longer sees it, kept afterwards for the record.
CREATE TABLE consistency_findings (
    id          bigserial   PRIMARY KEY,
    check_name  text        NOT NULL CHECK (check_name <> ''),
    subject     text        NOT NULL CHECK (subject <> ''),
    detail      text        NOT NULL,
    first_seen  timestamptz NOT NULL DEFAULT now(),
    last_seen   timestamptz NOT NULL DEFAULT now(),
    resolved_at timestamptz,
    CONSTRAINT consistency_findings_seen_in_order CHECK (last_seen >= first_seen)
);

CREATE UNIQUE INDEX consistency_findings_open ON consistency_findings (check_name, subject)
    WHERE resolved_at IS NULL;
