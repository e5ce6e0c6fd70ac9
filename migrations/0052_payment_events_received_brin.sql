-- The dashboard's hour of throughput reads the events received (and processed) in the last
-- hour or two. The table only grows, in receipt order, so a BRIN index (a few pages, whatever
-- the table's size) finds that tail without reading the rest.
CREATE INDEX payment_events_received_brin ON payment_events USING brin (received_at);
