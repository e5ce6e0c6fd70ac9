-- The ledger: double entry. Every movement of money is one transfer of a positive amount from
-- one account to another in the same currency, under a unique source key (the same source can
-- never post twice), and immutable: a correction is another transfer. Every transfer writes one
-- entry per account with the balance before and after, so per account the entries sum to the
-- balance, and per currency all balances sum to zero.

CREATE TABLE ledger_accounts (
    id        bigserial     PRIMARY KEY,
    -- gateway_clearing: money a gateway took for the platform (merchant of record)
    -- connected_clearing: sales a gateway paid straight to the seller (Stripe Connect), reported
    -- platform_revenue: the platform's commission
    -- seller_pending / seller_available: what the platform owes a seller, before and after the
    --   holding period; seller_connected: a seller's sales paid straight to them (reporting)
    -- payouts_in_transit: payouts sent, not yet confirmed by the bank
    -- bank: money that left the platform (payouts paid)
    -- coins_issued / buyer_wallet / coins_reserved / coins_spent: the internal coins
    kind      text          NOT NULL CHECK (kind IN (
                  'gateway_clearing', 'connected_clearing', 'platform_revenue', 'seller_pending',
                  'seller_available', 'seller_connected', 'payouts_in_transit', 'bank',
                  'coins_issued', 'buyer_wallet', 'coins_reserved', 'coins_spent')),
    -- The seller's id, the buyer's id, the gateway's name, or 'platform'.
    owner     text          NOT NULL CHECK (owner <> ''),
    currency  char(3)       NOT NULL CHECK (currency ~ '^[A-Z]{3}$'),
    balance   numeric(20, 4) NOT NULL DEFAULT 0,
    updated_at timestamptz  NOT NULL DEFAULT now(),
    CONSTRAINT ledger_accounts_key UNIQUE (kind, owner, currency),
    -- The last barrier: a buyer's coins never go below zero, whatever a caller forgot.
    CONSTRAINT ledger_accounts_wallet_not_negative CHECK (kind NOT IN ('buyer_wallet', 'coins_reserved') OR balance >= 0)
);

CREATE TABLE ledger_transfers (
    id           bigserial     PRIMARY KEY,
    source_key   text          NOT NULL UNIQUE CHECK (source_key <> ''),
    kind         text          NOT NULL CHECK (kind IN (
                     'sale_credit', 'fee', 'refund_debit', 'fee_refund', 'dispute_debit', 'dispute_fee_debit',
                     'dispute_reversal', 'dispute_fee_reversal', 'release', 'payout_debit', 'payout_paid',
                     'payout_reversal', 'adjustment', 'connected_sale', 'coins_grant', 'coins_reserve',
                     'coins_spend', 'coins_release')),
    from_account bigint        NOT NULL REFERENCES ledger_accounts (id),
    to_account   bigint        NOT NULL REFERENCES ledger_accounts (id),
    amount       numeric(20, 4) NOT NULL CHECK (amount > 0),
    currency     char(3)       NOT NULL,
    -- For a sale credit: when it becomes available for payout (after the holding period).
    available_at timestamptz,
    -- What it is about, for readers: order number, refund id, payout id.
    order_number bigint,
    reference    text,
    created_at   timestamptz   NOT NULL DEFAULT now(),
    CONSTRAINT ledger_transfers_two_accounts CHECK (from_account <> to_account)
);

CREATE INDEX ledger_transfers_order ON ledger_transfers (order_number) WHERE order_number IS NOT NULL;
-- Transfers by posting time, for the invoice runs.
CREATE INDEX ledger_transfers_created ON ledger_transfers (created_at);
-- Sale credits waiting for their holding period, for the release job.
CREATE INDEX ledger_transfers_maturing ON ledger_transfers (available_at) WHERE kind = 'sale_credit';

CREATE TABLE ledger_entries (
    id             bigserial     PRIMARY KEY,
    transfer_id    bigint        NOT NULL REFERENCES ledger_transfers (id),
    account_id     bigint        NOT NULL REFERENCES ledger_accounts (id),
    -- Signed: negative for the account money left, positive for the one it reached.
    amount         numeric(20, 4) NOT NULL CHECK (amount <> 0),
    balance_before numeric(20, 4) NOT NULL,
    balance_after  numeric(20, 4) NOT NULL,
    created_at     timestamptz   NOT NULL DEFAULT now(),
    CONSTRAINT ledger_entries_balance_moves_by_amount CHECK (balance_after = balance_before + amount),
    CONSTRAINT ledger_entries_once_per_account UNIQUE (transfer_id, account_id)
);

CREATE INDEX ledger_entries_account ON ledger_entries (account_id, id);

-- Transfers, entries and balances only ever grow: no update or delete of a posted movement.
CREATE FUNCTION ledger_immutable() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION '% rows are immutable: post a correcting transfer instead', TG_TABLE_NAME
        USING ERRCODE = 'raise_exception';
END;
$$;

CREATE TRIGGER ledger_transfers_immutable BEFORE UPDATE OR DELETE ON ledger_transfers
    FOR EACH ROW EXECUTE FUNCTION ledger_immutable();
CREATE TRIGGER ledger_entries_immutable BEFORE UPDATE OR DELETE ON ledger_entries
    FOR EACH ROW EXECUTE FUNCTION ledger_immutable();

-- Refunds recorded from our own call to the gateway have no event (the webhook that follows is
-- then a fact already known).
ALTER TABLE payment_refunds ALTER COLUMN event_id DROP NOT NULL;

-- Payouts: one per seller, currency and payout period.
CREATE TABLE payouts (
    id            bigserial     PRIMARY KEY,
    seller_id     uuid          NOT NULL REFERENCES sellers (id),
    currency      char(3)       NOT NULL,
    -- The first day of the payout period (a day, an ISO week, a month).
    period_start  date          NOT NULL,
    amount        numeric(20, 4) NOT NULL CHECK (amount > 0),
    state         text          NOT NULL DEFAULT 'pending' CHECK (state IN ('pending', 'paid', 'failed')),
    failure       text,
    created_at    timestamptz   NOT NULL DEFAULT now(),
    decided_at    timestamptz,
    CONSTRAINT payouts_once_per_period UNIQUE (seller_id, currency, period_start),
    CONSTRAINT payouts_decided CHECK ((state = 'pending') = (decided_at IS NULL)),
    CONSTRAINT payouts_failure_reason CHECK ((state = 'failed') = (failure IS NOT NULL))
);

-- Commission invoices: one per seller and period, numbered without gaps.
CREATE TABLE invoice_numbers (
    singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    last      bigint  NOT NULL CHECK (last >= 0)
);
INSERT INTO invoice_numbers VALUES (true, 0);

CREATE TABLE invoices (
    id           bigserial   PRIMARY KEY,
    number       bigint      NOT NULL UNIQUE CHECK (number > 0),
    seller_id    uuid        NOT NULL REFERENCES sellers (id),
    period_start date        NOT NULL,
    period_end   date        NOT NULL CHECK (period_end > period_start),
    created_at   timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT invoices_once_per_period UNIQUE (seller_id, period_start)
);

CREATE TABLE invoice_lines (
    invoice_id   bigint        NOT NULL REFERENCES invoices (id),
    line         integer       NOT NULL CHECK (line > 0),
    order_number bigint        NOT NULL,
    currency     char(3)       NOT NULL,
    -- The commission charged on the order in the period (negative: given back with a refund).
    commission   numeric(20, 4) NOT NULL,
    description  text          NOT NULL,
    PRIMARY KEY (invoice_id, line)
);

CREATE TABLE invoice_totals (
    invoice_id bigint        NOT NULL REFERENCES invoices (id),
    currency   char(3)       NOT NULL,
    commission numeric(20, 4) NOT NULL,
    PRIMARY KEY (invoice_id, currency)
);

-- Internal coins: reservations are idempotent by their id; the wallet balances are ledger
-- accounts (buyer_wallet, coins_reserved) that a CHECK keeps at or above zero. A release of a
-- reservation never made (its reserve lost in transit, or still in flight) leaves a released
-- row with no amount, so that the late reserve finds it released instead of holding coins for
-- an order that is gone.
CREATE TABLE coin_reservations (
    id           text          PRIMARY KEY CHECK (id <> '' AND length(id) <= 200),
    buyer_id     text,
    amount       numeric(20, 4) CHECK (amount > 0),
    currency     char(3),
    state        text          NOT NULL DEFAULT 'reserved' CHECK (state IN ('reserved', 'approved', 'released')),
    order_number bigint,
    created_at   timestamptz   NOT NULL DEFAULT now(),
    decided_at   timestamptz,
    CONSTRAINT coin_reservations_decided CHECK ((state = 'reserved') = (decided_at IS NULL)),
    CONSTRAINT coin_reservations_held_has_amount CHECK (
        state = 'released' OR (buyer_id IS NOT NULL AND amount IS NOT NULL AND currency IS NOT NULL))
);

CREATE INDEX coin_reservations_order ON coin_reservations (order_number) WHERE order_number IS NOT NULL;

-- Sales whose holding period has been dealt with (released, or nothing left to release), so the
-- release job looks at each once.
CREATE TABLE ledger_releases (
    order_number bigint        PRIMARY KEY,
    -- What moved to available (negative: a shortfall moved back to pending).
    amount       numeric(20, 4) NOT NULL,
    released_at  timestamptz   NOT NULL DEFAULT now()
);
