-- A dispute is decided once: only an open one's status moves (to won, lost or refunded), and
-- what it disputes, its amount and currency and what had been refunded before it never change;
-- none is deleted. The ledger's take-backs (ledger::sales::settle_take_backs) and the payouts'
-- holds read a decided dispute's status as final: one reopened, or its amount changed, would
-- make them take from the seller again under posting keys already used, and the seller's
-- balance would silently stop matching the disputes. The code decides only open ones
-- (payments::apply::decide_dispute); this is the last word on it, for either payment's disputes.
-- Every payment event's transaction reads these tables: the triggers wait at most 2 s for them,
-- and the migration is retried rather than queue the fleet behind it.
SET LOCAL lock_timeout = '2s';

CREATE FUNCTION dispute_guard() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'DELETE' THEN
        RAISE EXCEPTION 'disputes are never deleted' USING ERRCODE = 'raise_exception';
    END IF;
    IF (to_jsonb(NEW) - 'status' - 'updated_at' - 'checked_at')
           IS DISTINCT FROM (to_jsonb(OLD) - 'status' - 'updated_at' - 'checked_at')
       OR (NEW.status <> OLD.status AND OLD.status <> 'open') THEN
        RAISE EXCEPTION 'dispute % (%): only an open one is decided, once, and nothing else of it changes',
                OLD.dispute_id, TG_TABLE_NAME
            USING ERRCODE = 'check_violation', CONSTRAINT = 'disputes_decided_once';
    END IF;
    RETURN NEW;
END;
$$;

CREATE TRIGGER payment_disputes_guard BEFORE UPDATE OR DELETE ON payment_disputes
    FOR EACH ROW EXECUTE FUNCTION dispute_guard();
CREATE TRIGGER second_payment_disputes_guard BEFORE UPDATE OR DELETE ON second_payment_disputes
    FOR EACH ROW EXECUTE FUNCTION dispute_guard();
