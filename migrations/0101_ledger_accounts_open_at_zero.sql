-- A ledger account opens at zero: its balance moves only with its entries (0037, 0044), and
-- those barriers look at updates. An account inserted holding a balance (a hand-written
-- statement, a future bug) would hold money no entry put there, and every later entry would run
-- on from it. Accounts are opened rarely (a new seller, a new currency): a row trigger costs
-- nothing on the postings' path, which finds its accounts already open.
CREATE FUNCTION ledger_accounts_open_at_zero() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.balance <> 0 THEN
        RAISE EXCEPTION 'ledger account % (% of %) would open holding %: an account opens at zero and moves only with its entries',
            NEW.id, NEW.kind, NEW.owner, NEW.balance
            USING ERRCODE = 'check_violation', CONSTRAINT = 'ledger_accounts_balance_is_entries';
    END IF;
    RETURN NEW;
END;
$$;

CREATE TRIGGER ledger_accounts_open_at_zero BEFORE INSERT ON ledger_accounts
    FOR EACH ROW EXECUTE FUNCTION ledger_accounts_open_at_zero();
