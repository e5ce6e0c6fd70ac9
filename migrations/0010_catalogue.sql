-- The catalogue: sellers (stores), their products, and coupons.

CREATE TABLE sellers (
    id               uuid          PRIMARY KEY DEFAULT gen_random_uuid(),
    name             text          NOT NULL CHECK (name <> '' AND length(name) <= 200),
    payout_frequency text          NOT NULL CHECK (payout_frequency IN ('daily', 'weekly', 'monthly')),
    -- In each currency the seller is paid in: no payout below it.
    payout_minimum   numeric(20, 4) NOT NULL CHECK (payout_minimum >= 0),
    -- Days a sale stays pending before it can be paid out.
    holding_days     integer       NOT NULL DEFAULT 14 CHECK (holding_days BETWEEN 0 AND 365),
    -- The seller's Stripe Connect account, for direct charges.
    stripe_account   text          CHECK (stripe_account ~ '^acct_[A-Za-z0-9]+$'),
    created_at       timestamptz   NOT NULL DEFAULT now()
);

CREATE TABLE products (
    id         uuid          PRIMARY KEY DEFAULT gen_random_uuid(),
    seller_id  uuid          NOT NULL REFERENCES sellers (id),
    name       text          NOT NULL CHECK (name <> '' AND length(name) <= 200),
    kind       text          NOT NULL CHECK (kind IN ('one_off', 'subscription')),
    price      numeric(20, 4) NOT NULL CHECK (price > 0),
    currency   char(3)       NOT NULL CHECK (currency ~ '^[A-Z]{3}$'),
    -- Billing interval of a subscription; a one-off product has none.
    "interval" text          CHECK ("interval" IN ('day', 'week', 'month', 'year')),
    created_at timestamptz   NOT NULL DEFAULT now(),
    CONSTRAINT products_interval_iff_subscription CHECK ((kind = 'subscription') = ("interval" IS NOT NULL))
);

CREATE INDEX products_seller ON products (seller_id);

CREATE TABLE coupons (
    id               uuid          PRIMARY KEY DEFAULT gen_random_uuid(),
    -- Stored upper case; matched case-insensitively.
    code             text          NOT NULL UNIQUE CHECK (code ~ '^[A-Z0-9_-]{1,64}$'),
    percent_off      numeric(5, 2) CHECK (percent_off > 0 AND percent_off <= 100),
    amount_off       numeric(20, 4) CHECK (amount_off > 0),
    currency         char(3)       CHECK (currency ~ '^[A-Z]{3}$'),
    max_redemptions  integer       CHECK (max_redemptions > 0),
    -- Orders holding a redemption now; an order that expires gives its redemption back.
    redemptions      integer       NOT NULL DEFAULT 0,
    valid_from       timestamptz,
    valid_until      timestamptz,
    seller_id        uuid          REFERENCES sellers (id),
    product_id       uuid          REFERENCES products (id),
    created_at       timestamptz   NOT NULL DEFAULT now(),
    CONSTRAINT coupons_one_kind_of_discount CHECK ((percent_off IS NULL) <> (amount_off IS NULL)),
    CONSTRAINT coupons_amount_has_currency CHECK ((amount_off IS NULL) = (currency IS NULL)),
    -- The last barrier against redeeming a coupon beyond its limit under concurrency.
    CONSTRAINT coupons_redemptions_within_limit
        CHECK (redemptions >= 0 AND (max_redemptions IS NULL OR redemptions <= max_redemptions)),
    CONSTRAINT coupons_window_valid CHECK (valid_from IS NULL OR valid_until IS NULL OR valid_from < valid_until)
);
