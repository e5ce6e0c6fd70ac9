-- The database as the last barrier: the money rules the code keeps under its locks, refused by
-- the schema too, so that no future bug (or hand-written statement) can break them.

-- 1. Each transfer is exactly two entries, summing to zero, on the transfer's own two accounts
--    (from: -amount, to: +amount), all in the transfer's currency. Checked at commit (a
--    transfer and its entries are written by separate statements of one transaction).
CREATE FUNCTION ledger_transfer_balanced(transfer bigint) RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    t ledger_transfers%ROWTYPE;
    bad text;
BEGIN
    SELECT * INTO t FROM ledger_transfers WHERE id = transfer;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'ledger entry of transfer % which does not exist', transfer
            USING ERRCODE = 'check_violation', CONSTRAINT = 'ledger_transfer_balanced';
    END IF;
    SELECT CASE
             WHEN count(*) <> 2 THEN format('%s entries, not 2', count(*))
             WHEN sum(e.amount) <> 0 THEN format('entries summing to %s, not 0', sum(e.amount))
             WHEN bool_or(a.currency <> t.currency) THEN 'an entry on an account of another currency'
             WHEN NOT bool_or(e.account_id = t.from_account AND e.amount = -t.amount)
               OR NOT bool_or(e.account_id = t.to_account AND e.amount = t.amount)
               THEN 'entries that are not its accounts'' debit and credit'
           END
      INTO bad
      FROM ledger_entries e JOIN ledger_accounts a ON a.id = e.account_id
     WHERE e.transfer_id = transfer;
    IF bad IS NOT NULL THEN
        RAISE EXCEPTION 'transfer % (%) has %', transfer, t.source_key, bad
            USING ERRCODE = 'check_violation', CONSTRAINT = 'ledger_transfer_balanced';
    END IF;
END;
$$;

CREATE FUNCTION ledger_transfer_balanced_on_transfer() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM ledger_transfer_balanced(NEW.id);
    RETURN NULL;
END;
$$;

CREATE FUNCTION ledger_transfer_balanced_on_entry() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM ledger_transfer_balanced(NEW.transfer_id);
    RETURN NULL;
END;
$$;

CREATE CONSTRAINT TRIGGER ledger_transfers_balanced AFTER INSERT ON ledger_transfers
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION ledger_transfer_balanced_on_transfer();
CREATE CONSTRAINT TRIGGER ledger_entries_balanced AFTER INSERT ON ledger_entries
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION ledger_transfer_balanced_on_entry();

-- 2. An account's balance moves only with its entries: each entry starts where the account's
--    previous one ended (0 for its first), and the balance is always its last entry's
--    balance_after. (Entries of an account are written under its row lock, one at a time.)
CREATE FUNCTION ledger_entry_follows() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    previous numeric;
BEGIN
    SELECT balance_after INTO previous FROM ledger_entries
     WHERE account_id = NEW.account_id ORDER BY id DESC LIMIT 1;
    IF COALESCE(previous, 0) <> NEW.balance_before THEN
        RAISE EXCEPTION 'an entry of account % starts at %, where its last one ended at %',
            NEW.account_id, NEW.balance_before, COALESCE(previous, 0)
            USING ERRCODE = 'check_violation', CONSTRAINT = 'ledger_entries_follow';
    END IF;
    RETURN NEW;
END;
$$;

CREATE TRIGGER ledger_entries_follow BEFORE INSERT ON ledger_entries
    FOR EACH ROW EXECUTE FUNCTION ledger_entry_follows();

CREATE FUNCTION ledger_account_guard() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    last numeric;
BEGIN
    IF TG_OP = 'DELETE' THEN
        RAISE EXCEPTION 'ledger accounts are never deleted'
            USING ERRCODE = 'raise_exception';
    END IF;
    IF NEW.kind <> OLD.kind OR NEW.owner <> OLD.owner OR NEW.currency <> OLD.currency THEN
        RAISE EXCEPTION 'a ledger account''s kind, owner and currency are fixed'
            USING ERRCODE = 'check_violation', CONSTRAINT = 'ledger_accounts_fixed';
    END IF;
    IF NEW.balance <> OLD.balance THEN
        SELECT balance_after INTO last FROM ledger_entries
         WHERE account_id = NEW.id ORDER BY id DESC LIMIT 1;
        IF last IS NULL OR last <> NEW.balance THEN
            RAISE EXCEPTION 'account % would hold %, not its last entry''s balance %',
                NEW.id, NEW.balance, last
                USING ERRCODE = 'check_violation', CONSTRAINT = 'ledger_accounts_balance_is_entries';
        END IF;
    END IF;
    RETURN NEW;
END;
$$;

CREATE TRIGGER ledger_accounts_guard BEFORE UPDATE OR DELETE ON ledger_accounts
    FOR EACH ROW EXECUTE FUNCTION ledger_account_guard();

-- 3. The refunds of a payment never exceed it, and the refund requests under way or done never
--    exceed what was captured.
CREATE FUNCTION payment_refunds_within() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    paid numeric;
    refunded numeric;
BEGIN
    SELECT amount INTO paid FROM payment_orders WHERE id = NEW.payment_order_id;
    SELECT sum(amount) INTO refunded FROM payment_refunds WHERE payment_order_id = NEW.payment_order_id;
    IF paid IS NULL OR refunded > paid THEN
        RAISE EXCEPTION 'refunds of payment % would reach %, more than the % paid',
            NEW.payment_order_id, refunded, COALESCE(paid, 0)
            USING ERRCODE = 'check_violation', CONSTRAINT = 'payment_refunds_within_payment';
    END IF;
    RETURN NULL;
END;
$$;

CREATE CONSTRAINT TRIGGER payment_refunds_within_payment AFTER INSERT ON payment_refunds
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION payment_refunds_within();

CREATE FUNCTION refund_requests_within() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    captured numeric;
    asked numeric;
BEGIN
    SELECT amount INTO captured FROM payment_orders
     WHERE gateway = NEW.gateway AND session_id = NEW.session_id;
    SELECT sum(amount) INTO asked FROM refund_requests
     WHERE gateway = NEW.gateway AND session_id = NEW.session_id
       AND state IN ('requested', 'accepted', 'succeeded');
    IF captured IS NULL OR asked > captured THEN
        RAISE EXCEPTION 'refund requests of session % would reach %, more than the % captured',
            NEW.session_id, asked, COALESCE(captured, 0)
            USING ERRCODE = 'check_violation', CONSTRAINT = 'refund_requests_within_capture';
    END IF;
    RETURN NULL;
END;
$$;

CREATE CONSTRAINT TRIGGER refund_requests_within_capture AFTER INSERT OR UPDATE ON refund_requests
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION refund_requests_within();

-- 4. Every money record is immutable once written (a correction is a new record), beside the
--    ledger's own: refunds, invoices and their lines and totals, and a payout but for its one
--    decision (pending to paid or failed, once).
CREATE TRIGGER payment_refunds_immutable BEFORE UPDATE OR DELETE ON payment_refunds
    FOR EACH ROW EXECUTE FUNCTION ledger_immutable();
CREATE TRIGGER second_payment_refunds_immutable BEFORE UPDATE OR DELETE ON second_payment_refunds
    FOR EACH ROW EXECUTE FUNCTION ledger_immutable();
CREATE TRIGGER invoices_immutable BEFORE UPDATE OR DELETE ON invoices
    FOR EACH ROW EXECUTE FUNCTION ledger_immutable();
CREATE TRIGGER invoice_lines_immutable BEFORE UPDATE OR DELETE ON invoice_lines
    FOR EACH ROW EXECUTE FUNCTION ledger_immutable();
CREATE TRIGGER invoice_totals_immutable BEFORE UPDATE OR DELETE ON invoice_totals
    FOR EACH ROW EXECUTE FUNCTION ledger_immutable();

-- Payouts link to their transfers: the debit that sent them, and the transfer that decided
-- them (paid to the bank, or back to the seller).
ALTER TABLE payouts ADD COLUMN debit_transfer_id bigint REFERENCES ledger_transfers (id);
ALTER TABLE payouts ADD COLUMN decided_transfer_id bigint REFERENCES ledger_transfers (id);
UPDATE payouts p SET debit_transfer_id = t.id FROM ledger_transfers t WHERE t.source_key = 'payout:' || p.id;
UPDATE payouts p SET decided_transfer_id = t.id FROM ledger_transfers t
 WHERE t.source_key IN ('payout_paid:' || p.id, 'payout_failed:' || p.id);
ALTER TABLE payouts ADD CONSTRAINT payouts_decided_by_transfer
    CHECK ((state = 'pending') = (decided_transfer_id IS NULL));

CREATE FUNCTION payout_guard() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'DELETE' THEN
        RAISE EXCEPTION 'payouts are never deleted' USING ERRCODE = 'raise_exception';
    END IF;
    IF NEW.seller_id <> OLD.seller_id OR NEW.currency <> OLD.currency OR NEW.amount <> OLD.amount
       OR NEW.period_start <> OLD.period_start
       OR (OLD.debit_transfer_id IS NOT NULL AND NEW.debit_transfer_id IS DISTINCT FROM OLD.debit_transfer_id)
       OR (OLD.state <> 'pending' AND (NEW.state <> OLD.state OR NEW.decided_transfer_id IS DISTINCT FROM OLD.decided_transfer_id
                                       OR NEW.failure IS DISTINCT FROM OLD.failure)) THEN
        RAISE EXCEPTION 'payout %: only its debit is linked once and its state decided once', OLD.id
            USING ERRCODE = 'check_violation', CONSTRAINT = 'payouts_decided_once';
    END IF;
    RETURN NEW;
END;
$$;

CREATE TRIGGER payouts_guard BEFORE UPDATE OR DELETE ON payouts
    FOR EACH ROW EXECUTE FUNCTION payout_guard();

-- A payout is sent by its debit, of its amount, by commit.
CREATE FUNCTION payout_has_debit() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    p payouts%ROWTYPE;
BEGIN
    SELECT * INTO p FROM payouts WHERE id = NEW.id;
    IF NOT EXISTS (SELECT 1 FROM ledger_transfers t
                    WHERE t.id = p.debit_transfer_id AND t.kind = 'payout_debit' AND t.amount = p.amount) THEN
        RAISE EXCEPTION 'payout % has no debit of its % in the ledger', p.id, p.amount
            USING ERRCODE = 'check_violation', CONSTRAINT = 'payouts_have_their_debit';
    END IF;
    RETURN NULL;
END;
$$;

CREATE CONSTRAINT TRIGGER payouts_have_their_debit AFTER INSERT ON payouts
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION payout_has_debit();
