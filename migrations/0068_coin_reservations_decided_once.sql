-- A coin reservation is decided once, as a payout is: `reserved` becomes `approved` (its coins
-- spent) or `released` (given back), and a decided one stays as it is, as does a released
-- marker with no amount (a release that came before its reserve, which the late reserve must
-- find released). What a reservation holds (buyer, amount, currency, order) never changes, and
-- none is deleted: each is the record of coins held, spent or given back. The code keeps all
-- of this under the buyer's accounts' locks; the schema keeps it from a hand-written statement
-- or a later bug.
CREATE FUNCTION coin_reservation_guard() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'DELETE' THEN
        RAISE EXCEPTION 'coin reservations are never deleted' USING ERRCODE = 'raise_exception';
    END IF;
    IF NEW.id <> OLD.id OR NEW.buyer_id IS DISTINCT FROM OLD.buyer_id
       OR NEW.amount IS DISTINCT FROM OLD.amount OR NEW.currency IS DISTINCT FROM OLD.currency
       OR NEW.order_number IS DISTINCT FROM OLD.order_number OR NEW.created_at <> OLD.created_at
       OR (OLD.state <> 'reserved' AND (NEW.state <> OLD.state OR NEW.decided_at IS DISTINCT FROM OLD.decided_at)) THEN
        RAISE EXCEPTION 'coin reservation %: only its state is decided, once', OLD.id
            USING ERRCODE = 'check_violation', CONSTRAINT = 'coin_reservations_decided_once';
    END IF;
    RETURN NEW;
END;
$$;

CREATE TRIGGER coin_reservations_guard BEFORE UPDATE OR DELETE ON coin_reservations
    FOR EACH ROW EXECUTE FUNCTION coin_reservation_guard();
