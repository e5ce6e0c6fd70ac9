-- The immutable log of verified gateway webhooks. One row per (gateway, event id), however
-- often the gateway delivers it. Only the processing mark may change after insert.
CREATE TABLE payment_events (
    id            bigserial PRIMARY KEY,
    gateway       text        NOT NULL CHECK (gateway IN ('stripe', 'mercadopago', 'razorpay', 'internal', 'mock')),
    event_id      text        NOT NULL CHECK (event_id <> '' AND length(event_id) <= 255),
    event_type    text,
    -- The exact bytes that were signed; bytea, because a re-serialised body is a different body.
    raw_body      bytea       NOT NULL,
    -- The headers that carried the signature and the delivery's identity.
    headers       jsonb       NOT NULL DEFAULT '{}'::jsonb,
    received_at   timestamptz NOT NULL DEFAULT now(),
    processed_at  timestamptz,
    -- What processing concluded: applied (changed payment or order state), ignored (nothing to
    -- do: an event type we do not act on, or a fact already known).
    outcome       text,
    outcome_detail text,
    CONSTRAINT payment_events_gateway_event_id_key UNIQUE (gateway, event_id),
    CONSTRAINT payment_events_outcome_iff_processed
        CHECK ((processed_at IS NULL) = (outcome IS NULL)),
    CONSTRAINT payment_events_outcome_valid
        CHECK (outcome IS NULL OR outcome IN ('applied', 'ignored'))
);

CREATE INDEX payment_events_unprocessed ON payment_events (received_at) WHERE processed_at IS NULL;

CREATE FUNCTION payment_events_immutable() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'DELETE' THEN
        RAISE EXCEPTION 'payment_events is append-only' USING ERRCODE = 'raise_exception';
    END IF;
    IF NEW.gateway IS DISTINCT FROM OLD.gateway OR NEW.event_id IS DISTINCT FROM OLD.event_id
       OR NEW.raw_body IS DISTINCT FROM OLD.raw_body OR NEW.headers IS DISTINCT FROM OLD.headers
       OR NEW.received_at IS DISTINCT FROM OLD.received_at OR NEW.event_type IS DISTINCT FROM OLD.event_type THEN
        RAISE EXCEPTION 'payment_events rows are immutable (event %)', OLD.id USING ERRCODE = 'raise_exception';
    END IF;
    IF OLD.processed_at IS NOT NULL AND NEW.processed_at IS DISTINCT FROM OLD.processed_at THEN
        RAISE EXCEPTION 'payment event % is already processed', OLD.id USING ERRCODE = 'raise_exception';
    END IF;
    RETURN NEW;
END;
$$;

CREATE TRIGGER payment_events_immutable BEFORE UPDATE OR DELETE ON payment_events
    FOR EACH ROW EXECUTE FUNCTION payment_events_immutable();
