-- The time zone whose calendar months the commission invoices cover, recorded by the first
-- invoice made and checked by every one after it (ledger::invoices): a month of another zone
-- would overlap the months already invoiced (the fees in the overlap invoiced twice) or leave
-- hours between them (their fees never invoiced). A deployment upgraded with invoices made
-- has its zone recorded by the fleet's next `invoices` job (the zone those were made in); a
-- run by hand before that is refused.
CREATE TABLE invoice_calendar (
    singleton   boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    timezone    text NOT NULL CHECK (timezone <> ''),
    recorded_at timestamptz NOT NULL DEFAULT now()
);
